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


def test_a_step_left_out_of_throughput_costs_it_no_time_samples_or_step(monkeypatch) -> None:
    from types import SimpleNamespace

    import amp_exp.training.meters as meters

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(meters.time, "perf_counter", lambda: clock.now)
    progress = SimpleNamespace(samples=0, step=0)
    throughput = meters.Throughput(CPU)
    throughput.start(progress.samples, progress.step)

    def step(seconds: float) -> None:
        clock.now += seconds
        progress.samples += 100
        progress.step += 1

    step(1.0)
    with throughput.left_out(progress):
        step(5.0)  # the audited step: slow, and not a step of timed training
    step(1.0)
    assert throughput.lap(progress.samples, progress.step) == (100.0, 1000.0)
    assert throughput.total_steps == 2 and throughput.total_samples == 200
