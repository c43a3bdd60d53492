"""The statistics behind verdicts, on planted per-seed values, checked against scipy's own
results; the verdict rule's error rates and power in simulation; and the loss gap on planted
curves."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from amp_exp.report import stats
from amp_exp.report.stats import Verdict
from helpers.rule import rule_verdict

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


def test_the_spread_is_floored_at_every_n_not_only_when_it_is_zero() -> None:
    # A floor above the observed spread widens the interval; below it, the spread decides.
    spread = stats.mean_interval([0.0, 0.1, 0.2], floor=0.3)
    assert spread.ci95 == pytest.approx(
        (
            0.1 - scipy_stats.t.ppf(0.975, 2) * 0.3 / math.sqrt(3),
            0.1 + scipy_stats.t.ppf(0.975, 2) * 0.3 / math.sqrt(3),
        )
    )
    assert stats.mean_interval([0.0, 0.1, 0.2], floor=0.01).ci95 == pytest.approx(
        stats.mean_interval([0.0, 0.1, 0.2]).ci95
    )
    # Identical deltas [0, 0, 0] decide no more often than nearly identical [0, 0, 0.1].
    same = stats.mean_interval([0.0, 0.0, 0.0], floor=0.1)
    near = stats.mean_interval([0.0, 0.0, 0.1], floor=0.1)
    assert same.ci95[1] - same.ci95[0] == pytest.approx(near.ci95[1] - near.ci95[0])


def test_the_one_sided_p_values_are_scipys_one_sample_t_tests() -> None:
    difference = stats.paired_difference(DELTAS, 0.5, higher_is_better=True)

    def p(shift: float, alternative: str) -> float:
        return scipy_stats.ttest_1samp(DELTAS, shift, alternative=alternative).pvalue

    assert difference.estimate.mean == pytest.approx(np.mean(DELTAS))
    reference = scipy_stats.ttest_rel(100 * BF16, 100 * FP32).confidence_interval(0.95)
    assert difference.estimate.ci95 == pytest.approx(tuple(reference))
    assert difference.p_equivalence == pytest.approx(max(p(-0.5, "greater"), p(0.5, "less")))
    assert difference.p_worse == pytest.approx(p(-0.5, "less"))
    assert difference.p_better == pytest.approx(p(0.5, "greater"))
    assert difference.p_not_worse == pytest.approx(p(-0.5, "greater"))
    # For a loss the worse side is above.
    loss = stats.paired_difference(DELTAS, 0.5, higher_is_better=False)
    assert (loss.p_worse, loss.p_not_worse) == pytest.approx((p(0.5, "greater"), p(0.5, "less")))


@pytest.mark.parametrize(
    ("deltas", "higher_is_better", "floor", "verdict"),
    [
        ([-0.1, 0.05, -0.2, 0.0], True, 0.0, Verdict.matches),
        ([-3.0, -2.6, -3.4], True, 0.0, Verdict.worse),
        ([3.0, 2.6, 3.4], True, 0.0, Verdict.better),
        # For a loss, a difference above the tolerance is worse.
        ([3.0, 2.6, 3.4], False, 0.0, Verdict.worse),
        ([-3.0, -2.6, -3.4], False, 0.0, Verdict.better),
        ([-0.1, -1.5, 0.4], True, 0.0, Verdict.inconclusive),
        # The worse side within the tolerance, the better side open: non-inferior.
        ([0.3, 0.9, 0.5], True, 0.0, Verdict.not_worse),
        ([-0.3, -0.9, -0.5], False, 0.0, Verdict.not_worse),
        ([-0.3], True, 0.0, Verdict.single_seed),
        # Identical deltas without a floor are an interval of no width: no verdict from it.
        ([0.0, 0.0, 0.0], True, 0.0, Verdict.inconclusive),
        ([0.05, 0.05], False, 0.0, Verdict.inconclusive),
        # With one eval example's floor (0.1 points) they are evidence, as wide as it says.
        ([0.0, 0.0, 0.0], True, 0.1, Verdict.matches),
        ([-0.6, -0.6], True, 0.1, Verdict.inconclusive),
        ([0.0, 0.0], True, 100 / 1024, Verdict.inconclusive),
    ],
)
def test_verdict_rules(
    deltas: list[float], higher_is_better: bool, floor: float, verdict: Verdict
) -> None:
    difference = stats.paired_difference(deltas, 0.5, higher_is_better, floor)
    assert rule_verdict(difference, 0.5, higher_is_better) is verdict


def test_matches_exactly_when_tost_rejects_at_two_and_a_half_percent() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        deltas = rng.normal(rng.uniform(-0.6, 0.6), rng.uniform(0.05, 0.5), size=4)
        difference = stats.paired_difference(deltas, 0.5, True)
        matches = rule_verdict(difference, 0.5, True) is Verdict.matches
        assert matches == (difference.p_equivalence < 0.025)


def test_the_simulated_rule_is_the_reports_rule() -> None:
    rng = np.random.default_rng(1)
    deltas = rng.normal(
        rng.uniform(-1, 1, size=(120, 1)), rng.uniform(0.05, 0.6, (120, 1)), (120, 3)
    )
    deltas[:20] = 0.1 * np.round(deltas[:20] / 0.1)  # some quantized, some identical
    deltas[:5] = 0.2
    for higher in (True, False):
        codes = stats.simulate(deltas, 0.5, higher, floor=0.1)
        one_by_one = [
            rule_verdict(stats.paired_difference(row, 0.5, higher, 0.1), 0.5, higher)
            for row in deltas
        ]
        assert [stats.RULE_VERDICTS[code] for code in codes] == one_by_one


# The rule's error rates, simulated: 10,000 sweeps per case with a fixed seed, so that a true
# rate of 4% cannot pass a bound of 3% by chance (at 2,000 it would one time in four).
REPETITIONS = 10_000
TOLERANCE = 0.5
SEEDS = (2, 3, 4, 5)
# Spreads as a share of the tolerance, down to 0.05, the worst case for a floor-less rule.
SPREADS = (0.05, 0.2, 0.5, 1.0, 2.0)


def rate(codes: np.ndarray, *verdicts: Verdict) -> float:
    return float(np.isin(codes, [stats.CODE[v] for v in verdicts]).mean())


def normal_sweeps(rng: np.random.Generator, mean: float, spread: float, n: int) -> np.ndarray:
    return rng.normal(mean, spread * TOLERANCE, size=(REPETITIONS, n))


def test_matches_at_a_true_difference_of_the_tolerance_is_rare() -> None:
    rng = np.random.default_rng(2026)
    worst = 0.0
    for n in SEEDS:
        for sign in (1, -1):
            for spread in SPREADS:
                deltas = normal_sweeps(rng, sign * TOLERANCE, spread, n)
                worst = max(worst, rate(stats.simulate(deltas, TOLERANCE, True), Verdict.matches))
    assert worst <= 0.03


@pytest.mark.parametrize("examples", [1000, 5000])
def test_matches_on_quantized_accuracy_at_the_tolerance_is_rare_with_the_floor(
    examples: int,
) -> None:
    """Accuracy deltas are counts over N eval examples: h = 100 / N points. Without the floor
    identical deltas give intervals of no width; with it, false matches stay rare."""
    h = 100 / examples
    rng = np.random.default_rng(7)
    worst = 0.0
    for n in SEEDS:
        for sign in (1, -1):
            for spread in (0.05, 0.1, 0.3, 0.5, 1.0):
                deltas = h * np.round(normal_sweeps(rng, sign * TOLERANCE, spread, n) / h)
                codes = stats.simulate(deltas, TOLERANCE, True, floor=h)
                worst = max(worst, rate(codes, Verdict.matches))
    assert worst <= 0.03


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_worse_better_and_a_safety_claim_at_the_tolerance_are_rare(higher_is_better: bool) -> None:
    rng = np.random.default_rng(11)
    worse_side = -TOLERANCE if higher_is_better else TOLERANCE
    worst = {"worse": 0.0, "better": 0.0, "safe": 0.0}
    for n in SEEDS:
        for spread in SPREADS:
            at_worse = stats.simulate(
                normal_sweeps(rng, worse_side, spread, n), TOLERANCE, higher_is_better
            )
            at_better = stats.simulate(
                normal_sweeps(rng, -worse_side, spread, n), TOLERANCE, higher_is_better
            )
            # At the worse edge, `worse` is false, and so is any claim that it is safe.
            worst["worse"] = max(worst["worse"], rate(at_worse, Verdict.worse))
            worst["safe"] = max(worst["safe"], rate(at_worse, Verdict.matches, Verdict.not_worse))
            worst["better"] = max(worst["better"], rate(at_better, Verdict.better))
    assert max(worst.values()) <= 0.03, worst


def test_a_rule_that_never_decides_fails_the_power_check() -> None:
    rng = np.random.default_rng(3)
    power = {
        n: rate(stats.simulate(normal_sweeps(rng, 0.0, 0.05, n), TOLERANCE, True), Verdict.matches)
        for n in SEEDS
    }
    # At 2 seeds the spread has 1 degree of freedom and t(0.975, 1) = 12.7: about 2.6% of pairs
    # differ by enough to leave the interval wider than the tolerance, whatever the rule's floor.
    assert power[2] >= 0.96
    assert min(power[n] for n in SEEDS[1:]) >= 0.99


def test_holm_steps_down_and_stops_at_the_first_hypothesis_it_keeps() -> None:
    # Holm rejects all three where Bonferroni (0.05 / 3 each) would reject the first alone.
    assert stats.holm([0.04, 0.01, 0.02], alpha=0.05) == [True, True, True]
    # It stops at 0.03 > 0.05 / 2, and so keeps 0.04 too (a step-up rule would reject it).
    assert stats.holm([0.01, 0.03, 0.04], alpha=0.05) == [True, False, False]
    assert stats.holm([], alpha=0.05) == []


def test_the_failure_rate_bound_is_clopper_pearsons_at_zero_failures() -> None:
    for n in (1, 3, 10):
        upper = scipy_stats.binomtest(0, n).proportion_ci(confidence_level=0.90).high
        assert stats.failure_rate_bound(n) == pytest.approx(upper)
    assert stats.failure_rate_bound(3) == pytest.approx(0.63, abs=0.005)


def test_one_eval_example_can_make_matches_impossible_at_two_seeds() -> None:
    # 1,024 eval examples, a tolerance of 0.5 points: 2 seeds never match, 3 can.
    assert stats.min_seeds_to_match(100 / 1024, 0.5) == 3
    assert stats.min_seeds_to_match(100 / 10_000, 0.5) == 2
    assert stats.min_seeds_to_match(5.0, 0.5) is None  # beyond MAX_SEEDS


def test_the_planning_spread_is_the_80_percent_upper_bound() -> None:
    assert stats.planning_spread(1.0, 2) == pytest.approx(3.95, abs=0.01)
    assert stats.planning_spread(1.0, 3) == pytest.approx(2.12, abs=0.01)


def test_seeds_to_settle_names_an_n_at_which_the_rule_decides_four_times_in_five() -> None:
    estimate = stats.mean_interval([0.1, -0.2, 0.15])
    n = stats.seeds_to_settle(estimate, 0.5, True)
    assert n is not None and n > 3
    spread = stats.planning_spread(estimate.sd, 3)
    rng = np.random.default_rng(99)  # not the estimate's own seed

    def chance(k: int) -> float:
        return rate(
            stats.simulate(rng.normal(0.0, spread, (20_000, k)), 0.5, True), Verdict.matches
        )

    assert chance(n) >= 0.78 and chance(n - 1) < 0.8
    # The plug-in answer (the spread as observed) names fewer seeds, at about even odds.
    plug_in = next(
        k for k in range(4, 50) if stats.half_width(estimate.sd, k) < 0.5 - abs(estimate.mean)
    )
    assert plug_in < n
    # A spread far wider than the tolerance: more than MAX_SEEDS.
    assert stats.seeds_to_settle(stats.mean_interval([3.0, -3.0]), 0.5, True) is None


def test_the_loss_gap_averages_the_last_tenth_of_steps_relative_and_absolute() -> None:
    baseline = {step: 2.0 for step in range(10, 101, 10)}
    curve = {**baseline, 90: 2.02, 100: 2.04}
    relative, absolute = stats.loss_gap(curve, baseline)
    assert relative == pytest.approx((0.01 + 0.02) / 2)
    assert absolute == pytest.approx(0.03)
    assert stats.loss_gap({**curve, 100: float("nan")}, baseline) is None


def test_the_gap_curve_is_relative_at_the_steps_both_logged() -> None:
    baseline = {1: 2.0, 2: 0.0, 3: 4.0}
    curve = {1: 2.2, 3: 3.0, 4: 1.0}
    # Step 2: fp32's loss of 0 has no relative gap; step 4: fp32 did not log it.
    assert stats.gap_curve(curve, baseline) == pytest.approx({1: 0.1, 3: -0.25})
