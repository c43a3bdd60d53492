"""The statistics behind a verdict, from scipy.stats: t intervals, two one-sided tests for
equivalence, Holm's step-down procedure and a planning estimate of the seeds that would settle
an open question (the speed trial's interval is amp_exp/capability/ratio.py's).

Plain numbers in, plain numbers out: nothing here knows runs, tasks or files. Below the rule:
the skewness check that withholds a ``matches`` the t interval cannot vouch for, the
training-loss curves compared step by step, and the simulated constants both rules read.

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
the tolerance's edge, docs/sweeps.md; ``t_reliable`` below withholds a visibly skewed ``matches``).
Which verdict a comparison gets is decided in report/decision.py alone, from this rule.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cache
from importlib import resources
from typing import Any

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


def observed_sd(data: np.ndarray) -> np.ndarray:
    """The sample standard deviation along the last axis (many sweeps at once in simulation), 0
    where it is rounding of equal values."""
    sd = data.std(axis=-1, ddof=1)
    return np.where(sd <= NO_SPREAD * np.maximum(1.0, np.abs(data).max(axis=-1)), 0.0, sd)


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
    sd = float(observed_sd(data))
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
    width = half_width(np.maximum(observed_sd(deltas), floor), n, confidence)
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


# The simulated constants the verdict rules read: the evidence sweeper's per-look levels
# (report/sequential.py) and the skewness check's thresholds, with the error rates and power their
# simulation found. scripts/calibrate_rules.py writes calibration.json, shipped in the package;
# tests/test_calibration.py re-simulates its stated rates.

NAME = "calibration.json"


@cache
def calibration() -> dict[str, Any]:
    return json.loads(resources.files("amp_exp.report").joinpath(NAME).read_text("utf-8"))


# Whether the paired differences look normal enough for the t interval's ``matches`` to hold its
# stated rate: a check of their sample skewness, calibrated by simulation. The t rule's false
# ``matches`` is 2.5% for normal differences but 15-18% for strongly skewed ones
# (docs/sweeps.md). At 2-5 seeds no permutation test can reach 2.5%, so where the differences are
# visibly skewed (|G1|, the adjusted Fisher-Pearson skewness of scipy.stats.skew, beyond the 95th
# percentile it reaches for normal differences at their n, simulated: scripts/calibrate_rules.py)
# a ``matches`` is withheld as ``inconclusive`` (report/decision.py) rather than given at an
# unknown rate. By construction it withholds 5% of normal ``matches``; skew the seeds do not show
# (no outlier drawn yet) it cannot see: the rates it leaves are in docs/sweeps.md. Two
# differences have no skewness: below 3 the check passes them.

# The fewest differences whose skewness is defined.
MIN_N = 3
# The share of normal differences the check flags, at every n (what the thresholds are for).
WITHHOLD_RATE = 0.05


def skewness(deltas: np.ndarray) -> np.ndarray:
    """|G1| along the last axis (many sweeps at once in simulation); 0 for no spread."""
    deltas = np.asarray(deltas, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        found = np.abs(stats.skew(deltas, axis=-1, bias=False))
    return np.nan_to_num(found, nan=0.0)


def threshold(n: int) -> float | None:
    """The simulated 95th percentile of |G1| for ``n`` normal differences (the largest n
    simulated stands for more); None below ``MIN_N``."""
    if n < MIN_N:
        return None
    found = calibration()["shape"]["thresholds"]
    return float(found.get(str(n), found[max(found, key=int)]))


def t_reliable(deltas: Sequence[float]) -> bool:
    """Whether the differences show no more skew than normal ones would 95% of the time."""
    limit = threshold(len(deltas))
    return limit is None or float(skewness(np.asarray(deltas))) <= limit


# Training-loss curves against fp32's: the gap at matched steps, and the band of fp32's seeds.
# A curve is a run's training loss at each logged step (the mean over its log interval). Jobs of
# one setting train on the same global batch, so step N of two jobs has seen the same samples or
# tokens: curves are compared step by step, at the steps both logged.
# - The loss gap averages, over the last 10% of training, the relative gap (l - l_fp32) / l_fp32,
#   as DeepSeek-V3 reports it (below 0.25%), and the absolute gap l - l_fp32, as Megatron states
#   its fp8 bar (below 0.01).
# - The fp32 band is the lowest to the highest fp32 seed at each step, drawn in loss_curves.png as
#   a picture of seed-to-seed spread. It is no test: pointwise bands from 2 or 3 seeds, and a step
#   picked after seeing the curves, have no error control; the paired gap is the evidence.

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
    return sorted(set.intersection(*map(set, curves))) if curves else []


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
