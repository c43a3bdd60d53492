"""The steps between two log steps of a recorded run: the loss summed on the device, the loss
scale's record (the engine's ``ScaleRecord``), and the steps the scaler skipped, counted on the
host (the optimizer step hook did not fire for them), handed to the engine's ``SkipMonitor`` as
the ``SkippedSteps`` its rule reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from amp_exp.training.loop import Progress
from amp_exp.training.skips import ScaleRecord, SkippedSteps


@dataclass
class Interval:
    """The steps since the last log step: the loss summed on the device, the loss scale, the
    skipped steps."""

    carried_run: int = 0
    steps: int = 0
    losses: int = 0
    loss_sum: Any = 0.0
    skipped: int = 0
    first_skipped: int = 0
    first_skipped_loss: Any = None
    longest_run: int = 0
    scale: ScaleRecord = field(default_factory=ScaleRecord)

    def add(self, progress: Progress, loss: Any, skipped: bool, scaler: Any = None) -> None:
        """One optimizer step: its loss, whether the scaler skipped it; the scale it left."""
        self.steps += 1
        if scaler is not None:
            self.scale.add(scaler)
        if self.steps == 1 and not skipped:
            self.carried_run = 0  # the run of skips before the interval ended with it
        if loss is not None:  # a trainer that hands no loss over (a custom compute_loss)
            self.losses += 1
            self.loss_sum = self.loss_sum + (
                loss.detach().float() if torch.is_tensor(loss) else loss
            )
        if not skipped:
            progress.consecutive_skips = 0
            return
        progress.skipped_steps += 1
        progress.consecutive_skips += 1
        self.longest_run = max(self.longest_run, progress.consecutive_skips)
        if not self.skipped:
            self.first_skipped = progress.step
            self.first_skipped_loss = loss.detach() if torch.is_tensor(loss) else loss
        self.skipped += 1

    def skipped_steps(self, progress: Progress) -> SkippedSteps:
        loss = self.first_skipped_loss
        return SkippedSteps(
            count=self.skipped,
            first_step=self.first_skipped,
            loss_finite=bool(math.isfinite(float(loss))) if loss is not None else True,
            nonfinite=[],
            run=progress.consecutive_skips,
            longest_run=self.longest_run,
            carried_run=min(self.carried_run, self.longest_run),
        )
