"""Interleaved timing: the one way amp_exp times candidates against each other.

Timed one after another, two jobs on a shared machine measure whatever the neighbours were doing
during each (the same bf16 job timed 2.95x and 1.18x fp32 on two seeds of one sweep). Here the
candidates take turns instead, so a load spike slows one round of each candidate rather than all
of one, and candidate k of round r is compared with the baseline of the same round. The speed
trial's rounds (amp_exp/capability/rounds.py; the speed trial, the doctor and precision=auto
play them) run each pair in AB/BA order through ``time_steps``, after ``warm_up`` has run each
side until its step times show no trend.

Every step is timed on its own, so a round can be summarized by its median step, which a
neighbour's burst does not move (scripts/bench_parity.py reads median step times too). On CUDA
the steps are timed by events on the stream, read after one synchronize at the end of the
round: the time is that of the work, not of its launch, and no step waits for the host.

"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from scipy.stats import kendalltau

from amp_exp.config.adaptive import SPEED_WARMUP_WINDOW
from amp_exp.training.meters import synchronize

# Warm-up is over at the first stretch of two windows whose step times a Mann-Kendall test
# (Kendall's tau against the step's index, two-sided) does not find trending at this level. A
# wrong rejection costs one more window; a missed trend biases every round after it, so the
# level is not set lower. Exact at 10 steps: stationary times are rejected 4.9% of the time.
WARMUP_LEVEL = 0.05


class StepClock:
    """The seconds each step of a stretch took: CUDA events, or the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def _mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        synchronize(self.device)
        self.marks = [self._mark()]

    def lap(self) -> None:
        """Mark the end of a step."""
        self.marks.append(self._mark())

    def seconds(self) -> list[float]:
        """Each step's time since ``start``, in order."""
        synchronize(self.device)
        pairs = zip(self.marks, self.marks[1:], strict=False)
        if self.cuda:
            return [begin.elapsed_time(end) / 1e3 for begin, end in pairs]
        return [end - begin for begin, end in pairs]


def time_steps(step: Callable[[], object], clock: StepClock, steps: int) -> list[float]:
    """Seconds of each of ``steps`` runs of ``step``, timed one by one."""
    clock.start()
    for _ in range(steps):
        step()
        clock.lap()
    return clock.seconds()


def trending(seconds: list[float], level: float = WARMUP_LEVEL) -> bool:
    """Whether step times drift with the step (Mann-Kendall: Kendall's tau against the index)
    at ``level``: rank-based, so one step a neighbour slowed does not make a trend."""
    return bool(kendalltau(np.arange(len(seconds)), seconds).pvalue < level)


def warm_up(
    step: Callable[[], object],
    device: torch.device,
    max_steps: int,
    window: int = SPEED_WARMUP_WINDOW,
    level: float = WARMUP_LEVEL,
) -> tuple[int, bool]:
    """Run ``step`` a ``window`` of steps at a time until the last two windows' step times show
    no trend at ``level`` (``trending``), at most ``max_steps`` steps; returns (steps run,
    steady). The test reads the times the clock recorded; no step waits for it.

    A fixed count is either too short or wasted: on a 2-core CPU the first 6 of 10 rounds of a
    gpt_tiny trial ran 2.5-80x slower than the last 4 after a 3-step warm-up. Two window
    medians that agreed within 5% passed a decay still under way.
    """
    clock = StepClock(device)
    seconds: list[float] = []
    while len(seconds) + window <= max_steps:
        seconds += time_steps(step, clock, window)
        if len(seconds) >= 2 * window and not trending(seconds[-2 * window :], level):
            return len(seconds), True
    return len(seconds), False
