"""``python -m amp_exp.report DIR [DIR ...]``: the comparison report of runs on disk.

It finds every run (a directory with summary.json) under the given directories and writes
report.md, report.json and PNG plots; with ``--wandb`` it then saves the same comparison as a
W&B Report and prints its URL. The Hydra callback (report/assemble.py) builds the same report
when a multirun ends.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path

from amp_exp.config.schema import FAMILYWISE, ReportConfig
from amp_exp.errors import RuntimeFault
from amp_exp.report.assemble import build_report
from amp_exp.report.decision import DEFAULT_FAMILYWISE
from amp_exp.report.runs import ReportError, run_paths
from amp_exp.results.contract import OneLineParser, enter
from amp_exp.results.files import REPORT_JSON, REPORT_MD, UntrustedFile, read_json
from amp_exp.results.ownership import RunDirectoryBusy, hold_output

COMMAND = "amp_exp.report"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m amp_exp.report")
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
        choices=FAMILYWISE,
        default=DEFAULT_FAMILYWISE,
        help="holm (default): Holm across the report's comparisons, a family per claim at 2.5%% "
        "each; none: each comparison at its own level (report.familywise)",
    )
    parser.add_argument(
        "--forecast-steps",
        type=int,
        help="the planned length each precision's long-run signals are forecast to "
        "(report.forecast_steps; default: 10 times each run's steps)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace a report there that covers runs this one leaves out",
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
    if args.forecast_steps is not None and args.forecast_steps <= 0:
        parser.error(f"--forecast-steps must be a positive number; got {args.forecast_steps}")
    # The sweep config's report.tolerance refuses the same values (config/values.py).
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        parser.error(f"--tolerance must be a finite number, 0 or more; got {args.tolerance}")
    if not (math.isfinite(args.wandb_timeout) and args.wandb_timeout > 0):
        parser.error(
            f"--wandb-timeout must be a positive number of seconds; got {args.wandb_timeout}"
        )
    return args


def reported_runs(out_dir: Path) -> set[str]:
    """The runs (relative to ``out_dir``) of the report already there; empty if none."""
    try:
        return {str(row["run"]) for row in read_json(out_dir / REPORT_JSON)["runs"]}
    except UntrustedFile:
        raise
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def where_to_write(dirs: list[Path], out_dir: Path, force: bool) -> Path:
    """``out_dir``, unless it holds a report of runs this one leaves out: a report of fewer of a
    sweep's runs never replaces the sweep's (without ``--force``), it goes beside it."""
    left_out = reported_runs(out_dir) - {os.path.relpath(p, out_dir) for p in run_paths(dirs)}
    if force or not left_out:
        return out_dir
    beside = next(
        out_dir / f"report_{n}" for n in range(2, 10**6) if not (out_dir / f"report_{n}").exists()
    )
    print(
        f"{out_dir / REPORT_MD} covers {len(left_out)} run(s) this report leaves out, so it stays "
        f"as it is; this report goes to {beside}/ (--force replaces it)"
    )
    return beside


def run(argv: list[str] | None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Matplotlib says so when it builds its font cache (the first plot in a fresh home): not a
    # line of this command's output, which is the report, or one error line.
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    # A DIR that is no directory is refused in one line by run_paths, before anything is written.
    out_dir = args.out or Path(os.path.commonpath([d.resolve() for d in args.dirs]))
    out_dir = where_to_write(args.dirs, out_dir.resolve(), args.force)
    try:
        with hold_output(out_dir):
            report = build_report(
                args.dirs, out_dir, args.tolerance, args.familywise, args.forecast_steps
            )
    except RuntimeFault as error:  # report.md cannot be written there: read-only, or full
        raise RuntimeFault(f"{error}; write it elsewhere with --out DIR") from None
    except RunDirectoryBusy as busy:  # its advice is a run's (hydra.run.dir=...)
        in_use = str(busy).partition("; ")[0]
        raise ReportError(
            f"{in_use}; wait for it, or write the report elsewhere with --out DIR"
        ) from None
    print("\n".join(report["verdicts"]))
    print(f"report: {out_dir / REPORT_MD}")
    if args.wandb:
        from amp_exp.report.wandb_report import WandbReportError, publish_report

        try:
            url = publish_report(args.dirs, out_dir, report, args.wandb_timeout)
        except WandbReportError as error:
            raise ReportError(str(error)) from None
        print(f"W&B report: {url}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return enter(COMMAND, lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
