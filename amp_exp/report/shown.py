"""How the report writes a number it claims: an interval's level, a difference and its interval
at the decimals their width needs, a tolerance. One place, so every table and sentence agree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from amp_exp.tasks.metrics import ToleranceUnit


def show_level(confidence: float) -> str:
    """An interval's level: 95%, 97.5%, 98.33%."""
    return f"{confidence * 100:.4g}%"


def decimals(interval: list[float] | None, unit: ToleranceUnit) -> int:
    """Enough decimals (2 to 6) that an interval of some width never shows as one number, nor a
    bound off zero as zero: [-0.00%, +0.00%] would claim no spread, [-0.01%, -0.00%] a bound
    that is not there."""
    scale = 1 if unit is ToleranceUnit.points else 100
    places = 2
    while interval is not None and places < 6:
        shown = [round(bound * scale, places) for bound in interval]
        if shown[0] != shown[1] and all(s or not b for s, b in zip(shown, interval, strict=True)):
            break
        places += 1
    return places


def show_delta(delta: float, unit: ToleranceUnit, interval: list[float] | None = None) -> str:
    """A difference, at as many decimals as its ``interval`` needs."""
    places = decimals(interval, unit)
    return f"{delta:+.{places}f} points" if unit is ToleranceUnit.points else f"{delta:+.{places}%}"


def show_interval(interval: list[float], unit: ToleranceUnit) -> str:
    places = decimals(interval, unit)
    low, high = interval
    if unit is ToleranceUnit.points:
        return f"[{low:+.{places}f}, {high:+.{places}f}]"
    return f"[{low:+.{places}%}, {high:+.{places}%}]"


def show_tolerance(tolerance: float, unit: ToleranceUnit) -> str:
    return f"±{tolerance:g} points" if unit is ToleranceUnit.points else f"±{tolerance:.2%}"


def ratio_of(key: str) -> Callable[[dict[str, Any]], str | None]:
    """A row's ratio to fp32 under ``key`` as a bar's label shows it: 0.50x, or None."""
    return lambda row: None if row[key] is None else f"{row[key]:.2f}x"
