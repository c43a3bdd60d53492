"""The statistics behind a verdict, from scipy.stats: t intervals, two one-sided tests for
equivalence, Holm's step-down procedure and a planning estimate of the seeds that would settle
an open question (the speed trial's interval is amp_exp/speed/ratio.py's).

Plain numbers in, plain numbers out: nothing here knows runs, tasks or files.

The verdict rule (docs/sweeps.md), for the paired differences d_s = metric(precision, seed s) -
metric(fp32, seed s) in the unit of the tolerance t (accuracy points, relative loss). The
interval is mean +- t(0.975, n - 1) * max(s, floor) / sqrt(n): for accuracy on N eval examples
the floor is one example, 100 / N points, at every n (a floor used only when s = 0 would make
identical deltas decide less often than nearly identical ones); a relative loss has none.

- ``matches``: the 95% interval lies inside [-t, +t]. This is two one-sided tests (TOST) at 2.5%
  per side, ``p_equivalence`` < 0.025: stricter than bioequivalence's 90% interval.
- ``better`` / ``worse``: the interval lies wholly beyond +t or -t (one-sided, 2.5%).
- ``not_worse``: the worse-side bound lies within the tolerance and the other side decides
  nothing: a non-inferiority claim, the one-sided "is it safe?".
- ``inconclusive``: anything else, and always when the interval has no width (no spread and no
  floor: bit-identical runs are no noise estimate).
- ``single_seed``: one pair measures no noise: the difference is shown, nothing is claimed.

The t interval is exact for normal deltas; skewed ones let more false claims through (7-18% at
the tolerance's edge, docs/sweeps.md; report/shape.py withholds a visibly skewed ``matches``).
Which verdict a comparison gets is decided in report/decision.py alone, from this rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
# Each one-sided claim (each side of TOST, worse, better, not_worse) is tested at this level.
ONE_SIDED = (1 - CONFIDENCE) / 2
# Accuracies are ratios of counts: a difference of exactly the tolerance is within it.
SLACK = 1e-9
# Relative to the values, a standard deviation this small is rounding, not spread.
NO_SPREAD = 1e-12
# seeds_to_settle looks no further: beyond it the answer is "more than this".
MAX_SEEDS = 50
# seeds_to_settle's target: the chance that the rule decides at the n it names.
PLANNING_POWER = 0.8
# Simulated sweeps per n in seeds_to_settle; a fixed seed makes the estimate reproducible.
PLANNING_REPETITIONS = 4000
PLANNING_SEED = 0
# A failure rate bounded by a share of seeds that all survived: the one-sided 95% bound.
FAILURE_CONFIDENCE = 0.95


class Verdict(str, Enum):
    matches = "matches"
    not_worse = "not_worse"
    better = "better"
    worse = "worse"
    inconclusive = "inconclusive"
    single_seed = "single_seed"
    # Verdicts on the seeds rather than on their numbers (report/evidence.py), in precedence.
    not_engaged = "not_engaged"
    baseline_unstable = "baseline_unstable"
    unstable = "unstable"
    incomplete = "incomplete"


# The statistical verdicts as codes of the vectorized rule, in code order.
RULE_VERDICTS = (
    Verdict.inconclusive,
    Verdict.matches,
    Verdict.not_worse,
    Verdict.better,
    Verdict.worse,
)
CODE = {verdict: code for code, verdict in enumerate(RULE_VERDICTS)}


@dataclass(frozen=True)
class Estimate:
    """The mean of ``n`` values and its 95% t interval (None for one value); ``sd`` is the
    observed spread, ``scale`` the one the interval used (the spread, or the floor above it)."""

    n: int
    mean: float
    ci95: tuple[float, float] | None
    sd: float | None
    scale: float | None = None

    @property
    def spread(self) -> bool:
        return self.sd is not None and self.sd > 0


def observed_sd(data: np.ndarray) -> float:
    """The sample standard deviation, 0 where it is rounding of equal values."""
    sd = float(data.std(ddof=1))
    return 0.0 if sd <= NO_SPREAD * max(1.0, float(np.abs(data).max())) else sd


def half_width(
    scale: np.ndarray | float, n: int, confidence: float = CONFIDENCE
) -> np.ndarray | float:
    """The t interval's half-width at ``n`` values of spread ``scale``, at ``confidence`` (95%;
    the evidence sweeper's looks each use a stricter one, amp_exp/report/sequential.py)."""
    return stats.t.ppf(1 - (1 - confidence) / 2, n - 1) * np.asarray(scale) / math.sqrt(n)


