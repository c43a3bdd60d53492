"""The statistics behind verdicts, on planted per-seed values, checked against scipy's own
results; and the loss curves' gap and band on planted curves."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from amp_exp.report import curves, stats
from amp_exp.report.stats import Verdict

# Accuracy of three seeds, fp32 and bf16, as fractions; their paired differences in points.
FP32 = np.array([0.8125, 0.7969, 0.8047])
BF16 = np.array([0.8105, 0.7969, 0.8008])
DELTAS = 100 * (BF16 - FP32)


def test_the_mean_interval_is_students_t_interval() -> None:
    values = [1.0, 1.5, 0.7, 1.2]
    estimate = stats.mean_interval(values)
    low, high = scipy_stats.t.interval(0.95, 3, loc=np.mean(values), scale=scipy_stats.sem(values))
    assert estimate.n == 4 and estimate.mean == pytest.approx(np.mean(values))
    assert estimate.ci95 == pytest.approx((low, high))
    assert stats.mean_interval([2.0]).ci95 is None


def test_the_paired_difference_is_scipys_paired_t_test() -> None:
    difference = stats.paired_difference(DELTAS, tolerance=0.5)
    reference = scipy_stats.ttest_rel(100 * BF16, 100 * FP32)
    assert difference.estimate.mean == pytest.approx(np.mean(DELTAS))
    assert difference.p_value == pytest.approx(reference.pvalue)
    assert difference.estimate.ci95 == pytest.approx(tuple(reference.confidence_interval(0.95)))


def test_the_equivalence_p_value_is_two_one_sided_tests() -> None:
    difference = stats.paired_difference(DELTAS, tolerance=0.5)
    lower = scipy_stats.ttest_rel(100 * BF16 + 0.5, 100 * FP32, alternative="greater").pvalue
    upper = scipy_stats.ttest_rel(100 * BF16 - 0.5, 100 * FP32, alternative="less").pvalue
    assert difference.p_equivalence == pytest.approx(max(lower, upper))


@pytest.mark.parametrize(
    ("deltas", "higher_is_better", "verdict"),
    [
        ([-0.1, 0.05, -0.2, 0.0], True, Verdict.matches),
        ([-3.0, -2.6, -3.4], True, Verdict.worse),
        ([3.0, 2.6, 3.4], True, Verdict.better),
        # For a loss, a difference above the tolerance is worse.
        ([3.0, 2.6, 3.4], False, Verdict.worse),
        ([-3.0, -2.6, -3.4], False, Verdict.better),
        ([-0.1, -1.5, 0.4], True, Verdict.inconclusive),
        ([-0.3], True, Verdict.single_seed),
        # Every seed differed by the same amount: the interval is that one value.
        ([0.0, 0.0, 0.0], True, Verdict.matches),
    ],
)
def test_verdict_rules(deltas: list[float], higher_is_better: bool, verdict: Verdict) -> None:
    difference = stats.paired_difference(deltas, tolerance=0.5)
    assert stats.verdict(difference, 0.5, higher_is_better) is verdict


def test_matches_exactly_when_tost_rejects_at_two_and_a_half_percent() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        deltas = rng.normal(rng.uniform(-0.6, 0.6), rng.uniform(0.05, 0.5), size=4)
        difference = stats.paired_difference(deltas, tolerance=0.5)
        matches = stats.verdict(difference, 0.5, True) is Verdict.matches
        assert matches == (difference.p_equivalence < 0.025)


def test_seeds_to_settle_is_the_first_n_whose_interval_would_decide() -> None:
    estimate = stats.mean_interval([-0.1, -0.9, 0.3])
    margin = 0.5 - abs(estimate.mean)
    n = stats.seeds_to_settle(estimate, 0.5)
    assert n is not None and n > 3

    def half_width(k: int) -> float:
        return scipy_stats.t.ppf(0.975, k - 1) * estimate.sd / math.sqrt(k)

    assert half_width(n) < margin <= half_width(n - 1)
    at_the_tolerance = stats.mean_interval([0.4, 0.6])
    assert stats.seeds_to_settle(at_the_tolerance, 0.5) is None


def test_the_loss_gap_averages_the_last_tenth_of_steps_relative_and_absolute() -> None:
    baseline = {step: 2.0 for step in range(10, 101, 10)}
    curve = {**baseline, 90: 2.02, 100: 2.04}
    relative, absolute = curves.loss_gap(curve, baseline)
    assert relative == pytest.approx((0.01 + 0.02) / 2)
    assert absolute == pytest.approx(0.03)
    assert curves.loss_gap({**curve, 100: float("nan")}, baseline) is None


def test_a_curve_leaves_the_fp32_band_for_good_only_over_a_stretch_to_the_end() -> None:
    seeds = [{s: 2.0 - 0.01 * s + d for s in range(1, 11)} for d in (-0.01, 0.0, 0.01)]
    band = curves.band(seeds)
    assert band[5] == pytest.approx((1.94, 1.96))
    inside = curves.mean_curve(seeds)
    assert curves.left_band_at(inside, band) is None
    rising = {s: inside[s] + (0.05 if s >= 7 else 0.0) for s in inside}
    assert curves.left_band_at(rising, band) == (7, "above")
    # Outside at the last point alone is what chance does with three seeds.
    last_only = {**inside, 10: inside[10] - 0.05}
    assert curves.left_band_at(last_only, band) is None
    # Out and back in again is not for good.
    back = {s: inside[s] + (0.05 if 3 <= s <= 6 else 0.0) for s in inside}
    assert curves.left_band_at(back, band) is None
