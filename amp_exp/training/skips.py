"""Skipped steps and the loss scale: what the device records of them between two reads, and what
to do when a step's gradients are not finite.

A step whose gradients are not finite is skipped on the device: a fused optimizer takes the
``found_inf`` flag into its kernel, as it does from a GradScaler. The host learns of it only
when it reads the ``SkipRecord``, at a log step (or to decide on a checkpoint): one host read for
the whole interval. Until then the record keeps, on the device, how many steps were skipped, the
runs of consecutive skips, and for the first skip of the interval its step, whether its loss was
finite and which parameters had non-finite gradients (their gradients are long gone by the read).

The ``SkipMonitor`` judges what the record says at the read, where the steps skipped meanwhile
have left the weights alone. One rule covers every precision: ``max_consecutive_skips`` skipped
steps in a row stop the run with a diagnosis. fp16 also stops once its loss scale falls below
``min_scale``; fp32 and bf16 have no scaler, so ``on_nonfinite`` decides whether one bad step
stops the run.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from amp_exp.config.schema import NonFiniteAction, PrecisionConfig
from amp_exp.errors import NumericalFault
from amp_exp.runtime.distributed import Distributed
from amp_exp.training.loop import Progress

log = logging.getLogger("amp_exp")

# The slots of the record, then one flag per parameter.
COUNT, RUN, LONGEST, CARRIED, FIRST_STEP, FIRST_LOSS_NONFINITE = range(6)
SLOTS = 6


@dataclass(frozen=True)
class SkippedSteps:
    """The skipped steps since the last read, as the host sees them."""

    count: int
    # The first of them, its loss, and the parameters whose gradients were not finite then.
    first_step: int
    loss_finite: bool
    nonfinite: list[str]
    # Consecutive skips: the run still going at the read (0: the last step was applied), the
    # longest run that ended or went on in the interval, and the run carried in from before it.
    run: int
    longest_run: int
    carried_run: int


class SkipRecord:
    """One float64 tensor on the device (exact counts and step numbers): counters, then a
    non-finite flag per parameter.

    ``add`` is a handful of device ops per step and never reads the device; ``read`` reads it
    once and starts a new interval. Under torchrun every rank adds the same flags (the gradient
    norm the skip depends on is the global one), its own loss and its own parameters' shards;
    ``read`` takes the MAX over the ranks, so a loss or a shard that was not finite on one rank
    counts on all.
    """

    def __init__(self, names: list[str], device: torch.device) -> None:
        self.names = names
        self.record = torch.zeros(SLOTS + len(names), device=device, dtype=torch.float64)
        self.record[FIRST_STEP] = -1

    def add(
        self, step: int, found_inf: torch.Tensor, loss: torch.Tensor, nonfinite: torch.Tensor
    ) -> None:
        """Record optimizer step ``step``: ``found_inf`` is 1.0 if it was skipped, ``loss`` its
        loss and ``nonfinite`` one flag per parameter (all on the device)."""
        record = self.record
        skipped = found_inf.reshape(()).to(record.dtype)
        first = (skipped > 0) & (record[FIRST_STEP] < 0)
        record[COUNT] += skipped
        record[RUN] = (record[RUN] + 1) * skipped
        record[LONGEST] = torch.maximum(record[LONGEST], record[RUN])
        record[FIRST_STEP] = torch.where(first, step, record[FIRST_STEP])
        loss_nonfinite = (~torch.isfinite(loss)).to(record.dtype)
        record[FIRST_LOSS_NONFINITE] = torch.where(
            first, loss_nonfinite, record[FIRST_LOSS_NONFINITE]
        )
        record[SLOTS:] = torch.where(first, nonfinite.to(record.dtype), record[SLOTS:])

    def read(self, distributed: Distributed | None) -> SkippedSteps:
        """The skipped steps since the last read (``count`` 0: none); one host read."""
        record = self.record if distributed is None else distributed.maximum(self.record)
        values = record.tolist()
        # A new interval: the run of skips going on carries into it.
        record = self.record
        record[CARRIED] = record[LONGEST] = record[RUN]
        record[COUNT] = record[FIRST_LOSS_NONFINITE] = 0
        record[FIRST_STEP] = -1
        record[SLOTS:] = 0
        flags = values[SLOTS:]
        return SkippedSteps(
            count=int(values[COUNT]),
            first_step=int(values[FIRST_STEP]),
            loss_finite=not values[FIRST_LOSS_NONFINITE],
            nonfinite=[name for name, flag in zip(self.names, flags, strict=True) if flag],
            run=int(values[RUN]),
            longest_run=int(values[LONGEST]),
            carried_run=int(values[CARRIED]),
        )

    def current_run(self) -> int:
        """The run of consecutive skips going on now; reads the device."""
        return int(self.record[RUN].item())

    def state_dict(self) -> dict[str, Any]:
        """The interval not yet read, so that a resumed run reads what an uninterrupted one does."""
        return {"record": self.record.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.record.copy_(state["record"])


class ScaleRecord:
    """fp16's loss scale over the steps since the last read: the sum of its log2, on the device.

    The scale a log step reads is one sample of a staircase that the GradScaler moves a factor at
    a time (halved at an overflow, doubled after ``growth_interval`` finite steps), and it can
    flip a level from one log step to the next: a trend fitted to such samples is mostly their
    noise. The geometric mean over every step of the interval is the level the scale held, which
    the long-run forecast fits (docs/forecast.md). ``add`` is one device op a step, ``read`` one
    host read.
    """

    def __init__(self) -> None:
        self.log2_sum: torch.Tensor | None = None
        self.steps = 0

    def add(self, scaler: torch.amp.GradScaler) -> None:
        """Take in the scale a step left."""
        # The device tensor itself, without the host read get_scale() makes (None until the
        # scaler's first scale()).
        scale = scaler._get_scale_async()
        if scale is None:
            return
        log2 = torch.log2(scale.reshape(()).double())
        self.log2_sum = log2 if self.log2_sum is None else self.log2_sum + log2
        self.steps += 1

    def read(self, scaler: torch.amp.GradScaler) -> tuple[float, float | None]:
        """The scale now and its geometric mean since the last read (None: no step), in one host
        read; starts anew."""
        if self.log2_sum is None:
            return float(scaler.get_scale()), None
        now = scaler._get_scale_async().reshape(()).double()
        now_value, log2_sum = torch.stack([now, self.log2_sum]).tolist()
        mean = 2.0 ** (log2_sum / self.steps)
        self.log2_sum, self.steps = None, 0
        return now_value, mean

    def state_dict(self) -> dict[str, Any]:
        """The interval not yet read, so that a resumed run logs what an uninterrupted one does."""
        total = None if self.log2_sum is None else self.log2_sum.item()
        return {"log2_sum": total, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        total = state["log2_sum"]
        self.steps = state["steps"]
        self.log2_sum = None if total is None else torch.tensor(total, device=device).double()


@dataclass
class SkipMonitor:
    """Limits on skipped steps, and the forensics kept for the message when a run must stop."""

    on_nonfinite: NonFiniteAction = NonFiniteAction.skip
    max_consecutive_skips: int = 50
    min_scale: float = 1.0
    # Whether a checkpoint exists to fall back on; the stop message says so only when it does.
    checkpointing: bool = False
    first_nonfinite: list[str] = field(default_factory=list)
    # Whether the loss was finite at the first step of the current run of skipped steps.
    first_loss_finite: bool = True
    scale_history: deque = field(default_factory=lambda: deque(maxlen=8))

    @classmethod
    def from_config(
        cls, precision: PrecisionConfig, on_nonfinite: NonFiniteAction, checkpointing: bool
    ) -> SkipMonitor:
        return cls(
            on_nonfinite, precision.max_consecutive_skips, precision.min_scale, checkpointing
        )

    def _kept(self) -> str:
        return "; the last good checkpoint is kept" if self.checkpointing else ""

    def on_skipped_steps(
        self, progress: Progress, precision: str, scale: float | None, skipped: SkippedSteps
    ) -> None:
        """Record the steps the device skipped since the last read (``progress`` already counts
        them); raise when training is stuck."""
        step = skipped.first_step
        if not skipped.carried_run:
            # A run of skips began in this interval: its first step names the culprits.
            self.first_nonfinite, self.first_loss_finite = skipped.nonfinite, skipped.loss_finite
        if progress.first_overflow is None:
            progress.first_overflow = {
                "step": step,
                "loss_finite": skipped.loss_finite,
                "parameters": skipped.nonfinite[:10],
                "nonfinite_parameter_count": len(skipped.nonfinite),
            }
            log.warning(
                "first non-finite gradients at step %d (loss %s): %s",
                step,
                "finite" if skipped.loss_finite else "non-finite",
                ", ".join(skipped.nonfinite[:10]) or "none found",
            )
        if scale is not None:
            # The lowest scale fp16 backed off to after an overflow: a scale the run overflowed
            # at lies above it, so no init_scale suggested for this run may (diagnostics).
            lowest = progress.first_overflow.get("backed_off_to", scale)
            progress.first_overflow["backed_off_to"] = min(lowest, scale)
        layer = self.first_nonfinite[0] if self.first_nonfinite else "unknown"
        too_many = skipped.longest_run >= self.max_consecutive_skips
        advice = f"Try a lower optimizer.lr or precision.clip_grad_norm=1.0{self._kept()}"
        if scale is None:
            if self.on_nonfinite is NonFiniteAction.stop:
                raise NumericalFault(
                    f"non-finite gradients at step {step} in {precision} (first in {layer}), and "
                    f"trainer.on_nonfinite=stop. {advice}"
                )
            if too_many:
                # Without a scaler nothing will make the next step finite: a run that skips
                # every step would otherwise "complete" having trained nothing.
                raise NumericalFault(
                    f"training stalled by step {progress.step} in {precision}: "
                    f"{skipped.longest_run} consecutive skipped steps "
                    "(precision.max_consecutive_skips), the gradients non-finite every time, "
                    f"first in {layer}. {advice}"
                )
            return
        self.scale_history.append(f"{progress.step}:{scale:g}")
        if too_many or scale < self.min_scale:
            reason = f"{skipped.longest_run} consecutive skipped steps"
            if not too_many:
                reason = f"loss scale {scale:g} fell below precision.min_scale"
            raise NumericalFault(
                f"fp16 loss scaling collapsed by step {progress.step}: {reason}. Scale history "
                f"(step:scale): {', '.join(self.scale_history)}. {self._where()}. Try a lower "
                "precision.init_scale, precision=bf16, precision.clip_grad_norm=1.0, or keeping "
                f"modules in fp32 (precision.keep_fp32){self._kept()}"
            )

    def _where(self) -> str:
        """Where the overflow began, as far as the gradients of its first skipped step say."""
        if not self.first_nonfinite:
            return "No gradient was non-finite on the device's reading"
        if not self.first_loss_finite:
            return (
                "The loss itself was non-finite, so the forward pass (or the loss) overflowed "
                f"and every gradient with it ({len(self.first_nonfinite)} parameters, first "
                f"{self.first_nonfinite[0]}): the gradients cannot say where"
            )
        suspects = suspect_modules(self.first_nonfinite)
        return (
            f"The loss was finite and the backward overflowed: most suspect {', '.join(suspects)} "
            "(the last modules, in definition order, whose gradients went non-finite: the "
            "backward reaches them first)"
        )


def suspect_modules(parameters: list[str], count: int = 3) -> list[str]:
    """The modules owning ``parameters`` (names in definition order), the last ones first."""
    owners = dict.fromkeys(name.rpartition(".")[0] or "(the model itself)" for name in parameters)
    return list(reversed(owners))[:count]
