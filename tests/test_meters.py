"""Memory readings (on the CPU each run's peak starts from where the run begins) and the
throughput clock's attempts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from amp_exp.training.meters import Throughput, peak_memory_bytes, reset_peak_memory

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


def timed_attempt(precision: str, earlier: dict | None, steps: range, timed: bool = True):
    """An attempt that trains ``steps`` at 10 samples a step and 1 s a step on a ticking clock,
    resumed from ``earlier`` (a checkpoint's throughput state)."""
    throughput = Throughput(CPU, precision, timed)
    clock = iter(range(1000))
    throughput._now = lambda: float(next(clock))
    if earlier is not None:
        throughput.load_state_dict(earlier)
    throughput.start(10 * steps.start, steps.start)
    throughput.lap(10 * steps.stop, steps.stop)
    return throughput


def test_attempts_are_kept_apart_and_the_run_speed_is_its_current_precisions() -> None:
    """fp16 to step 4, then fp32 to step 6 and on to step 10: the run's speed is the fp32
    attempts' together, and each attempt keeps its own."""
    fp16 = timed_attempt("fp16", None, range(0, 4))
    fp32 = timed_attempt("fp32", fp16.state_dict(4), range(4, 6))
    # Each lap here covers one clock tick: the speeds tell the attempts apart by their steps.
    again = timed_attempt("fp32", fp32.state_dict(6), range(6, 10))
    assert [
        (a["precision"], a["first_step"], a["last_step"], a["timed_steps"], a["samples_per_s"])
        for a in again.attempts(10)
    ] == [("fp16", 1, 4, 4, 40.0), ("fp32", 5, 6, 2, 20.0), ("fp32", 7, 10, 4, 40.0)]
    assert again.samples_per_s() == 60 / 2 and again.timed_steps() == 6
    assert again.step_time_ms() == 1000 * 2 / 6
    # An attempt that trained nothing (resumed at its last step) is no attempt.
    assert len(timed_attempt("fp32", again.state_dict(10), range(10, 10)).attempts(10)) == 3


def test_an_untimed_precision_counts_its_steps_but_reports_no_speed() -> None:
    emulated = timed_attempt("fp8", None, range(0, 4), timed=False)
    assert emulated.samples_per_s() is None and emulated.timed_steps() == 4
    assert emulated.attempts(4)[0]["samples_per_s"] is None


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
    assert throughput.timed_steps() == 2 and throughput.samples == 200
