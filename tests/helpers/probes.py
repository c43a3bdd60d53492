"""Probe measurements injected into the cache, so no test depends on the machine it runs on."""

from __future__ import annotations

import torch

from amp_exp.runtime.probe import KERNELS, KernelTime, remember
from amp_exp.training.capability import Capability


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
