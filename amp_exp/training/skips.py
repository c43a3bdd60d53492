"""The skip monitor: what to do when a step's gradients are not finite.

A skipped step is examined while its gradients still exist (a rare event, so reading the device
then costs nothing in the hot loop). One rule covers every precision: ``max_consecutive_skips``
skipped steps in a row stop the run with a diagnosis. fp16 also stops once its loss scale falls
below ``min_scale``; fp32 and bf16 have no scaler, so ``on_nonfinite`` decides whether one bad step
stops the run at once.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from amp_exp.config.schema import NonFiniteAction, PrecisionConfig
from amp_exp.errors import NumericalFault
from amp_exp.runtime.fsdp import whole
from amp_exp.training.loop import Progress

log = logging.getLogger("amp_exp")


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

    def on_skipped_step(
        self,
        progress: Progress,
        precision: str,
        scale: float | None,
        nonfinite_parameters: Callable[[], list[str]],
        loss_finite: Callable[[], bool],
    ) -> None:
        """Record a skipped step (``progress`` already counts it); raise when training is stuck."""
        step = progress.step
        if progress.consecutive_skips == 1:
            self.first_nonfinite = nonfinite_parameters()
            self.first_loss_finite = loss_finite()
        if progress.first_overflow is None:
            progress.first_overflow = {
                "step": step,
                "loss_finite": self.first_loss_finite,
                "parameters": self.first_nonfinite[:10],
                "nonfinite_parameter_count": len(self.first_nonfinite),
            }
            log.warning(
                "first non-finite gradients at step %d (loss %s): %s",
                step,
                "finite" if progress.first_overflow["loss_finite"] else "non-finite",
                ", ".join(self.first_nonfinite[:10]) or "none found",
            )
        layer = self.first_nonfinite[0] if self.first_nonfinite else "unknown"
        too_many = progress.consecutive_skips >= self.max_consecutive_skips
        if scale is None:
            if self.on_nonfinite is NonFiniteAction.stop:
                raise NumericalFault(
                    f"non-finite gradients at step {step} in {precision} (first in {layer}), and "
                    "trainer.on_nonfinite=stop. Try a lower optimizer.lr or "
                    f"precision.clip_grad_norm=1.0{self._kept()}"
                )
            if too_many:
                # Without a scaler nothing will make the next step finite: a run that skips
                # every step would otherwise "complete" having trained nothing.
                raise NumericalFault(
                    f"training stalled at step {step} in {precision}: "
                    f"{progress.consecutive_skips} consecutive skipped steps "
                    "(precision.max_consecutive_skips), the gradients non-finite every time, "
                    f"first in {layer}. Try a lower optimizer.lr or "
                    f"precision.clip_grad_norm=1.0{self._kept()}"
                )
            return
        self.scale_history.append(f"{step}:{scale:g}")
        if too_many or scale < self.min_scale:
            reason = (
                f"{progress.consecutive_skips} consecutive skipped steps"
                if too_many
                else f"loss scale {scale:g} fell below precision.min_scale"
            )
            raise NumericalFault(
                f"fp16 loss scaling collapsed at step {step}: {reason}. Scale history "
                f"(step:scale): {', '.join(self.scale_history)}. {self._where()}. Try a lower "
                "precision.init_scale, precision=bf16, precision.clip_grad_norm=1.0, or keeping "
                f"modules in fp32 (precision.keep_fp32){self._kept()}"
            )

    def _where(self) -> str:
        """Where the overflow began, as far as the gradients of its first skipped step say."""
        if not self.first_nonfinite:
            return "No gradient was non-finite on the host's reading"
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


def nonfinite_names(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> list[str]:
    """Names of parameters whose current gradients hold inf or NaN (reads the device).

    An FSDP2 gradient is gathered whole first, so every rank names the parameter whichever
    rank's shard holds the inf: all ranks skip together and all must call this.
    """
    return [
        name
        for name, p in named_parameters
        if p.grad is not None and not torch.isfinite(whole(p.grad)).all()
    ]
