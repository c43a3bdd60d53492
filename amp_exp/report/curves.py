"""Training-loss curves against fp32's: the gap at matched steps, and the band of fp32's seeds.

A curve is a run's training loss at each logged step (the mean over its log interval). Jobs of
one setting train on the same global batch, so step N of two jobs has seen the same samples or
tokens: curves are compared step by step, at the steps both logged.

- The **loss gap** averages, over the last 10% of training, the relative gap (l - l_fp32) / l_fp32,
  as DeepSeek-V3 reports it (below 0.25%), and the absolute gap l - l_fp32, as Megatron states its
  fp8 bar (below 0.01).
- The **fp32 band** is the lowest to the highest fp32 seed at each step, drawn in loss_curves.png
  as a picture of seed-to-seed spread. It is no test: pointwise bands from 2 or 3 seeds, and a
  step picked after seeing the curves, have no error control; the paired gap is the evidence.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

Curve = dict[int, float]
Band = dict[int, tuple[float, float]]

LAST_FRACTION = 0.1


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


def gap_curve(curve: Curve, baseline: Curve) -> Curve:
    """The relative gap (l - l_fp32) / l_fp32 at each step both logged, where fp32 is not 0."""
    return {
        step: (curve[step] - baseline[step]) / abs(baseline[step])
        for step in sorted(baseline)
        if step in curve and baseline[step] != 0
    }


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
