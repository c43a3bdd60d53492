"""What a run trains, built from its config: the task, its data, and the model on the device.

The one place that knows which models, data sets and tasks go together; the engine and the rest
of the build see only a ``Task``, loaders and an ``nn.Module``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from amp_exp.config.schema import RunConfig, Strategy
from amp_exp.tasks.base import DataBundle, Task
from amp_exp.tasks.classification import ClassificationTask, LossFn
from amp_exp.tasks.images import build_data
from amp_exp.tasks.vision_models import build_model, is_convolutional


@dataclass
class Workload:
    task: Task
    data: DataBundle
    # On the device, unwrapped: DDP and torch.compile wrap it later.
    model: nn.Module
    channels_last: bool


def build_workload(
    cfg: RunConfig,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    loss_fn: LossFn | None = None,
) -> Workload:
    """``loss_fn(outputs, targets)`` replaces the task's training loss (tests inject faults)."""
    data = build_data(cfg.dataset, cfg.seed, device, rank, world_size)
    model = build_model(cfg.model, data.facts["input_shape"], data.facts["num_classes"]).to(device)
    channels_last = cfg.trainer.channels_last
    if channels_last is None:
        # FSDP2 shards only contiguous parameters, and channels_last convolution weights are not.
        sharded = cfg.trainer.strategy is Strategy.fsdp2
        channels_last = device.type == "cuda" and is_convolutional(model) and not sharded
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return Workload(ClassificationTask(device, channels_last, loss_fn), data, model, channels_last)
