"""How a run gave no usable result, by what it says about its precision: a numerical fault, a
divergence or an out-of-memory is a finding about the precision (it cannot train this seed);
a kill or a stop from outside is missing data (report/evidence.py's seed account)."""

from __future__ import annotations

import math
import re
from typing import Any

Row = dict[str, Any]
# How a seed's attempt ended when it gave no result, by what it says about the precision: a
# finding about it (it cannot train this seed), or missing data (it was stopped from outside).
PRECISION_FAILURES = ("numerical", "diverged", "out_of_memory")
# Where a fault's message names the step it happened at ("at step 12", "by step 40").
STEP_IN_MESSAGE = re.compile(r"\bstep (\d+)")


def finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def first_nonfinite_step(metrics: list[dict[str, Any]]) -> int | None:
    """The first logged step whose loss or an eval metric is not finite (a skipped fp16 step's
    gradient norm is inf with a finite loss: no divergence)."""
    for row in metrics:
        values = [v for k, v in row.items() if k == "loss" or k.startswith("eval_")]
        if "step" in row and not all(finite(v) for v in values if isinstance(v, float)):
            return int(row["step"])
    return None


def last_step(metrics: list[dict[str, Any]]) -> int | None:
    steps = [int(row["step"]) for row in metrics if "step" in row]
    return max(steps) if steps else None


def failure(row: Row, metrics: dict[str, list]) -> dict[str, Any] | None:
    """How a run gave no usable result: ``status`` (``PRECISION_FAILURES``, or the run's own
    status: failed, killed, stopped), ``reason`` and the ``step``; None for a usable run."""
    logged = metrics.get(row["run"], [])
    error = row["error"] or ""
    if row["status"] == "completed":
        if finite(row["final_loss"]) and finite(row["quality"]):
            return None
        bad = row["final_loss"] if not finite(row["final_loss"]) else row["quality"]
        return {
            "status": "diverged",
            "reason": f"non-finite ({bad})",
            "step": first_nonfinite_step(logged),
        }
    if row["status"] == "failed" and error.startswith("NumericalFault"):
        status = "numerical"
    elif row["status"] == "failed" and ("OutOfMemory" in error or "out of memory" in error):
        status = "out_of_memory"
    else:
        status = str(row["status"])
    named = STEP_IN_MESSAGE.search(error)
    step = int(named.group(1)) if named else last_step(logged)
    return {"status": status, "reason": error or status, "step": step}
