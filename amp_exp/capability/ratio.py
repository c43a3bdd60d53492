"""The speedup of a pair's rounds: an interval on the log of each round's ratio that holds when
rounds are autocorrelated, with an order (carry-over) term, and a trend test.

A speed ratio is multiplicative (2x faster and 2x slower are equally far from 1x), so the rounds'
log ratios are modelled and the interval is exponentiated: the estimate is the geometric mean of
the per-round ratios, averaged over the two orders, and the interval is symmetric on the log
scale. The log ratio of round k is a + b * o_k + e_k, o_k = +1/2 for AB and -1/2 for BA: b is
the carry-over (what running first does to a side), which AB/BA balance keeps out of a and the
model keeps out of the spread. Rounds on a shared machine are autocorrelated (a neighbour's
load spans several rounds), so a's standard error is Newey-West's (Bartlett kernel, lag
round(sqrt(n))), and its critical value is not Student's t but one calibrated by simulation
(scripts/calibrate_rules.py, calibration.json's ``speed``) so that the interval covers at its
stated level under AR(1) rounds with autocorrelation up to ``MAX_RHO`` (a plain t interval
labelled 97.5% covers 85-88% at 0.4 and 73-75% at 0.6). Spearman's rank correlation of the log
ratio against the round flags a drift (TREND), which blocks a "faster" claim in the report.

The trial stops when it knows (``looks``, ``narrow``): it looks every ``LOOK_EVERY`` rounds and
stops once the interval at ``TRIAL_CONFIDENCE`` has a half-width below ``speed.target_halfwidth``
on the log scale. Stopping on an interval's width is a fixed-width (Chow-Robbins) problem: the
looks only bias its coverage through the spread, which the stricter level more than pays for (in
simulation, at least 97% at looks every 10 rounds; checking every round covers 92.6%).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from amp_exp.report.stats import NO_SPREAD, calibration

# Spearman's test at this level flags a trend in the rounds' log ratios.
TREND_LEVEL = 0.05
# The trial looks at its interval every this many rounds (an even number keeps AB/BA balanced)...
LOOK_EVERY = 10
# ...at this level, and reports the interval at it.
TRIAL_CONFIDENCE = 0.975
# The interval's critical values are calibrated to cover under AR(1) rounds up to this rho.
MAX_RHO = 0.6
# The fewest rounds the model (a level, an order term and a residual spread) can be fitted to.
MIN_ROUNDS = 4
# AB rounds +1/2, BA rounds -1/2: the order (carry-over) term's regressor.
AB, BA = 0.5, -0.5


def orders(n: int) -> np.ndarray:
    return np.where(np.arange(n) % 2 == 0, AB, BA)


def fit(logs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a, its Newey-West standard error, b) of log ratio = a + b * order, along the last axis
    (many trials at once in simulation)."""
    logs = np.asarray(logs, dtype=float)
    n = logs.shape[-1]
    design = np.stack([np.ones(n), orders(n)], axis=1)
    inverse = np.linalg.inv(design.T @ design)
    beta = logs @ design @ inverse
    scores = (logs - beta @ design.T)[..., :, None] * design
    lag = max(1, round(math.sqrt(n)))
    spread = np.einsum("...ti,...tj->...ij", scores, scores)
    for step in range(1, lag + 1):
        ahead = np.einsum("...ti,...tj->...ij", scores[..., step:, :], scores[..., :-step, :])
        spread = spread + (1 - step / (lag + 1)) * (ahead + np.swapaxes(ahead, -1, -2))
    variance = inverse @ spread @ inverse
    return beta[..., 0], np.sqrt(variance[..., 0, 0]), beta[..., 1]


def critical_value(n: int) -> float:
    """The calibrated critical value at ``n`` rounds (``TRIAL_CONFIDENCE``); beyond the table
    the last one, which is larger than the true one there (they fall with n)."""
    table = calibration()["speed"]["critical"]
    return float(table.get(str(n), table[max(table, key=int)]))


def looks(min_rounds: int, max_rounds: int) -> list[int]:
    """The round counts at which the trial looks: ``min_rounds``, then every ``LOOK_EVERY``,
    and ``max_rounds`` last."""
    return [*range(min_rounds, max_rounds, LOOK_EVERY), max_rounds]


def log_half_width(logs: np.ndarray) -> np.ndarray:
    """The interval's half-width of the log speedup at ``TRIAL_CONFIDENCE``, along the last axis
    (many trials at once in simulation)."""
    logs = np.asarray(logs, dtype=float)
    return critical_value(logs.shape[-1]) * fit(logs)[1]


def narrow(logs: np.ndarray, target_halfwidth: float) -> np.ndarray:
    """Whether the trial knows enough to stop: its interval's half-width, on the log scale, is
    below the target (ln 1.05: the speedup known within 5% either way)."""
    return log_half_width(logs) < target_halfwidth


@dataclass(frozen=True)
class Speedup:
    """How many times faster than the baseline a candidate trained."""

    # The geometric mean over rounds of the baseline's median step over the candidate's.
    ratio: float
    rounds: int
    # The trial's one interval, at the level its looks were made at (``TRIAL_CONFIDENCE``): a
    # second one at another level would be a second claim about the same speed.
    ci: tuple[float, float]
    confidence: float
    # Wall clock: the baseline's total time per applied step over the candidate's.
    total_time_ratio: float
    # Spearman's rank correlation of the log ratio with the round, and its two-sided p-value.
    trend_rho: float
    trend_p: float
    # exp(b): how much larger the ratio is in AB rounds than in BA rounds (1: no carry-over).
    carry_over: float

    @property
    def trend(self) -> bool:
        return self.trend_p < TREND_LEVEL

    def as_dict(self) -> dict[str, object]:
        return {
            "ratio": self.ratio,
            "rounds": self.rounds,
            "ci": list(self.ci),
            "confidence": self.confidence,
            "total_time_ratio": self.total_time_ratio,
            "trend": {"spearman_rho": self.trend_rho, "p_value": self.trend_p, "flag": self.trend},
            "carry_over": self.carry_over,
        }


def speedup(
    baseline_seconds: Sequence[float], seconds: Sequence[float], total_time_ratio: float
) -> Speedup:
    """Round k's ratio is the baseline's time per applied step over the candidate's, both of
    round k, round 0 AB and then alternating; ``total_time_ratio`` is the same over all the timed
    steps. ``ci`` is the interval at ``TRIAL_CONFIDENCE``, the level the trial's looks were made
    at."""
    logs = np.log(np.asarray(baseline_seconds, dtype=float) / np.asarray(seconds, dtype=float))
    if logs.size < MIN_ROUNDS or not np.all(np.isfinite(logs)):
        raise ValueError(f"{logs.size} rounds with finite times: {MIN_ROUNDS} are needed")
    mean, se, carry_over = (float(value) for value in fit(logs))
    if se <= NO_SPREAD * max(1.0, abs(mean)):
        # Only a coarse clock gives every round the same ratio: that is no measured spread.
        raise ValueError("every round gave the same ratio: the clock measured no spread")
    reported = critical_value(logs.size) * se
    trend = stats.spearmanr(np.arange(logs.size), logs)
    return Speedup(
        math.exp(mean),
        int(logs.size),
        (math.exp(mean - reported), math.exp(mean + reported)),
        TRIAL_CONFIDENCE,
        total_time_ratio,
        float(trend.statistic),
        float(trend.pvalue),
        math.exp(carry_over),
    )
