"""Optimizer and LR scheduler builders."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from importlib.util import find_spec

import torch
from torch import nn

from amp_exp.config.schema import (
    AdamWConfig,
    OptimizerConfig,
    SchedulerConfig,
    SchedulerName,
    SGDConfig,
)
from amp_exp.training.stochastic_rounding import StochasticRoundingStep

log = logging.getLogger("amp_exp")


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay only weight matrices and kernels: biases and norm scales (all 1-D) are exempt."""
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decay if parameter.ndim > 1 else no_decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    cfg: OptimizerConfig,
    model: nn.Module,
    device: torch.device,
    stochastic_rounding: bool = False,
    sharded: bool = False,
) -> tuple[torch.optim.Optimizer, StochasticRoundingStep | None]:
    """The optimizer, and the step that must drive it to round its updates to bf16
    stochastically (``stochastic_rounding``: the model is bf16, precision=bf16_true) when its
    own kernels do not. ``sharded``: FSDP2 has replaced the parameters with DTensor shards."""
    groups = parameter_groups(model, cfg.weight_decay)
    is_adamw = isinstance(cfg, AdamWConfig)
    # torchao's AdamW rounds stochastically inside one compiled kernel per parameter, with no
    # fp32 copy of the model. It compiles each parameter shape on first use: seconds on a GPU,
    # but 13-100 s for a small MLP on a 2-core CPU, so the CPU uses StochasticRoundingStep.
    if stochastic_rounding and is_adamw and device.type == "cuda" and find_spec("torchao"):
        from torchao.optim import _AdamW

        log.info("bf16 stochastic rounding: torchao's AdamW (compiles on its first step)")
        optimizer = _AdamW(
            groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, bf16_stochastic_round=True
        )
        return optimizer, None
    # Fused kernels on CUDA: one launch for the whole update, and a step with non-finite
    # gradients skipped inside it (``found_inf``), so the host never has to read whether to
    # step. FSDP2's DTensors have a fused AdamW but no fused SGD.
    fused = cfg.fused
    if fused is None:
        fused = device.type == "cuda" and not (sharded and isinstance(cfg, SGDConfig))
    common = {"lr": cfg.lr, "fused": fused, "foreach": None if fused else True}
    if is_adamw:
        optimizer = torch.optim.AdamW(groups, betas=tuple(cfg.betas), eps=cfg.eps, **common)
    else:
        optimizer = torch.optim.SGD(groups, momentum=cfg.momentum, nesterov=cfg.nesterov, **common)
    if fused and not is_adamw and cfg.momentum:
        # torch's fused SGD creates its momentum buffers with torch.empty on the first step and
        # leaves them so when that step is skipped (found_inf), then reads them as initialized.
        # Zeros make the first applied step's buffer exactly its gradient, as a fresh one is.
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer, StochasticRoundingStep() if stochastic_rounding else None


@dataclass
class CosineWithWarmup:
    """The cosine schedule's factor at a step: a linear warm-up, then a cosine to
    ``min_lr_ratio`` at ``total_steps``, held there after. An object, not a closure, so that
    LambdaLR keeps its fields in the checkpoint: a resumed run keeps the horizon it started with
    whatever trainer.max_steps says now (results/resume.py)."""

    total_steps: int
    warmup_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine


class HeldOneCycleLR(torch.optim.lr_scheduler.OneCycleLR):
    """OneCycleLR, whose checkpointed state keeps its horizon, holding its last step's rate
    past it (a resumed run that trains longer), where torch's raises."""

    def get_lr(self) -> list[float]:
        if self.last_epoch < self.total_steps:
            return super().get_lr()
        step, self.last_epoch = self.last_epoch, self.total_steps - 1
        try:
            return super().get_lr()
        finally:
            self.last_epoch = step


def build_scheduler(
    cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A per-optimizer-step schedule over ``total_steps``; None for a constant LR."""
    if cfg.name is SchedulerName.none:
        return None
    if cfg.name is SchedulerName.cosine:
        warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, CosineWithWarmup(total_steps, warmup, cfg.min_lr_ratio)
        )
    # float(): torchao's optimizers keep the learning rate in a tensor.
    max_lrs = [float(group["lr"]) for group in optimizer.param_groups]
    return HeldOneCycleLR(
        optimizer, max_lr=max_lrs, total_steps=max(total_steps, 2), pct_start=cfg.pct_start
    )
