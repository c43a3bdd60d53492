"""Honest clocks and memory readings: synchronize the device before every clock read."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Writing 5 here resets the peak resident set size that getrusage reports (Linux 4.0+).
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # The jobs of a sweep share one process; without a reset every CPU job would report the
    # highest peak of the jobs before it. Where the reset is unavailable the peak stays cumulative.
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")


def state_bytes(parameters: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters and the optimizer's state tensors: what a precision keeps
    between steps, which the CPU's peak resident set hides among everything else."""
    tensors = [*parameters]
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated tensor memory on CUDA; on the CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Throughput:
    """Samples per second over timed training only: warm-up and evaluation are left out."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.started = False
        self.paused_at: float | None = None
        self.total_s = 0.0
        self.total_samples = 0
        self.total_steps = 0

    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def start(self, samples: int, steps: int) -> None:
        self.started = True
        self.lap_time, self.lap_samples, self.lap_steps = self._now(), samples, steps

    def pause(self) -> None:
        if self.started:
            self.paused_at = self._now()

    def resume(self) -> None:
        if self.paused_at is not None:
            self.lap_time += self._now() - self.paused_at
            self.paused_at = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave what runs inside (evaluation, a checkpoint) out of the timed training."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    @contextlib.contextmanager
    def left_out(self, progress: Any) -> Iterator[None]:
        """Leave one step out of the timed training: its time, samples and step count
        (``progress`` is the engine's, which the step advances)."""
        samples, steps = progress.samples, progress.step
        with self.paused():
            yield
        if self.started:
            self.lap_samples += progress.samples - samples
            self.lap_steps += progress.step - steps

    def lap(self, samples: int, steps: int) -> tuple[float | None, float | None]:
        """(samples/s, ms per step) since the last lap, or (None, None) before timing starts."""
        if not self.started or steps == self.lap_steps:
            return None, None
        now = self._now()
        elapsed = now - self.lap_time
        new_samples, new_steps = samples - self.lap_samples, steps - self.lap_steps
        self.total_s += elapsed
        self.total_samples += new_samples
        self.total_steps += new_steps
        self.lap_time, self.lap_samples, self.lap_steps = now, samples, steps
        return new_samples / elapsed, 1000 * elapsed / new_steps

    def state_dict(self) -> dict[str, float]:
        """The timed totals so far, so a resumed run reports the speed of all its attempts."""
        return {"seconds": self.total_s, "samples": self.total_samples, "steps": self.total_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.total_s, self.total_samples = state["seconds"], int(state["samples"])
        self.total_steps = int(state["steps"])

    def samples_per_s(self) -> float | None:
        return self.total_samples / self.total_s if self.total_s > 0 else None

    def step_time_ms(self) -> float | None:
        return 1000 * self.total_s / self.total_steps if self.total_steps else None
