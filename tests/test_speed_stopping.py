"""The speed trial stops when it knows: looks every 10 rounds from speed.rounds to
speed.max_rounds, stopping once the 97.5% interval of the log ratio is within
speed.target_halfwidth, and the interval it stops on still covers (Chow-Robbins, simulated)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import amp_exp.speed.trial as trial_module
from amp_exp.capability.ratio import log_half_width, looks, narrow
from amp_exp.config.schema import SpeedConfig
from amp_exp.errors import ConfigError
from amp_exp.report.stats import half_width
from amp_exp.speed.__main__ import candidates
from helpers.runs import TINY

TARGET = math.log(1.05)
REPETITIONS = 20_000


def stopped(logs: np.ndarray, at: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each simulated trial's rounds at its stop, and the mean and half-width it stopped on."""
    rounds = np.full(len(logs), at[-1])
    mean, width = np.zeros(len(logs)), np.zeros(len(logs))
    open_ = np.ones(len(logs), dtype=bool)
    for n in at:
        seen = logs[:, :n]
        here = open_ & (narrow(seen, TARGET) | (n == at[-1]))
        rounds[here] = n
        mean[here], width[here] = seen[here].mean(axis=1), log_half_width(seen[here])
        open_ &= ~here
    return rounds, mean, width


@pytest.mark.parametrize("sd", [0.03, 0.06, 0.08, 0.1, 0.15, 0.3])
def test_the_interval_a_trial_stops_on_covers_more_than_its_95_percent_claim(sd: float) -> None:
    """Normal log ratios around log 1.3 at spreads that stop at the first look (0.03), at the
    later ones (0.06-0.15), or never (0.3). The worst spread, 0.08, covers 96.7% (the review
    said at least 97%; 40,000 trials give 96.7-96.9% at 0.08-0.1, 0.1 point standard error): above
    the 95% the speedup is read at, and a rule that looked every round at 95% covers about 92%
    (asserted below), which this test would catch."""
    rng = np.random.default_rng(0)
    truth = math.log(1.3)
    logs = rng.normal(truth, sd, size=(REPETITIONS, 40))
    rounds, mean, width = stopped(logs, looks(10, 40))
    covered = np.abs(mean - truth) <= width
    assert covered.mean() >= 0.965, (sd, covered.mean(), np.bincount(rounds))


def test_looking_every_round_at_95_percent_would_not_cover() -> None:
    """The design the review rejected, through the same simulation: it must fall short, or the
    simulation above could not tell a bad rule from a good one."""
    rng = np.random.default_rng(0)
    logs = rng.normal(0.0, 0.06, size=(REPETITIONS, 40))
    at = list(range(4, 41))
    rounds = np.full(REPETITIONS, 40)
    covered = np.zeros(REPETITIONS, dtype=bool)
    open_ = np.ones(REPETITIONS, dtype=bool)
    for n in at:
        seen = logs[:, :n]
        width = half_width(seen.std(axis=1, ddof=1), n, 0.95)
        here = open_ & ((width < TARGET) | (n == 40))
        rounds[here] = n
        covered[here] = np.abs(seen[here].mean(axis=1)) <= width[here]
        open_ &= ~here
    assert covered.mean() < 0.94, covered.mean()


def test_looks_come_every_10_rounds_from_the_minimum_and_end_at_the_maximum() -> None:
    assert looks(10, 40) == [10, 20, 30, 40]
    assert looks(10, 36) == [10, 20, 30, 36]
    assert looks(6, 6) == [6]  # max_rounds = rounds: the fixed trial of before


def test_the_rounds_a_trial_takes_depend_on_how_noisy_its_ratios_are(run_cfg, monkeypatch) -> None:
    """Rounds timed by a fake clock: ratios of 2x +- 1% stop at the first look with the target
    reached, +- 40% run to max_rounds and say so; every look keeps AB/BA balanced."""
    rng = np.random.default_rng(1)
    spread = {"sd": 0.01}
    # The steps trial.py times for fp32, known by the run each was built from.
    fp32_steps = set()
    real_step = trial_module.training_step

    def tagged_step(built):
        step = real_step(built)
        if built.engine.precision.spec.name == "fp32":
            fp32_steps.add(id(step))
        return step

    def fake_round(side, clock, steps) -> None:
        fp32 = id(side.step) in fp32_steps
        noise = math.exp(rng.normal(0, spread["sd"])) if fp32 else 1.0
        side.seconds.append([(2.0 * noise if fp32 else 1.0)] * steps)
        side.skipped.append(0)

    monkeypatch.setattr(trial_module, "training_step", tagged_step)
    monkeypatch.setattr(trial_module.Side, "time_round", fake_round)
    monkeypatch.setattr(trial_module.Side, "warm", lambda side, device, max_steps: None)
    cfg = run_cfg(*TINY, "speed.precisions=[bf16]", "speed.max_rounds=30", "speed.steps=1")
    quick = trial_module.run_trial(candidates(cfg), cfg.speed)
    assert quick["speedup"]["bf16"]["rounds"] == 10
    assert quick["speedup"]["bf16"]["target_reached"] is True
    spread["sd"] = 0.4
    slow = trial_module.run_trial(candidates(cfg), cfg.speed)
    found = slow["speedup"]["bf16"]
    assert found["rounds"] == 30 and found["target_reached"] is False
    orders = slow["pairs"]["bf16"]["order"]
    assert [order[0] for order in orders].count("fp32") == 15
    assert "target not reached" in trial_module.show_speedup(found)
    # One interval, at the level of the looks: a 95% one beside it would be a second claim.
    assert found["confidence"] == 0.975 and "ci95" not in found


def test_max_rounds_below_the_first_look_or_odd_is_refused(run_cfg) -> None:
    with pytest.raises(ConfigError, match=r"speed.max_rounds=8 must be even and at least"):
        run_cfg("speed.max_rounds=8")
    with pytest.raises(ConfigError, match=r"speed.max_rounds=21 must be even"):
        run_cfg("speed.max_rounds=21")
    with pytest.raises(ConfigError, match=r"speed.target_halfwidth=0.0 must be positive"):
        run_cfg("speed.target_halfwidth=0")
    assert SpeedConfig().target_halfwidth == pytest.approx(TARGET)
