"""A mutation check: each rule flipped in-process (monkeypatched) makes a named test fail, so
the suite can tell the rule from its mutant. Holm's level doubled, only `matches` qualifying,
the sweeper's looks each at the nominal 2.5% (no sequential schedule), and the intervals'
confidence lowered (the verdicts' to 90%, the speed trial's to a plain t interval)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from scipy import stats as scipy_stats

import test_decision
import test_evidence
import test_evidence_sweeper
import test_speed_interval
from amp_exp.capability import ratio
from amp_exp.report import assemble, recommend, sequential, stats

pytestmark = pytest.mark.slow

HOLM = (
    test_evidence.test_holm_across_comparisons_turns_claims_that_fail_their_threshold_inconclusive
)
BETTER = test_decision.test_better_by_five_points_and_faster_by_an_interval_is_used
SWEEPER = test_evidence_sweeper.test_at_the_worse_boundary_a_false_safe_claim_or_worse_stays_within_2_5_percent  # noqa: E501
INTERVAL = test_evidence.test_seeds_form_one_cell_paired_seed_by_seed_with_scipys_interval
SPEED = test_speed_interval.test_the_interval_covers_at_its_stated_level_under_autocorrelated_rounds


def fails(test: Callable[..., None], *args) -> bool:
    try:
        test(*args)
    except AssertionError:
        return True
    return False


def test_unmutated_every_named_test_passes(tmp_path: Path) -> None:
    """So that a failure under a mutant below is the mutant's."""
    assert not fails(HOLM)
    assert not fails(BETTER, tmp_path / "a")
    assert not fails(SWEEPER, 0.3)
    assert not fails(INTERVAL, tmp_path / "b")
    assert not fails(SPEED, 0.6, 20)


def test_doubling_holms_level_fails_the_holm_test(monkeypatch) -> None:
    holm = stats.holm
    monkeypatch.setattr(stats, "holm", lambda p, alpha=stats.ONE_SIDED: holm(p, 2 * alpha))
    assert fails(HOLM)


def test_only_matches_qualifying_fails_the_better_and_faster_test(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(recommend, "QUALIFYING", ("matches",))
    assert fails(BETTER, tmp_path)


def test_looks_each_at_the_nominal_level_fail_the_sweepers_error_rate(monkeypatch) -> None:
    monkeypatch.setattr(sequential.Plan, "alpha", lambda self, n, unit: stats.ONE_SIDED)
    assert fails(SWEEPER, 0.3)


def test_a_90_percent_verdict_interval_fails_the_scipy_interval_test(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(assemble, "fixed_level", lambda n, unit: 0.05)
    assert fails(INTERVAL, tmp_path)


def test_a_plain_t_speed_interval_fails_the_autocorrelation_coverage_test(monkeypatch) -> None:
    monkeypatch.setattr(
        ratio, "critical_value", lambda n: scipy_stats.t.ppf(ratio.TRIAL_CONFIDENCE, n - 1)
    )
    assert fails(SPEED, 0.6, 20)
