"""Step callbacks: what looks at an optimizer step besides the update itself, in one stated order.

The engine runs every step in this sequence (``Engine.train_step``):

    forward + loss -> scale -> backward -> unscale -> clip -> AFTER_CLIP -> step -> update
    -> AFTER_STEP

- ``after_clip`` sees the gradients as the optimizer will use them: unscaled, clipped and reduced
  over the ranks, with what the step found of them (``Gradients``: the norm, and whether the
  device will skip the step); the weights are not updated yet.
- ``after_step`` sees the weights as the next forward will: the update is complete, including its
  stochastic rounding to bf16 (part of the update, training/stochastic_rounding.py), or the step
  was skipped on the device.

Within a phase, callbacks run in ``ORDER``, whatever order they were added in, so no correctness
depends on the order in which a run builds its parts. A callback runs on every step, skipped ones
included: the host does not learn of a skip until the next log step (training/skips.py).
"""

from __future__ import annotations

from typing import ClassVar

from amp_exp.training.precisions.base import Gradients

# Each callback's ``name``, in the order the callbacks run within each phase. The precision
# audit goes first: it records what the step computed before anything else reads or changes it.
# The diagnostics read the weights only after the update, rounding included, has put them in
# place: a stale-weight check of unrounded fp32 stand-ins would count every weight as moved.
# The long-run signals (training/signals.py) only read, so they go last.
ORDER = ("audit", "diagnostics", "signals")


class StepCallback:
    """A part of a run that examines steps; override the phases it needs."""

    name: ClassVar[str]

    def after_clip(self, step: int, gradients: Gradients) -> None:
        """The gradients of optimizer step ``step`` (1-based) are final; nothing is updated."""

    def after_step(self, step: int) -> None:
        """Optimizer step ``step`` has updated the weights, or was skipped."""


class StepCallbacks:
    """The engine's callbacks, kept in ``ORDER``."""

    def __init__(self) -> None:
        self._callbacks: list[StepCallback] = []

    def add(self, callback: StepCallback) -> None:
        if callback.name not in ORDER:
            raise ValueError(f"step callback {callback.name!r} has no place in ORDER: {ORDER}")
        self._callbacks.append(callback)
        self._callbacks.sort(key=lambda added: ORDER.index(added.name))

    @property
    def names(self) -> list[str]:
        return [callback.name for callback in self._callbacks]

    def after_clip(self, step: int, gradients: Gradients) -> None:
        for callback in self._callbacks:
            callback.after_clip(step, gradients)

    def after_step(self, step: int) -> None:
        for callback in self._callbacks:
            callback.after_step(step)