def mean_interval(
    values: Sequence[float], floor: float = 0.0, confidence: float = CONFIDENCE
) -> Estimate:
    """The mean and its confidence interval (95% unless ``confidence`` says otherwise) from
    Student's t with n - 1 degrees of freedom, the spread taken as at least ``floor``."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("no values to estimate from")
    mean = float(data.mean())
    if data.size == 1:
        return Estimate(1, mean, None, None)
    sd = observed_sd(data)
    scale = max(sd, floor)
    width = float(half_width(scale, data.size, confidence))
    return Estimate(data.size, mean, (mean - width, mean + width), sd, scale)


def geometric_interval(values: Sequence[float]) -> Estimate:
    """The geometric mean of positive values and its 95% interval: the t interval of their logs,
    taken back (a loss or a perplexity: its interval never reaches below zero)."""
    found = mean_interval(np.log(np.asarray(values, dtype=float)))
    ci95 = None if found.ci95 is None else (math.exp(found.ci95[0]), math.exp(found.ci95[1]))
    return Estimate(found.n, math.exp(found.mean), ci95, found.sd, found.scale)


def decide(
    low: np.ndarray,
    high: np.ndarray,
    tolerance: float,
    higher_is_better: bool,
) -> np.ndarray:
    """The verdict codes (``RULE_VERDICTS``) of intervals [low, high]: the rule of the module
    docstring, on arrays, so that simulations judge with the very rule the report uses."""
    low, high = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
    above_low = low >= -tolerance - SLACK
    below_high = high <= tolerance + SLACK
    wholly_above = low > tolerance + SLACK
    wholly_below = high < -tolerance - SLACK
    better, worse = (
        (wholly_above, wholly_below) if higher_is_better else (wholly_below, wholly_above)
    )
    safe_side = above_low if higher_is_better else below_high
    codes = np.full(np.broadcast(low, high).shape, CODE[Verdict.inconclusive])
    codes[safe_side] = CODE[Verdict.not_worse]
    codes[above_low & below_high] = CODE[Verdict.matches]
    codes[better] = CODE[Verdict.better]
    codes[worse] = CODE[Verdict.worse]
    # An interval of no width is no evidence: bit-identical runs measure no noise.
    codes[high - low <= 0] = CODE[Verdict.inconclusive]
    return codes


def simulate(
    deltas: np.ndarray,
    tolerance: float,
    higher_is_better: bool,
    floor: float = 0.0,
    confidence: float = CONFIDENCE,
) -> np.ndarray:
    """The verdict codes of many sweeps at once: ``deltas`` is (sweeps, seeds)."""
    n = deltas.shape[1]
    mean = deltas.mean(axis=1)
    sd = deltas.std(axis=1, ddof=1)
    sd = np.where(sd <= NO_SPREAD * np.maximum(1.0, np.abs(deltas).max(axis=1)), 0.0, sd)
    width = half_width(np.maximum(sd, floor), n, confidence)
    return decide(mean - width, mean + width, tolerance, higher_is_better)


@dataclass(frozen=True)
class PairedDifference:
    """Paired differences against fp32: their mean, its 95% CI, and the one-sided tests on them
    (None for one pair, or an interval of no width)."""

    estimate: Estimate
    # TOST against [-tolerance, +tolerance]: small when the difference is within it.
    p_equivalence: float | None
    # One-sided: small when the difference lies beyond the tolerance on the worse side, on the
    # better side, and (non-inferiority) when it lies within the tolerance on the worse side.
    p_worse: float | None
    p_better: float | None
    p_not_worse: float | None

    @property
    def identical(self) -> bool:
        """Every seed differed by the same amount and no floor widened the interval."""
        ci = self.estimate.ci95
        return ci is not None and ci[1] - ci[0] <= 0


def paired_difference(
    deltas: Sequence[float],
    tolerance: float,
    higher_is_better: bool,
    floor: float = 0.0,
    confidence: float = CONFIDENCE,
) -> PairedDifference:
    """The interval at ``confidence``; the p-values do not depend on it (a claim holds at a
    stricter level when its p-value is below that level's one side)."""
    estimate = mean_interval(deltas, floor, confidence)
    if estimate.n == 1 or not estimate.scale:
        return PairedDifference(estimate, None, None, None, None)
    t = stats.t(estimate.n - 1)
    se = estimate.scale / math.sqrt(estimate.n)
    # H1: d > -tolerance, and H1: d < +tolerance; TOST rejects when both do.
    above_lower = float(t.sf((estimate.mean + tolerance) / se))
    below_upper = float(t.cdf((estimate.mean - tolerance) / se))
    beyond_upper = float(t.sf((estimate.mean - tolerance) / se))
    beyond_lower = float(t.cdf((estimate.mean + tolerance) / se))
    worse, better = (
        (beyond_lower, beyond_upper) if higher_is_better else (beyond_upper, beyond_lower)
    )
    not_worse = above_lower if higher_is_better else below_upper
    return PairedDifference(estimate, max(above_lower, below_upper), worse, better, not_worse)


def holm(p_values: Sequence[float], alpha: float = ONE_SIDED) -> list[bool]:
    """Holm's step-down procedure: which of the family's hypotheses are rejected, keeping the
    chance of any false rejection at most ``alpha``."""
    order = np.argsort(p_values, kind="stable")
    rejected = [False] * len(p_values)
    for rank, index in enumerate(order):
        if p_values[index] > alpha / (len(p_values) - rank):
            break
        rejected[index] = True
    return rejected


def failure_rate_bound(n: int) -> float:
    """The one-sided 95% upper bound on a failure rate when ``n`` seeds all survived:
    1 - 0.05^(1/n), Clopper-Pearson's bound at zero failures (63% at n = 3)."""
    return 1 - (1 - FAILURE_CONFIDENCE) ** (1 / n)


def min_seeds_to_match(
    floor: float, tolerance: float, confidence: float = CONFIDENCE
) -> int | None:
    """The fewest seeds at which ``matches`` is possible at all with the spread floored at
    ``floor`` (a mean of exactly 0, a spread at the floor); None above ``MAX_SEEDS``."""
    for n in range(2, MAX_SEEDS + 1):
        if float(half_width(floor, n, confidence)) <= tolerance + SLACK:
            return n
    return None


def planning_spread(sd: float, n: int) -> float:
    """The spread's 80% upper confidence bound from ``n`` values, s * sqrt((n - 1) /
    chi2(0.20, n - 1)): 3.95 s at n = 2, 2.12 s at n = 3. Planning with s itself gives about
    even odds at the n it names."""
    return sd * math.sqrt((n - 1) / stats.chi2.ppf(1 - PLANNING_POWER, n - 1))


def seeds_to_settle(
    estimate: Estimate,
    tolerance: float,
    higher_is_better: bool,
    floor: float = 0.0,
    quantum: float = 0.0,
    confidence: float = CONFIDENCE,
) -> int | None:
    """A planning estimate: the fewest seeds, up to ``MAX_SEEDS``, at which the rule (floor
    included) decides with at least 80% probability in simulation. Assumed: a true difference of
    0 when the observed mean lies within the tolerance (the chance of ``matches``), else the
    observed mean (the chance of ``worse`` or ``better``); the spread at its 80% upper bound;
    deltas rounded to ``quantum`` (one eval example) where they are counts. None when no n up to
    ``MAX_SEEDS`` does, or the estimate has no spread to plan with."""
    if estimate.sd is None or estimate.n < 2:
        return None
    sd = max(planning_spread(estimate.sd, estimate.n), floor)
    if sd <= 0:
        return None
    within = abs(estimate.mean) <= tolerance
    true_mean = 0.0 if within else estimate.mean
    targets = [CODE[Verdict.matches]] if within else [CODE[Verdict.better], CODE[Verdict.worse]]
    rng = np.random.default_rng(PLANNING_SEED)

    def settles(n: int) -> bool:
        deltas = rng.normal(true_mean, sd, size=(PLANNING_REPETITIONS, n))
        if quantum > 0:
            deltas = quantum * np.round(deltas / quantum)
        codes = simulate(deltas, tolerance, higher_is_better, floor, confidence)
        return bool(np.isin(codes, targets).mean() >= PLANNING_POWER)

    # The chance grows with n: when the most seeds looked at do not settle it, none fewer do.
    if not settles(MAX_SEEDS):
        return None
    candidates = range(max(2, estimate.n + 1), MAX_SEEDS)
    return next((n for n in candidates if settles(n)), MAX_SEEDS)
