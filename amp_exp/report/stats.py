"""The statistics behind a verdict, from scipy.stats: t intervals, the paired t-test, two one-sided
tests for equivalence (the speed trial's interval is amp_exp/speed/ratio.py's).

Plain numbers in, plain numbers out: nothing here knows runs, tasks or files.

The verdict rules (docs/sweeps.md), for the paired differences d_s = metric(precision, seed s) -
metric(fp32, seed s) in the unit of the tolerance t (accuracy points, relative loss):

- ``matches``: the 95% confidence interval of the mean difference lies inside [-t, +t]. This is
  two one-sided tests (TOST) at the 2.5% level each: ``p_equivalence`` < 0.025.
- ``better`` / ``worse``: the interval lies wholly beyond +t or -t; which one is better depends on
  whether the metric is higher-is-better.
- ``inconclusive``: anything else. ``seeds_to_settle`` says roughly how many seeds would give an
  interval narrow enough to decide, at the spread observed.
- ``single_seed``: one pair measures no noise: the difference is shown, nothing is claimed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
# Accuracies are ratios of counts: a difference of exactly the tolerance is within it.
SLACK = 1e-9
# Relative to the values, a standard deviation this small is rounding, not spread.
NO_SPREAD = 1e-12
# seeds_to_settle looks no further: beyond it the answer is "more than is practical".
MAX_SEEDS = 1000


class Verdict(str, Enum):
    matches = "matches"
    better = "better"
    worse = "worse"
    inconclusive = "inconclusive"
    single_seed = "single_seed"


@dataclass(frozen=True)
class Estimate:
    """The mean of ``n`` values and its 95% t interval (None for one value)."""

    n: int
    mean: float
    ci95: tuple[float, float] | None
    sd: float | None

    @property
    def spread(self) -> bool:
        return self.sd is not None and self.sd > 0


def mean_interval(values: Sequence[float]) -> Estimate:
    """The mean and its 95% confidence interval from Student's t with n - 1 degrees of freedom."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("no values to estimate from")
    mean = float(data.mean())
    if data.size == 1:
        return Estimate(1, mean, None, None)
    sd = float(data.std(ddof=1))
    if sd <= NO_SPREAD * max(1.0, float(np.abs(data).max())):
        # Equal values, up to rounding: a spread of 1e-17 is no noise estimate.
        return Estimate(data.size, mean, (mean, mean), 0.0)
    low, high = stats.t.interval(CONFIDENCE, data.size - 1, loc=mean, scale=stats.sem(data))
    return Estimate(data.size, mean, (float(low), float(high)), sd)


@dataclass(frozen=True)
class PairedDifference:
    """Paired differences against fp32: their mean, its 95% CI, and the tests on them."""

    estimate: Estimate
    # The paired t-test of "no difference" (scipy's ttest_rel(a, b) is this test of a - b).
    p_value: float | None
    # TOST against [-tolerance, +tolerance]: small when the difference is within it.
    p_equivalence: float | None


def paired_difference(deltas: Sequence[float], tolerance: float) -> PairedDifference:
    estimate = mean_interval(deltas)
    if estimate.n == 1:
        return PairedDifference(estimate, None, None)
    if not estimate.spread:
        # Every seed differed by the same amount: the tests' statistics are infinite or undefined.
        equivalent = abs(estimate.mean) < tolerance
        return PairedDifference(estimate, None, 0.0 if equivalent else 1.0)
    data = np.asarray(deltas, dtype=float)
    p_value = float(stats.ttest_1samp(data, 0.0).pvalue)
    above_lower = stats.ttest_1samp(data, -tolerance, alternative="greater").pvalue
    below_upper = stats.ttest_1samp(data, tolerance, alternative="less").pvalue
    return PairedDifference(estimate, p_value, float(max(above_lower, below_upper)))


def verdict(difference: PairedDifference, tolerance: float, higher_is_better: bool) -> Verdict:
    """The verdict rule of the module docstring."""
    ci = difference.estimate.ci95
    if ci is None:
        return Verdict.single_seed
    low, high = ci
    if low >= -tolerance - SLACK and high <= tolerance + SLACK:
        return Verdict.matches
    if low > tolerance + SLACK:
        return Verdict.better if higher_is_better else Verdict.worse
    if high < -tolerance - SLACK:
        return Verdict.worse if higher_is_better else Verdict.better
    return Verdict.inconclusive


def seeds_to_settle(estimate: Estimate, tolerance: float) -> int | None:
    """Roughly how many seeds would give an interval that decides, were the mean and the spread
    to stay as observed: the interval's half-width t(0.975, n - 1) * sd / sqrt(n) must fall below
    the distance between |mean| and the tolerance. None when no number of seeds up to
    ``MAX_SEEDS`` would (the mean lies at the tolerance) or no spread was measured."""
    if not estimate.spread or estimate.sd is None:
        return None
    margin = abs(abs(estimate.mean) - tolerance)
    if margin == 0:
        return None
    for n in range(estimate.n + 1, MAX_SEEDS + 1):
        half_width = stats.t.ppf((1 + CONFIDENCE) / 2, n - 1) * estimate.sd / math.sqrt(n)
        if half_width < margin:
            return n
    return None
