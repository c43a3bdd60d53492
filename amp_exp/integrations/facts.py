"""What a recorded run is, as its trainer set it up (``RunFacts``), and the plain values a
trainer's own objects are recorded as."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RunFacts:
    """What a recorded run is, as its trainer set it up."""

    # amp_exp's name of the precision (fp32, bf16, fp16, bf16_true, ...), and how it was set.
    precision: str
    how: str
    seed: int | None
    # classification, lm, or the user's own tasks.metrics.TaskMetrics.
    task: Any
    model_name: str
    # Who trained it: amp_exp.record, transformers, lightning.
    trainer: str
    # The trainer's precision flags as set; they make the precision, not a setting of the run.
    flags: dict[str, Any] = field(default_factory=dict)
    # What of the trainer's configuration changes what it trains (no paths, names or precision
    # flags): a value that differs between runs of a model becomes part of their setting.
    config: dict[str, Any] = field(default_factory=dict)
    # The trainer's whole resolved configuration, as recorded (precision_details).
    resolved: dict[str, Any] = field(default_factory=dict)
    log_every: int = 10
    # Steps left out of the throughput clock; the last of them is audited. None: one log interval.
    warmup_steps: int | None = None
    grad_accum_steps: int = 1
    total_steps: int | None = None
    resume: bool = False


def unwrapped_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a trainer's wrapper (Accelerate's ``AcceleratedOptimizer``
    holds it as ``optimizer``): its step hooks are the ones that fire."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def plain(values: dict[str, Any]) -> dict[str, Any]:
    """The JSON-able scalars of ``values`` (an optimizer's defaults, a trainer's arguments)."""
    return {
        key: list(value) if isinstance(value, tuple) else value
        for key, value in values.items()
        if isinstance(value, (str, int, float, bool, type(None)))
        or (isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value))
    }
