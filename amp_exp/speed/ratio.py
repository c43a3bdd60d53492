"""The speedup of a pair's rounds: a t interval on the log of each round's ratio, and a trend test.

A speed ratio is multiplicative (2x faster and 2x slower are equally far from 1x), so the rounds'
log ratios are averaged and their 95% t interval is exponentiated: the estimate is the geometric
mean of the per-round ratios and the interval is symmetric on the log scale. The t interval
assumes the log ratios are normal and independent; AB/BA order keeps a position effect from
biasing the mean (it only widens the interval), and Spearman's rank correlation of the log ratio
against the round flags the drift that the independence assumption would miss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from amp_exp.report.stats import CONFIDENCE

# Spearman's test at this level flags a trend in the rounds' log ratios.
TREND_LEVEL = 0.05


@dataclass(frozen=True)
class Speedup:
    """How many times faster than the baseline a candidate trained."""

    # The geometric mean over rounds of the baseline's median step over the candidate's.
    ratio: float
    ci95: tuple[float, float]
    rounds: int
    # Wall clock: the baseline's total time per applied step over the candidate's.
    total_time_ratio: float
    # Spearman's rank correlation of the log ratio with the round, and its two-sided p-value.
    trend_rho: float
    trend_p: float

    @property
    def trend(self) -> bool:
        return self.trend_p < TREND_LEVEL

    def as_dict(self) -> dict[str, object]:
        return {
            "ratio": self.ratio,
            "ci95": list(self.ci95),
            "rounds": self.rounds,
            "total_time_ratio": self.total_time_ratio,
            "trend": {"spearman_rho": self.trend_rho, "p_value": self.trend_p, "flag": self.trend},
        }


def speedup(
    baseline_seconds: Sequence[float], seconds: Sequence[float], total_time_ratio: float
) -> Speedup:
    """Round k's ratio is the baseline's time per applied step over the candidate's, both of
    round k; ``total_time_ratio`` is the same over all the timed steps."""
    logs = np.log(np.asarray(baseline_seconds, dtype=float) / np.asarray(seconds, dtype=float))
    if logs.size < 2 or not np.all(np.isfinite(logs)):
        raise ValueError(f"{logs.size} rounds with finite times are needed, at least 2")
    sem = stats.sem(logs)
    if sem == 0:
        # Only a coarse clock gives every round the same ratio: that is no measured spread.
        raise ValueError("every round gave the same ratio: the clock measured no spread")
    low, high = stats.t.interval(CONFIDENCE, logs.size - 1, loc=logs.mean(), scale=sem)
    trend = stats.spearmanr(np.arange(logs.size), logs)
    return Speedup(
        math.exp(logs.mean()),
        (math.exp(low), math.exp(high)),
        int(logs.size),
        total_time_ratio,
        float(trend.statistic),
        float(trend.pvalue),
    )
