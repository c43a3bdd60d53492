"""``python -m amp_exp.report DIR [DIR ...]``: the comparison report of runs on disk.

It finds every run (a directory with summary.json) under the given directories and writes
report.md, report.json and PNG plots; with ``--wandb`` it then saves the same comparison as a
W&B Report and prints its URL. The Hydra callback (report/callback.py) builds the same report
when a multirun ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from amp_exp.config.schema import ReportConfig
from amp_exp.errors import EXIT_CONFIG_ERROR, RuntimeFault
from amp_exp.report.assemble import build_report
from amp_exp.report.runs import ReportError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m amp_exp.report",
        description="Compare runs: writes report.md, report.json and PNG plots.",
    )
    parser.add_argument(
        "dirs", nargs="+", type=Path, metavar="DIR", help="a sweep or run directory"
    )
    parser.add_argument(
        "--out", type=Path, help="where to write the report (default: DIR, or the parent of all)"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=ReportConfig.tolerance,
        help="how far a run's quality metric may lie from fp32's, in the unit its task declares "
        "(accuracy points, or relative loss); default: each task's own",
    )
    parser.add_argument(
        "--familywise",
        action="store_true",
        help="Holm across the report's comparisons, a family per claim at 2.5%% each "
        "(report.familywise)",
    )
    parser.add_argument(
        "--wandb",
        action="store_true",
        help="also save the comparison as a W&B Report of the runs' project and print its URL "
        "(needs amp_exp[wandb-report] and an API key)",
    )
    parser.add_argument(
        "--wandb-timeout",
        type=float,
        default=ReportConfig.wandb_timeout,
        help="seconds to wait for the W&B server (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.tolerance is not None and args.tolerance < 0:
        parser.error("--tolerance must be 0 or more")
    if args.wandb_timeout <= 0:
        parser.error("--wandb-timeout must be positive")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Matplotlib says so when it builds its font cache (the first plot in a fresh home): not a
    # line of this command's output, which is the report, or one error line.
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    out_dir = args.out or Path(os.path.commonpath([d.resolve() for d in args.dirs]))
    try:
        report = build_report(args.dirs, out_dir, args.tolerance, args.familywise)
    except ReportError as error:
        print(f"amp_exp.report: error: {error}", file=sys.stderr)
        return 1
    except RuntimeFault as error:  # report.md cannot be written there: read-only, or full
        print(f"amp_exp.report: error: {error}; write it elsewhere with --out DIR", file=sys.stderr)
        return error.exit_status
    print("\n".join(report["verdicts"]))
    print(f"report: {out_dir / 'report.md'}")
    if args.wandb:
        from amp_exp.report.wandb_report import WandbReportError, publish_report

        try:
            url = publish_report(args.dirs, out_dir, report, args.wandb_timeout)
        except WandbReportError as error:
            print(f"amp_exp.report: error: {error}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        print(f"W&B report: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
