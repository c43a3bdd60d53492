"""Optimizer and LR scheduler builders."""

from __future__ import annotations

import logging
import math
from importlib.util import find_spec

import torch
from torch import nn

from amp_exp.config.schema import (
    AdamWConfig,
    OptimizerConfig,
    Precision,
    SchedulerConfig,
    SchedulerName,
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


def use_fused_adamw(cfg: AdamWConfig, device: torch.device, precision: Precision) -> bool:
    if cfg.fused is not None:
        return cfg.fused
    # Under fp16 a fused kernel hides a skipped step inside itself; the host-side skip check of
    # the non-fused path is what keeps the LR schedule from advancing on skipped steps.
    return device.type == "cuda" and precision is not Precision.fp16


def torchao_adamw_fits(cfg: OptimizerConfig, device: torch.device) -> bool:
    """torchao's AdamW rounds stochastically inside one compiled kernel per parameter, with no
    fp32 copy of the whole model. It compiles each parameter shape on first use: seconds on a
    GPU, but 13-100 s for a small MLP on a 2-core CPU, so the CPU uses StochasticRoundingStep."""
    on_gpu = device.type == "cuda"
    return isinstance(cfg, AdamWConfig) and on_gpu and find_spec("torchao") is not None


def build_optimizer(
    cfg: OptimizerConfig,
    model: nn.Module,
    device: torch.device,
    precision: Precision,
    stochastic_rounding: bool = False,
) -> torch.optim.Optimizer:
    """``stochastic_rounding``: the model is bf16 (precision=bf16_true) and each update is
    rounded to it stochastically."""
    groups = parameter_groups(model, cfg.weight_decay)
    if stochastic_rounding and torchao_adamw_fits(cfg, device):
        from torchao.optim import _AdamW

        log.info("bf16 stochastic rounding: torchao's AdamW (compiles on its first step)")
        return _AdamW(
            groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, bf16_stochastic_round=True
        )
    optimizer = _build_torch_optimizer(cfg, groups, device, precision)
    if stochastic_rounding:
        StochasticRoundingStep(optimizer)
    return optimizer


def _build_torch_optimizer(
    cfg: OptimizerConfig, groups: list[dict], device: torch.device, precision: Precision
) -> torch.optim.Optimizer:
    if isinstance(cfg, AdamWConfig):
        fused = use_fused_adamw(cfg, device, precision)
        return torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            fused=fused or None,
            foreach=None if fused else True,
        )
    return torch.optim.SGD(
        groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, foreach=True
    )


def cosine_with_warmup(total_steps: int, warmup_steps: int, min_lr_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(
    cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A per-optimizer-step schedule over ``total_steps``; None for a constant LR."""
    if cfg.name is SchedulerName.none:
        return None
    if cfg.name is SchedulerName.cosine:
        warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, cosine_with_warmup(total_steps, warmup, cfg.min_lr_ratio)
        )
    # float(): torchao's optimizers keep the learning rate in a tensor.
    max_lrs = [float(group["lr"]) for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=max_lrs, total_steps=max(total_steps, 2), pct_start=cfg.pct_start
    )
