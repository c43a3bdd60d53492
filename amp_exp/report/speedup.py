"""A speed trial's speedup as the report shows it: its one interval and that interval's level,
in every table, plot and sentence alike (speed/ratio.py computes it)."""

from __future__ import annotations

from typing import Any

from amp_exp.report.shown import show_level


def trial_interval(found: dict[str, Any]) -> tuple[float, float, float]:
    """A speed trial's one interval and its level: the level its looks were made at
    (speed/ratio.py), or 95% in a speed.json written before the trial looked."""
    if "ci" in found:
        low, high = found["ci"]
        return low, high, found["confidence"]
    low, high = found["ci95"]
    return low, high, 0.95


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
