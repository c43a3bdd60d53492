"""Training-loss curves against fp32's: the gap at matched steps, and the band of fp32's seeds.

A curve is a run's training loss at each logged step (the mean over its log interval). Jobs of
one setting train on the same global batch, so step N of two jobs has seen the same samples or
tokens: curves are compared step by step, at the steps both logged.

- The **loss gap** averages, over the last 10% of training, the relative gap (l - l_fp32) / l_fp32,
  as DeepSeek-V3 reports it (below 0.25%), and the absolute gap l - l_fp32, as Megatron states its
  fp8 bar (below 0.01).
- The **fp32 band** is the lowest to the highest fp32 seed at each step. A precision's mean curve
  over its seeds *leaves the band for good* at step N when from N to the end of training every
  logged point lies outside the band on one side, over at least ``MIN_POINTS_OUTSIDE`` points.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

Curve = dict[int, float]
Band = dict[int, tuple[float, float]]

LAST_FRACTION = 0.1
# One point outside a band of three seeds happens by chance; a stretch of them does not.
MIN_POINTS_OUTSIDE = 2


def train_curve(metrics: Iterable[dict[str, Any]]) -> Curve:
    """The training loss at each logged step of a run's metrics.jsonl rows."""
    return {
        int(row["step"]): float(row["loss"])
        for row in metrics
        if row.get("kind") == "train" and row.get("loss") is not None and "step" in row
    }


def final_steps(curve: Curve) -> list[int]:
    """The logged steps in the last ``LAST_FRACTION`` of training (the last one at least)."""
    if not curve:
        return []
    last = max(curve)
    return sorted(step for step in curve if step >= (1 - LAST_FRACTION) * last)


def loss_gap(curve: Curve, baseline: Curve) -> tuple[float, float] | None:
    """(relative, absolute) gap of ``curve`` over ``baseline``, averaged over the last 10% of the
    baseline's steps that both logged; None without such steps or when a loss is not finite."""
    steps = [step for step in final_steps(baseline) if step in curve and baseline[step] != 0]
    if not steps:
        return None
    relative = [(curve[s] - baseline[s]) / abs(baseline[s]) for s in steps]
    absolute = [curve[s] - baseline[s] for s in steps]
    gaps = (sum(relative) / len(steps), sum(absolute) / len(steps))
    return gaps if all(math.isfinite(gap) for gap in gaps) else None


def common_steps(curves: Sequence[Curve]) -> list[int]:
    steps = set(curves[0]) if curves else set()
    for curve in curves[1:]:
        steps &= set(curve)
    return sorted(steps)


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """The mean over ``curves`` at the steps all of them logged."""
    return {
        step: sum(curve[step] for curve in curves) / len(curves) for step in common_steps(curves)
    }


def band(curves: Sequence[Curve]) -> Band:
    """The lowest and highest of ``curves`` at each step all logged; empty for one curve."""
    if len(curves) < 2:
        return {}
    return {
        step: (min(c[step] for c in curves), max(c[step] for c in curves))
        for step in common_steps(curves)
    }


def left_band_at(curve: Curve, fp32_band: Band) -> tuple[int, str] | None:
    """(step, "above" or "below") where ``curve`` leaves ``fp32_band`` for good, or None."""
    steps = [step for step in sorted(fp32_band) if step in curve]

    def side(step: int) -> str | None:
        low, high = fp32_band[step]
        value = curve[step]
        if not math.isfinite(value) or value > high:
            return "above"
        return "below" if value < low else None

    if not steps or side(steps[-1]) is None:
        return None
    where = side(steps[-1])
    first = len(steps) - 1
    while first > 0 and side(steps[first - 1]) == where:
        first -= 1
    if len(steps) - first < MIN_POINTS_OUTSIDE:
        return None
    return steps[first], str(where)
