"""The speed trial's warm-up (training/timing.py): it ends at the first stretch whose step times
a Mann-Kendall test does not find trending at ``WARMUP_LEVEL``. The simulations' thresholds come
from that level with a binomial margin."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import amp_exp.training.timing as timing
from amp_exp.config.adaptive import SPEED_WARMUP_WINDOW

REPS = 1000


def margin(reps: int) -> float:
    """Three binomial standard errors of a share of ``reps`` at the stated level."""
    return 3 * math.sqrt(timing.WARMUP_LEVEL * (1 - timing.WARMUP_LEVEL) / reps)


CPU = torch.device("cpu")


def planted(times: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up's clock reads ``times``, a window at a time."""
    steps = iter(times.tolist())
    monkeypatch.setattr(
        timing, "time_steps", lambda step, clock, n: [next(steps) for _ in range(n)]
    )


def test_stationary_step_times_are_called_trending_at_the_stated_rate() -> None:
    """Caught: a test that rejects noise more often than its level (the warm-up would run to its
    cap on a steady machine) or never (it would end during a decay)."""
    rng = np.random.default_rng(0)
    stretch = 2 * SPEED_WARMUP_WINDOW
    rate = np.mean([timing.trending(list(rng.normal(1.0, 0.02, stretch))) for _ in range(REPS)])
    assert abs(rate - timing.WARMUP_LEVEL) <= margin(REPS)


def test_the_warm_up_ends_after_a_planted_decay_not_during_it(monkeypatch) -> None:
    """Caught: a warm-up that ends while the step time is still falling (the old rule, two
    window medians within 5%, passed a slow decay). The decay's excess, 4x the step and shrinking
    by 0.7 a step, is below the noise's 2% from step 15 on: no end may come before it, and the
    end comes soon after it in all but about ``WARMUP_LEVEL`` of the runs."""
    rng = np.random.default_rng(1)
    decay_ends = math.ceil(math.log(0.02 / 4) / math.log(0.7))
    ends = []
    for _ in range(REPS // 4):  # each run tests several stretches
        steps = np.arange(100)
        planted((1 + 4 * 0.7**steps) * rng.normal(1.0, 0.02, 100), monkeypatch)
        ends.append(timing.warm_up(lambda: None, CPU, max_steps=100))
    assert all(steady and ran >= decay_ends for ran, steady in ends)
    late = np.mean([ran > decay_ends + 3 * SPEED_WARMUP_WINDOW for ran, _ in ends])
    assert late <= timing.WARMUP_LEVEL + margin(len(ends))


def test_the_warm_up_stops_at_its_cap_unsteady_and_reads_only_recorded_times(monkeypatch) -> None:
    """Caught: a cap overrun, or a steady claim for times that never stopped falling."""
    planted(np.linspace(10.0, 1.0, 100), monkeypatch)
    assert timing.warm_up(lambda: None, CPU, max_steps=14) == (10, False)


def test_a_flipped_comparison_fails_both_simulations(monkeypatch) -> None:
    """The mutation check: ``trending`` rejecting where p >= the level (the comparison flipped)
    fails the stated-rate test and the planted-decay test alike."""
    real = timing.trending
    monkeypatch.setattr(timing, "trending", lambda s, level=timing.WARMUP_LEVEL: not real(s, level))
    for test in (
        test_stationary_step_times_are_called_trending_at_the_stated_rate,
        lambda: test_the_warm_up_ends_after_a_planted_decay_not_during_it(monkeypatch),
    ):
        with pytest.raises(AssertionError):
            test()
