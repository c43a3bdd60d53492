"""Interleaved timing: the one way amp_exp times candidates against each other.

Timed one after another, two jobs on a shared machine measure whatever the neighbours were doing
during each (the same bf16 job timed 2.95x and 1.18x fp32 on two seeds of one sweep). Here the
candidates take turns instead: after untimed warm-up steps of each, every round runs ``steps``
steps of each candidate in the same order (A B C A B C ...), so a load spike slows one round of
each candidate rather than all of one, and candidate k of round r is compared with the baseline
of the same round. The device is synchronized before every clock read, so on CUDA the time is
that of the work, not of its launch.

``precision=auto`` (training/auto_precision.py) and the speed trial (amp_exp/speed/) both call
``interleave``; only what a step is differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

import torch

from amp_exp.training.meters import synchronize

Key = TypeVar("Key", bound=Hashable)


def interleave(
    steppers: Mapping[Key, Callable[[], object]],
    device: torch.device,
    steps: int,
    rounds: int,
    warmup_steps: int = 1,
) -> dict[Key, list[float]]:
    """Seconds per step of each candidate in each round: ``{key: [round 1, round 2, ...]}``.

    ``steppers`` maps each candidate to a callable that runs one step of it; they run in the
    mapping's order within every round.
    """
    for step in steppers.values():
        for _ in range(warmup_steps):
            step()
    seconds: dict[Key, list[float]] = {key: [] for key in steppers}
    for _ in range(rounds):
        for key, step in steppers.items():
            synchronize(device)
            started = time.perf_counter()
            for _ in range(steps):
                step()
            synchronize(device)
            seconds[key].append((time.perf_counter() - started) / steps)
    return seconds
