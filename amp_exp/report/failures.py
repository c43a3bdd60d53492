"""How a run gave no usable result, by what it says about its precision: a numerical fault, a
divergence or an out-of-memory is a finding about the precision (it cannot train this seed);
a kill or a stop from outside is missing data (report/evidence.py's seed account)."""

from __future__ import annotations

import math
import re
from typing import Any

from amp_exp.report.learned import initial_loss

Row = dict[str, Any]
# A completed run whose final loss is this many times the first it logged diverged, even where
# the loss stayed finite (fp32 at 4e10 after 37 skipped steps is no baseline).
DIVERGED_GROWTH = 10.0
# A run that skipped more than this share of its steps took far fewer updates than it claims.
SKIPPED_SHARE = 0.1
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
        grew = loss_growth(row, logged)
        if grew is not None:
            return {"status": "diverged", "reason": grew, "step": None}
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


def loss_growth(row: Row, metrics: list[dict[str, Any]]) -> str | None:
    """Why a completed run's finite loss counts as diverged (``DIVERGED_GROWTH``), or None."""
    first, final = initial_loss(metrics), row["final_loss"]
    if first is None or final is None or not math.isfinite(final) or first <= 0:
        return None
    if final <= DIVERGED_GROWTH * first:
        return None
    return f"the loss rose from {first:.3g} to {final:.3g}"


def troubles(row: Row, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What keeps a completed run's checks from having passed, whatever its diagnostics said: a
    diverged loss (non-finite, or ``DIVERGED_GROWTH`` times its first), and the share of its
    steps it skipped (a trouble above ``SKIPPED_SHARE``)."""
    diverged = None
    if row["status"] == "completed":
        bad = row["final_loss"] is not None and not math.isfinite(row["final_loss"])
        diverged = f"the loss is {row['final_loss']}" if bad else loss_growth(row, metrics)
    steps, skipped = row.get("steps"), row.get("skipped_steps")
    share = skipped / steps if steps and skipped is not None else None
    return {"diverged": diverged, "skipped_share": share}
