"""calibration.json (scripts/calibrate_rules.py) states simulated rates: re-simulated here at a
smaller size, each within three binomial standard errors of what it states, so a levels table
edited by hand, or simulated wrongly, fails."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from amp_exp.report import stats as rules
from amp_exp.report.stats import ONE_SIDED, calibration

PATHS = 20_000
# The paths scripts/calibrate_rules.py finds each plan's constant on.
CALIBRATION_PATHS = 200_000


def margin(rate: float, *paths: int) -> float:
    """Three binomial standard errors of a difference between rates simulated on ``paths``
    (one sample: PATHS)."""
    return 3 * math.sqrt(rate * (1 - rate) * sum(1 / p for p in paths or (PATHS,)))


def crossing_rate(looks: list[int], alphas: list[float], seed: int) -> float:
    """The share of null paths (true difference on the tolerance) whose one-sample t-statistic
    crosses some look's boundary: the chance of a false claim on that side."""
    z = np.random.default_rng(seed).standard_normal((PATHS, looks[-1]))
    crossed = np.zeros(PATHS, dtype=bool)
    for n, alpha in zip(looks, alphas, strict=True):
        part = z[:, :n]
        t = part.mean(axis=1) / (part.std(axis=1, ddof=1) / math.sqrt(n))
        crossed |= t > stats.t.isf(alpha, n - 1)
    return float(crossed.mean())


@pytest.mark.parametrize("plan", ["2-5", "3-5", "2-8", "3-10"])
def test_the_stored_boundaries_give_the_stated_2_5_percent(plan: str) -> None:
    found = calibration()["boundaries"][plan]
    # C is a quantile of CALIBRATION_PATHS paths, its rate re-simulated on found["paths"].
    stated = margin(ONE_SIDED, CALIBRATION_PATHS, found["paths"])
    assert abs(found["false_claim"] - ONE_SIDED) <= stated, found["false_claim"]
    rate = crossing_rate(found["looks"], found["alphas"], seed=7)
    assert abs(rate - found["false_claim"]) <= margin(ONE_SIDED, PATHS, found["paths"]), rate


def test_bonferronis_levels_would_claim_less_often_than_stated() -> None:
    """The check can fail: Bonferroni's levels over the same looks cross well below 2.5%."""
    looks = list(range(2, 6))
    rate = crossing_rate(looks, [ONE_SIDED / 4] * 4, seed=7)
    assert rate < ONE_SIDED - margin(ONE_SIDED), rate


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_the_skewness_check_withholds_its_stated_share_of_normal_differences(n: int) -> None:
    deltas = np.random.default_rng(n).standard_normal((PATHS, n))
    flagged = float((rules.skewness(deltas) > rules.threshold(n)).mean())
    assert abs(flagged - rules.WITHHOLD_RATE) <= margin(rules.WITHHOLD_RATE), flagged


def test_a_visible_outlier_withholds_matches_and_two_differences_pass() -> None:
    assert not rules.t_reliable([0.0, 0.01, 0.02, 0.01, 0.6])
    assert rules.t_reliable([0.0, 0.01, 0.02, 0.015, 0.005])
    assert rules.t_reliable([0.0, 5.0])
