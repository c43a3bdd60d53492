"""The published training figures of published.json, and how far predictions lie from them.

Each row is one published setting: the overrides that describe it to ``python -m amp_exp.predict``,
the measured throughput per precision (and a published speedup where the source gives only that),
and, for the rows set aside before the roofline was last changed, the date they were held out.
Errors are reported separately for throughput and for speedups, and for the held-out rows apart
from the rest: a row held out is never used to tune the roofline, so its error is the honest one.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PUBLISHED = Path(__file__).with_name("published.json")
# The share of published figures a prediction's stated interval is meant to hold, and the
# intervals themselves: a prediction P stands for [P / F, P x F]. F is what interval_factor
# derives from the rows not held out (scripts/check_published.py prints it, and whether the
# held-out rows fall inside at this rate); tests/test_predict_published.py fails when the
# factors stated here and the script's disagree.
INTERVAL_RATE = 0.8
STATED_INTERVAL = {"throughput": 1.43, "speedup": 1.34}


def published_rows(path: Path = PUBLISHED) -> list[dict[str, Any]]:
    """published.json's rows, each with its published speedup (from its two measured figures
    where it has them) and, where it states a margin, the band a prediction must stay in."""
    rows = json.loads(path.read_text())["rows"]
    for row in rows:
        measured = row.get("measured") or {}
        if "baseline" in row and {row["baseline"], row["precision"]} <= set(measured):
            row["published"] = measured[row["precision"]] / measured[row["baseline"]]
        if "margin" in row:
            low, high = 1 - row["margin"], 1 + row["margin"]
            row["band"] = [row["published"] * low, row["published"] * high]
    return rows


def fitted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows a change to the roofline may be tuned against: every row not held out."""
    return [row for row in rows if "held_out" not in row]


def row_overrides(row: dict[str, Any], *precisions: str) -> list[str]:
    """The overrides that predict ``precisions`` in the row's setting on its device, with the
    row's batch for them where the source trained each precision at its own (the first one's:
    precisions predicted together share a batch)."""
    batch = row.get("batch", {}).get(precisions[0])
    return [
        *row["overrides"],
        *([f"dataset.batch_size={batch}"] if batch else []),
        f"predict.devices=[{row['device']}]",
        f"predict.precisions=[{','.join(precisions)}]",
    ]


@dataclass(frozen=True)
class Comparison:
    row: str
    kind: str  # "throughput" or "speedup"
    what: str  # the precision, or "fp8 over bf16"
    published: float
    predicted: float
    held_out: bool

    @property
    def error(self) -> float:
        """Signed relative error: +0.3 is predicted 30% above the published figure."""
        return self.predicted / self.published - 1


def comparisons(row: dict[str, Any], predicted: dict[str, float]) -> list[Comparison]:
    """A row's throughputs and speedup beside ``predicted`` (throughput per precision, in the
    row's unit; a precision missing from it was not predicted)."""
    held = "held_out" in row
    found = [
        Comparison(row["name"], "throughput", precision, value, predicted[precision], held)
        for precision, value in (row.get("measured") or {}).items()
        if precision in predicted
    ]
    baseline, precision = row.get("baseline"), row.get("precision")
    if baseline in predicted and precision in predicted and "published" in row:
        speedup = predicted[precision] / predicted[baseline]
        what = f"{precision} over {baseline}"
        found.append(Comparison(row["name"], "speedup", what, row["published"], speedup, held))
    return found


def error_summary(found: list[Comparison]) -> dict[tuple[str, bool], dict[str, float]]:
    """Per (kind, held out): the count, median and worst absolute relative error."""
    summary = {}
    for kind in ("throughput", "speedup"):
        for held in (False, True):
            errors = [abs(c.error) for c in found if c.kind == kind and c.held_out == held]
            if errors:
                summary[kind, held] = {
                    "n": len(errors),
                    "median": statistics.median(errors),
                    "worst": max(errors),
                }
    return summary


def interval_factor(found: list[Comparison], kind: str, rate: float = INTERVAL_RATE) -> float:
    """The factor F whose interval [P / F, P x F] is a distribution-free prediction interval at
    ``rate`` for one more figure of ``kind``, from the rows not held out: the k-th smallest of
    their |log(predicted / published)|, k = ceil(rate (n + 1)) (a new figure drawn like the n
    falls below it with probability k / (n + 1)), the largest where n is too small for that."""
    errors = sorted(
        abs(math.log(c.predicted / c.published)) for c in found if c.kind == kind and not c.held_out
    )
    k = min(len(errors), math.ceil(rate * (len(errors) + 1)))
    return math.exp(errors[k - 1])


def coverage(found: list[Comparison], kind: str, factor: float, held: bool) -> tuple[int, int]:
    """How many published figures of ``kind`` (held out or not) lie within the interval
    [P / factor, P x factor] of their prediction P, and of how many."""
    chosen = [c for c in found if c.kind == kind and c.held_out == held]
    inside = sum(1 / factor <= c.predicted / c.published <= factor for c in chosen)
    return inside, len(chosen)
