"""python -m amp_exp.predict against every published figure of amp_exp/predict/published.json:
each row's setting predicted on its device, its throughputs and its speedup beside the published
ones, then the median and worst error of throughput and of speedups, the held-out rows apart
(docs/hardware.md). Each distinct setting is traced once, in this process; ``check`` and
``report`` are what tests/test_predict_published.py calls.

    python scripts/check_published.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from amp_exp.config.preflight import run_config  # noqa: E402
from amp_exp.devices import PREDICTABLE  # noqa: E402
from amp_exp.predict.predict import predict_trace  # noqa: E402
from amp_exp.predict.published import (  # noqa: E402
    INTERVAL_RATE,
    STATED_INTERVAL,
    Comparison,
    comparisons,
    coverage,
    error_summary,
    interval_factor,
    published_rows,
    row_overrides,
)
from amp_exp.predict.roofline import setting, step_costs  # noqa: E402
from amp_exp.predict.trace import trace_step  # noqa: E402


def predicted_rates(row: dict, traces: dict, unfitting: list[str]) -> dict[str, float]:
    """The row's throughput per precision, predicted on its device: the precisions that share a
    batch from one config, and traces shared between rows and precisions with the same setting
    (a trace does not depend on the precision).

    The published run ran, so a setting that does not fit by amp_exp's memory model (its eager
    fp32 logits and norm inputs, which the source's fused kernels do not keep) is still timed,
    by the same roofline, and named in ``unfitting``."""
    wanted = [*(row.get("measured") or {}), row.get("baseline"), row.get("precision")]
    by_batch: dict = {}
    for precision in dict.fromkeys(filter(None, wanted)):
        by_batch.setdefault(row.get("batch", {}).get(precision), []).append(precision)
    device = PREDICTABLE[row["device"]]
    rates = {}
    for precisions in by_batch.values():
        overrides = row_overrides(row, *precisions)
        cfg = run_config(overrides)
        # The trace runs in fp32 whatever the precision (predict/trace.py): a row that only
        # names another precision or recipe shares its setting's trace.
        key = tuple(o for o in overrides if not o.startswith(("predict.", "precision")))
        if key not in traces:
            traces[key] = trace_step(cfg)
        trace = traces[key]
        found = predict_trace(cfg, trace)["devices"][row["device"]]["precisions"]
        for precision in precisions:
            record = found[precision]
            if record["supported"] and not record["fits"]:
                run = setting(cfg, trace, precision)
                seconds = sum(c.seconds for c in step_costs(cfg, trace, run, device))
                per_sample = 1 if row["per_s"] == "samples_per_s" else trace.units_per_sample
                rates[precision] = trace.batch_size * per_sample / seconds
                unfitting.append(f"- {row['name']} {precision}: timed, though {record['why']}")
            elif record[row["per_s"]] is not None:
                rates[precision] = record[row["per_s"]]
    return rates


def table(found: list[Comparison]) -> list[str]:
    lines = [
        "| row | held out | figure | published | predicted | error |",
        "|---|---|---|---|---|---|",
    ]
    for c in found:
        shown = (lambda v: f"{v:.2f}x") if c.kind == "speedup" else (lambda v: f"{v:,.0f}")
        lines.append(
            f"| {c.row} | {'yes' if c.held_out else 'no'} | {c.kind} {c.what} | "
            f"{shown(c.published)} | {shown(c.predicted)} | {c.error:+.0%} |"
        )
    return lines


def summary_lines(found: list[Comparison]) -> list[str]:
    lines = ["| figure | rows | n | median error | worst error |", "|---|---|---|---|---|"]
    for (kind, held), stats in error_summary(found).items():
        lines.append(
            f"| {kind} | {'held out' if held else 'not held out'} | {stats['n']} | "
            f"{stats['median']:.0%} | {stats['worst']:.0%} |"
        )
    return lines


def interval_lines(found: list[Comparison]) -> list[str]:
    """Per kind: the interval factor the rows not held out give at the stated rate, the one
    predict states, and the share of figures inside the stated one, held out and not."""
    lines = [
        f"| figure | derived factor at {INTERVAL_RATE:.0%} | stated factor | inside, not held out "
        "| inside, held out |",
        "|---|---|---|---|---|",
    ]
    for kind, stated in STATED_INTERVAL.items():
        shares = []
        for held in (False, True):
            inside, n = coverage(found, kind, stated, held)
            shares.append(f"{inside} of {n} ({inside / n:.0%})" if n else "-")
        lines.append(
            f"| {kind} | {interval_factor(found, kind):.2f} | {stated:.2f} | {' | '.join(shares)} |"
        )
    return lines


@dataclass
class Checked:
    """Every row's comparisons, the lines naming rows timed though they do not fit or not
    predicted at all, and how many settings were traced."""

    found: list[Comparison] = field(default_factory=list)
    unfitting: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    traced: int = 0


def check(rows: list[dict], progress: bool = False) -> Checked:
    """Each row predicted beside its published figures; ``progress`` names each row on stderr
    as it starts (the whole table takes minutes)."""
    start = time.perf_counter()
    traces: dict = {}
    checked = Checked()
    for row in rows:
        if progress:
            print(f"{row['name']} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        try:
            checked.found += comparisons(row, predicted_rates(row, traces, checked.unfitting))
        except Exception as error:  # a row that cannot be predicted is reported, not skipped
            why = f"{type(error).__name__}: {error}"
            checked.failed.append(f"- {row['name']}: not predicted: {why}")
    checked.traced = len(traces)
    return checked


def report(checked: Checked) -> list[str]:
    """The lines the script prints: the table, the rows it names, the errors, the intervals."""
    return [
        *table(checked.found),
        *checked.unfitting,
        *checked.failed,
        "",
        *summary_lines(checked.found),
        "",
        *interval_lines(checked.found),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="row names (default: every row)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = [row for row in published_rows() if not args.only or row["name"] in args.only]
    checked = check(rows, progress=True)
    print("\n".join(report(checked)))
    print(f"\n{checked.traced} settings traced in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
