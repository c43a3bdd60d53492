"""Honest clocks and memory readings, and the one meter that turns samples into units, FLOPs
and MFU.

Clocks synchronize the device before every read. ``Throughput`` times training (no warm-up, no
evaluation) attempt by attempt; ``Meter`` turns its samples/s into what rows and the summary
report: global units/s, and per-device units/s, TFLOP/s and MFU.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import takewhile
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
    return sum(t.numel() * t.element_size() for t in [*parameters, *optimizer_tensors(optimizer)])


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of the optimizer's state (moments, momentum buffers, step counts)."""
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated tensor memory on CUDA; on the CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Throughput:
    """Samples per second over timed training only: warm-up and evaluation are left out.

    A resumed run goes on counting, and keeps each attempt (one process's share of the run) apart:
    its precision, the last step it reached and its timed totals. The run's own figures cover only
    the latest attempts in the current precision, so a resume that changes precision never mixes
    two precisions' speeds. An untimed precision (emulated fp8) counts, but reports no speed.
    """

    def __init__(self, device: torch.device, precision: str | None = None, timed: bool = True):
        self.device, self.precision, self.timed = device, precision, timed
        self.started = False
        # This attempt's timed totals, and the attempts before it, as their checkpoints left them.
        self.seconds, self.samples, self.steps = 0.0, 0, 0
        self.earlier: list[dict[str, Any]] = []

    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def start(self, samples: int, steps: int) -> None:
        self.started = True
        self.lap_time, self.lap_samples, self.lap_steps = self._now(), samples, steps

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave what runs inside (evaluation, a checkpoint) out of the timed training."""
        paused_at = self._now() if self.started else None
        try:
            yield
        finally:
            if paused_at is not None:
                self.lap_time += self._now() - paused_at

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
        self.seconds += elapsed
        self.samples += new_samples
        self.steps += new_steps
        self.lap_time, self.lap_samples, self.lap_steps = now, samples, steps
        return _rates(self.timed, elapsed, new_samples, new_steps)

    def _attempt(self, step: int) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "timed": self.timed,
            "last_step": step,
            "seconds": self.seconds,
            "samples": self.samples,
            "timed_steps": self.steps,
        }

    def state_dict(self, step: int) -> dict[str, Any]:
        """Every attempt up to ``step``, where training stands, this one last."""
        return {"attempts": [*self.earlier, self._attempt(step)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.earlier = list(state["attempts"])

    def attempts(self, step: int) -> list[dict[str, Any]]:
        """Each attempt that trained a step, up to ``step``: its precision, its first and last
        step, and its speed."""
        shown, first = [], 1
        for attempt in [*self.earlier, self._attempt(step)]:
            if attempt["last_step"] >= first:
                samples_per_s, step_time_ms = _rates(
                    attempt["timed"], attempt["seconds"], attempt["samples"], attempt["timed_steps"]
                )
                shown.append(
                    {
                        "precision": attempt["precision"],
                        "first_step": first,
                        "last_step": attempt["last_step"],
                        "timed_steps": attempt["timed_steps"],
                        "samples_per_s": samples_per_s,
                        "step_time_ms": step_time_ms,
                    }
                )
            first = attempt["last_step"] + 1
        return shown

    def _in_this_precision(self) -> tuple[float, int, int]:
        """Timed seconds, samples and steps of this attempt and the unbroken run of earlier
        attempts in the same precision just before it."""
        same = takewhile(lambda a: a["precision"] == self.precision, reversed(self.earlier))
        attempts = [self._attempt(0), *same]
        return tuple(sum(a[key] for a in attempts) for key in ("seconds", "samples", "timed_steps"))

    def samples_per_s(self) -> float | None:
        return _rates(self.timed, *self._in_this_precision())[0]

    def step_time_ms(self) -> float | None:
        return _rates(self.timed, *self._in_this_precision())[1]

    def timed_steps(self) -> int:
        return self._in_this_precision()[2]


def _rates(
    timed: bool, seconds: float, samples: int, steps: int
) -> tuple[float | None, float | None]:
    """(samples/s, ms per step) of timed totals; (None, None) if untimed or nothing was timed."""
    if not timed or seconds <= 0 or steps == 0:
        return None, None
    return samples / seconds, 1000 * seconds / steps


@dataclass(frozen=True)
class Meter:
    """The one place that turns a run's global samples/s into what it reports.

    The task's units per second (tokens/s) count every rank, as samples/s do; TFLOP/s and MFU are
    per device, as torchtitan and nanoGPT report them: the FLOPs one device ran, against one
    device's peak. Units per second per device sit beside them. A task that counts samples only
    gets samples/s; where a figure is not known (no FLOPs count, no peak on a CPU) it is None.
    """

    unit: str = "samples"
    units_per_sample: int = 1
    world_size: int = 1
    flops_per_unit: float | None = None
    # The datasheet's dense peak of one device in the run's precision (training.flops), and
    # where it comes from.
    peak_tflops: float | None = None
    peak_source: str | None = None
    # The probe's matmul rate on one device in the run's precision: what the GPU really
    # delivers, often well below the datasheet (clocks, power limits), so MFU against it tells
    # how much of the reachable speed the model gets.
    measured_peak_tflops: float | None = None

    @property
    def counts_units(self) -> bool:
        return self.unit != "samples"

    def rates(self, samples_per_s: float | None) -> dict[str, float | None]:
        """samples/s, and for a task with units: units/s (global and per device), TFLOP/s, MFU
        and MFU against the measured peak (per device)."""
        rates: dict[str, float | None] = {"samples_per_s": samples_per_s}
        if not self.counts_units:
            return rates
        units_per_s = None if samples_per_s is None else samples_per_s * self.units_per_sample
        per_device = None if units_per_s is None else units_per_s / self.world_size
        tflops = None
        if per_device is not None and self.flops_per_unit is not None:
            tflops = self.flops_per_unit * per_device / 1e12
        rates.update(
            {
                f"{self.unit}_per_s": units_per_s,
                f"{self.unit}_per_s_per_device": per_device,
                "tflops": tflops,
                "mfu": _share(tflops, self.peak_tflops),
                "mfu_measured": _share(tflops, self.measured_peak_tflops),
            }
        )
        return rates

    def summary(self, samples_per_s: float | None) -> dict[str, Any]:
        """``rates`` and what they rest on: FLOPs per unit and the peak's source."""
        if not self.counts_units:
            return self.rates(samples_per_s)
        return {
            **self.rates(samples_per_s),
            f"flops_per_{self.unit.removesuffix('s')}": self.flops_per_unit,
            "mfu_peak_source": self.peak_source,
        }


def _share(tflops: float | None, peak: float | None) -> float | None:
    return None if tflops is None or peak is None else tflops / peak
