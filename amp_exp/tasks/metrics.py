"""What a task evaluates: its metrics, the one that judges a precision, and the tolerance's unit.

Plain data without torch, so that the report reads a run's declaration from its summary.json as
cheaply as the run wrote it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class ToleranceUnit(str, Enum):
    """How a difference in the quality metric against fp32 is measured."""

    # 100 x the difference of two fractions: accuracy points.
    points = "points"
    # (value - fp32's) / |fp32's|: a relative loss error, as DeepSeek-V3 reports it.
    relative = "relative"


@dataclass(frozen=True)
class Metric:
    """One evaluation metric: its key in metrics rows and summary.json, and how people read it."""

    name: str
    # The word the console shows: "accuracy", "perplexity".
    label: str
    # A format spec for the console: ".2%", ".4f".
    fmt: str = ".4f"


@dataclass(frozen=True)
class TaskMetrics:
    """What a task evaluates, and which of its metrics decides whether a precision is safe."""

    metrics: tuple[Metric, ...]
    # The name of the metric a precision comparison is judged on.
    quality: str
    higher_is_better: bool
    tolerance_unit: ToleranceUnit
    # report.tolerance when it is null, in ``tolerance_unit``.
    default_tolerance: float

    def __post_init__(self) -> None:
        if self.quality not in self.names:
            raise ValueError(f"quality metric {self.quality!r} is not one of {self.names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(metric.name for metric in self.metrics)

    def delta(self, value: float | None, baseline: float | None) -> float | None:
        """``value`` against ``baseline`` in the tolerance's unit; None if either is missing."""
        if value is None or baseline is None:
            return None
        if self.tolerance_unit is ToleranceUnit.points:
            return 100 * (value - baseline)
        return (value - baseline) / abs(baseline) if baseline else None

    def as_dict(self) -> dict[str, Any]:
        """summary.json's ``task_metrics``: what a report needs to judge this task's runs."""
        return {
            **asdict(self),
            "metrics": [asdict(metric) for metric in self.metrics],
            "tolerance_unit": self.tolerance_unit.value,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> TaskMetrics:
        return cls(
            metrics=tuple(Metric(**metric) for metric in record["metrics"]),
            quality=record["quality"],
            higher_is_better=bool(record["higher_is_better"]),
            tolerance_unit=ToleranceUnit(record["tolerance_unit"]),
            default_tolerance=float(record["default_tolerance"]),
        )
