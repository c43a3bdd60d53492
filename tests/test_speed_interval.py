"""The speed trial's interval covers at its stated level (97.5%) when rounds are autocorrelated,
as on a shared machine: simulated AR(1) log ratios, with a carry-over between AB and BA rounds,
through capability/ratio.py's own fit and critical values, at fixed rounds and under the trial's
stopping rule. A plain t interval, labelled 97.5%, covers 73-75% at an autocorrelation of 0.6
(the review): checked too, so the test can tell a bad interval from a good one."""

from __future__ import annotations

import math

import numpy as np
import pytest

from amp_exp.capability import ratio
from amp_exp.capability.ratio import TRIAL_CONFIDENCE, fit, log_half_width, looks, narrow, speedup
from amp_exp.report.stats import half_width

PATHS = 4000
# Three binomial standard errors of the stated coverage at PATHS.
MARGIN = 3 * math.sqrt(TRIAL_CONFIDENCE * (1 - TRIAL_CONFIDENCE) / PATHS)
TRUTH = math.log(1.3)
CARRY_OVER = math.log(1.04)


def rounds(rho: float, n: int, sd: float = 0.05, seed: int = 3) -> np.ndarray:
    """Log ratios around log 1.3: AR(1) noise of spread ``sd``, AB rounds 4% above BA rounds."""
    rng = np.random.default_rng(seed)
    noise = np.empty((PATHS, n))
    noise[:, 0] = rng.standard_normal(PATHS)
    for t in range(1, n):
        noise[:, t] = rho * noise[:, t - 1] + math.sqrt(1 - rho**2) * rng.standard_normal(PATHS)
    return TRUTH + sd * noise + CARRY_OVER * ratio.orders(n)


@pytest.mark.parametrize("rho", [0.0, 0.4, 0.6])
@pytest.mark.parametrize("n", [10, 20])
def test_the_interval_covers_at_its_stated_level_under_autocorrelated_rounds(rho, n) -> None:
    logs = rounds(rho, n)
    mean = fit(logs)[0]
    covered = float((np.abs(mean - TRUTH) <= log_half_width(logs)).mean())
    assert covered >= TRIAL_CONFIDENCE - MARGIN, (rho, n, covered)


@pytest.mark.parametrize("rho", [0.0, 0.6])
def test_the_interval_a_trial_stops_on_covers_under_autocorrelated_rounds(rho) -> None:
    """The trial looks at 10 and 20 rounds and stops once the interval is within 5%: a spread
    at which some trials stop early and some do not."""
    logs = rounds(rho, 20, sd=0.02)
    covered = np.zeros(PATHS, dtype=bool)
    open_ = np.ones(PATHS, dtype=bool)
    for n in looks(10, 20):
        seen = logs[:, :n]
        here = open_ & (narrow(seen, math.log(1.05)) | (n == 20))
        covered[here] = (np.abs(fit(seen)[0] - TRUTH) <= log_half_width(seen))[here]
        open_ &= ~here
    assert covered.mean() >= TRIAL_CONFIDENCE - MARGIN, covered.mean()


def test_a_plain_t_interval_would_not_cover_at_an_autocorrelation_of_0_6() -> None:
    logs = rounds(0.6, 20)
    width = half_width(logs.std(axis=1, ddof=1), 20, TRIAL_CONFIDENCE)
    assert float((np.abs(logs.mean(axis=1) - TRUTH) <= width).mean()) < 0.9


def test_the_order_term_measures_the_carry_over_and_keeps_it_out_of_the_speedup() -> None:
    logs = TRUTH + CARRY_OVER * ratio.orders(20) + 0.001 * np.sin(np.arange(20))
    found = speedup(np.exp(logs), np.ones(20), 1.3)
    assert found.carry_over == pytest.approx(1.04, abs=0.002)
    assert found.ratio == pytest.approx(1.3, abs=0.002)
