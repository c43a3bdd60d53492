"""Probe measurements injected into the cache, so no test depends on the machine it runs on."""

from __future__ import annotations

import torch

from amp_exp.capability.device import Capability
from amp_exp.capability.probe import KERNELS, KernelTime, remember


def timing_at(speed: float) -> dict[str, KernelTime]:
    """Probe kernel times for a precision that runs at ``speed`` times fp32's speed."""
    return {kernel: KernelTime(ms=1 / speed, tflops=speed) for kernel in KERNELS}


def inject_probe(speeds: dict[str, float]) -> None:
    """Cache a probe result in which each precision runs at ``speeds[p]`` times fp32's speed."""
    remember(torch.device("cpu"), {p: timing_at(speed) for p, speed in speeds.items()})


def capability_with(speeds: dict[str, float], device: str = "cpu", **facts) -> Capability:
    """A device's capability as if the probe measured ``speeds`` (relative to fp32's)."""
    measured = {p: timing_at(speed) for p, speed in speeds.items()}
    return Capability(device, f"test {device}", facts, measured, key=f"test {device}")


def short_trials(monkeypatch) -> list:
    """The doctor's (and auto's) speed trials shrunk to 4 rounds with no warm-up and a progress
    line every round; returns the list of the precisions ``play`` timed, in order."""
    import amp_exp.capability.rounds
    from amp_exp.config.adaptive import SpeedStopping

    monkeypatch.setattr(amp_exp.capability.rounds, "TRIAL", SpeedStopping(rounds=4, max_rounds=4))
    monkeypatch.setattr(amp_exp.capability.rounds, "TRIAL_WARMUP_STEPS", 0)
    monkeypatch.setattr(amp_exp.capability.rounds, "PROGRESS_EVERY_S", 0.0)
    played = []
    real_play = amp_exp.capability.rounds.play
    monkeypatch.setattr(
        amp_exp.capability.rounds, "play", lambda *a, **k: played.append(a[1]) or real_play(*a, **k)
    )
    return played
