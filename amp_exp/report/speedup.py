"""A speed trial's speedup as the report shows it: its one interval and that interval's level,
in every table, plot and sentence alike (speed/ratio.py computes it)."""

from __future__ import annotations

from typing import Any

from amp_exp.report.compare import BASELINE
from amp_exp.report.shown import show_level


def trial_interval(found: dict[str, Any]) -> tuple[float, float, float]:
    """A speed trial's one interval and its level: the level its looks were made at
    (speed/ratio.py), or 95% in a speed.json written before the trial looked."""
    if "ci" in found:
        low, high = found["ci"]
        return low, high, found["confidence"]
    low, high = found["ci95"]
    return low, high, 0.95


def established(found: dict[str, Any]) -> str | None:
    """What a speed trial establishes against fp32: ``"faster"`` where its interval lies wholly
    above 1, ``"slower"`` wholly below, None where it reaches across 1 or its rounds trend (the
    machine's speed drifted under it, which the interval assumes it did not). The one rule every
    "faster" claim rests on: the recommendation, the verdict lines, the doctor."""
    if (found.get("trend") or {}).get("flag", False):
        return None
    low, high, _ = trial_interval(found)
    return "faster" if low > 1 else "slower" if high < 1 else None


def trial_levels(intervals: list[tuple[float, float, float]]) -> str:
    """The level of the trials' intervals ("97.5%"), each where trials of two levels are shown."""
    levels = sorted({show_level(level) for _, _, level in intervals})
    return " or ".join(levels)


def speedup_cell(speedup: dict[str, Any] | None) -> str:
    """A speed trial's speedup and its interval: 1.12x [1.05, 1.20]."""
    if speedup is None:
        return "-"
    low, high, _ = trial_interval(speedup)
    return f"{speedup['ratio']:.2f}x [{low:.2f}, {high:.2f}]"


def bar_speed(row: dict[str, Any]) -> str | None:
    """A run's speed under its throughput bar: the speed trial's figure for its precision, or that
    none was measured (its samples/s over fp32's, jobs timed one after another on a shared
    machine, is no speedup: the recommendation's rule); nothing under fp32's own bar."""
    if row["label"] == BASELINE:
        return None
    trial = row["trial_speedup"]
    return "speedup not\nmeasured (no trial)" if trial is None else f"trial {speedup_cell(trial)}"
