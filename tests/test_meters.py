"""Memory readings: on the CPU each run's peak starts from where the run begins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from amp_exp.training.meters import peak_memory_bytes, reset_peak_memory

CPU = torch.device("cpu")
MiB = 2**20


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="the CPU peak resets only on Linux"
)
def test_cpu_peak_memory_does_not_carry_over_from_an_earlier_job() -> None:
    # The jobs of a sweep share a process: a small job after a big one must not report its peak.
    big_job = torch.ones(64 * MiB)  # 256 MiB, written, so resident
    big_peak = peak_memory_bytes(CPU)
    del big_job
    reset_peak_memory(CPU)
    assert peak_memory_bytes(CPU) < big_peak - 128 * MiB
