"""The AB/BA rounds every speed answer is measured in: the speed trial's pairs, the doctor's
kernels (and whatever else times one thing against fp32) run through ``play``.

Two sides, fp32 (A) and a candidate (B), each warmed up until its step time settles
(training/timing.py's ``warm_up``), then timed ``steps`` steps each in rounds whose order
alternates, AB then BA, looking at the interval every 10 rounds (capability/ratio.py's ``looks``)
until it is narrow enough or ``max_rounds``. A round logs a progress line with the running
ratio and, from ``ratio.MIN_ROUNDS`` rounds on, its interval, when ``PROGRESS_EVERY_S`` have
passed since the last: a trial of minutes shows where it stands after every round. A signal
stops the rounds between steps; the rounds done before it are kept.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from amp_exp.capability import ratio
from amp_exp.config.adaptive import SpeedStopping
from amp_exp.report.compare import BASELINE
from amp_exp.report.words import speedup_cell
from amp_exp.results.contract import Stopped
from amp_exp.training.timing import StepClock, time_steps, warm_up

log = logging.getLogger("amp_exp")
# A progress line for each round that ends this long after the last line: every round of a
# trial of minutes, a line every few seconds of one whose rounds take milliseconds.
PROGRESS_EVERY_S = 5.0


@dataclass
class Side:
    """One side of a pair: its step, and what its warm-up and rounds measured."""

    step: Callable[[], object]
    # The side's skipped steps so far, read on the host between rounds; None: it skips none.
    skips: Callable[[], int] | None = None
    warmup_steps: int = 0
    steady: bool = False
    # Each round's step times, and how many of its steps the device skipped.
    seconds: list[list[float]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def warm(self, device: torch.device, max_steps: int) -> None:
        self.warmup_steps, self.steady = warm_up(self.step, device, max_steps)

    def time_round(self, clock: StepClock, steps: int) -> None:
        before = self.skips() if self.skips else 0
        self.seconds.append(time_steps(self.step, clock, steps))
        # After the clock stopped: the host read of the skips is not timed.
        self.skipped.append((self.skips() if self.skips else 0) - before)

    def per_applied_step(self) -> list[float]:
        """Each round's median step times its steps over its applied steps, in seconds."""
        return [
            statistics.median(steps) * len(steps) / (len(steps) - skipped)
            if skipped < len(steps)
            else float("inf")
            for steps, skipped in zip(self.seconds, self.skipped, strict=True)
        ]

    def total_per_applied_step(self) -> float:
        applied = sum(len(steps) for steps in self.seconds) - sum(self.skipped)
        return sum(map(sum, self.seconds)) / applied if applied else float("inf")


def round_orders(candidate: str, rounds: int) -> list[tuple[str, str]]:
    """AB, BA, AB, ...: each side first in exactly half of an even number of rounds."""
    pair = (BASELINE, candidate)
    return [pair if r % 2 == 0 else pair[::-1] for r in range(rounds)]


def pair_speedup(sides: dict[str, Side], label: str) -> ratio.Speedup:
    """The candidate's speedup over fp32 in the rounds done (capability/ratio.py); ValueError below
    ``ratio.MIN_ROUNDS`` rounds or with no spread."""
    baseline, candidate = sides[BASELINE], sides[label]
    return ratio.speedup(
        baseline.per_applied_step(),
        candidate.per_applied_step(),
        baseline.total_per_applied_step() / candidate.total_per_applied_step(),
    )


def log_ratios(sides: dict[str, Side], label: str) -> np.ndarray:
    """Each round's log of fp32's time per applied step over the candidate's."""
    return np.log(np.divide(sides[BASELINE].per_applied_step(), sides[label].per_applied_step()))


def progress_line(sides: dict[str, Side], label: str, rounds: int, max_rounds: int) -> str:
    """speed bf16 vs fp32, round 7/20: 1.52x [1.40, 1.65] so far"""
    head = f"speed {label} vs {BASELINE}, round {rounds}/{max_rounds}: "
    try:
        found = pair_speedup(sides, label).as_dict()
    except ValueError:
        return head + (
            f"{float(np.exp(log_ratios(sides, label).mean())):.2f}x so far (no interval before "
            f"{ratio.MIN_ROUNDS} rounds)"
        )
    return head + f"{speedup_cell(found)} so far"


def play(
    sides: dict[str, Side],
    label: str,
    device: torch.device,
    stopping: SpeedStopping,
    steps: int,
    max_warmup_steps: int,
) -> tuple[list[tuple[str, str]], bool, Stopped | None]:
    """Warm both sides, then time the rounds; (the orders done, whether the interval got narrow
    enough, the signal that stopped the rounds or None). A round cut short is dropped."""
    for side in sides.values():
        side.warm(device, max_warmup_steps)
    clock = StepClock(device)
    shown = -math.inf
    orders: list[tuple[str, str]] = []
    reached = False
    try:
        for rounds in ratio.looks(stopping.rounds, stopping.max_rounds):
            for order in round_orders(label, rounds)[len(orders) :]:
                for key in order:
                    sides[key].time_round(clock, steps)
                orders.append(order)
                if time.monotonic() - shown >= PROGRESS_EVERY_S:
                    shown = time.monotonic()
                    log.info("%s", progress_line(sides, label, len(orders), stopping.max_rounds))
            reached = bool(ratio.narrow(log_ratios(sides, label), stopping.target_halfwidth))
            if reached:
                break
    except Stopped as stop:
        for side in sides.values():
            del side.seconds[len(orders) :], side.skipped[len(orders) :]
        return orders, reached, stop
    return orders, reached, None


# The short trial, the doctor's on the probe's kernels and precision=auto's on a run's model: the
# speed trial's own stopping rule and defaults (10 rounds, then a look every 10 up to 20,
# stopping once the interval is within 5% either way), one forward+backward a step.
TRIAL = SpeedStopping()
TRIAL_STEPS = 1
TRIAL_WARMUP_STEPS = 10


def pass_trials(
    passes: Mapping[str, Callable[[], object]], device: torch.device
) -> dict[str, dict[str, Any]]:
    """Each low precision's speedup over fp32 in the doctor's trial, each pass (fp32's among
    them) one step of its side: the probe's kernels here, a run's model for precision=auto
    (amp_exp/build.py)."""
    found: dict[str, dict[str, Any]] = {}
    for precision, step in passes.items():
        if precision == BASELINE:
            continue
        sides = {BASELINE: Side(passes[BASELINE]), precision: Side(step)}
        _, _, stopped = play(sides, precision, device, TRIAL, TRIAL_STEPS, TRIAL_WARMUP_STEPS)
        if stopped is not None:
            raise stopped
        try:
            found[precision] = pair_speedup(sides, precision).as_dict()
        except ValueError as error:
            found[precision] = {"not_measured": str(error)}
        # As the speed trial records its pairs: how long each side warmed up, and whether it
        # settled (a side still trending at TRIAL_WARMUP_STEPS is timed anyway, and says so).
        found[precision]["warmup_steps"] = {p: side.warmup_steps for p, side in sides.items()}
        found[precision]["steady"] = {p: side.steady for p, side in sides.items()}
    return found
