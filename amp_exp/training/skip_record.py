"""What the device records of skipped steps between two reads, so no step reads the device.

A step whose gradients are not finite is skipped on the device: a fused optimizer takes the
``found_inf`` flag into its kernel, as it does from a GradScaler. The host learns of it only
when it reads this record, at a log step (or to decide on a checkpoint): one host read for the
whole interval. Until then the record keeps, on the device, how many steps were skipped, the
runs of consecutive skips, and for the first skip of the interval its step, whether its loss was
finite and which parameters had non-finite gradients (their gradients are long gone by the read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from amp_exp.runtime.distributed import Distributed

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
        self,
        step: int,
        found_inf: torch.Tensor,
        loss: torch.Tensor,
        nonfinite: torch.Tensor,
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
        self._start_interval()
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

    def _start_interval(self) -> None:
        record = self.record
        record[CARRIED] = record[RUN]
        record[LONGEST] = record[RUN]
        record[COUNT] = 0
        record[FIRST_STEP] = -1
        record[FIRST_LOSS_NONFINITE] = 0
        record[SLOTS:] = 0

    def state_dict(self) -> dict[str, Any]:
        """The interval not yet read, so that a resumed run reads what an uninterrupted one does."""
        return {"record": self.record.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.record.copy_(state["record"])
