"""What a run trains, built from its config: the task, its data, and the model on the device.

The one place that knows which models, data sets and tasks go together; the engine and the rest
of the build see only a ``Task``, loaders and an ``nn.Module``. Before any training the model
runs forward on one batch, so a model whose output does not fit the task stops the run with one
line instead of a traceback mid-step; a language model also runs the causal check (a model that
sees later tokens would be trained on its own targets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amp_exp.config import hf
from amp_exp.config.datasets import (
    CustomDatasetConfig,
    ImageDatasetConfig,
    SyntheticTokensConfig,
    dataset_name,
)
from amp_exp.config.models import CustomModelConfig, GPTConfig, HFModelConfig
from amp_exp.config.schema import RunConfig, Strategy, TaskName
from amp_exp.errors import ConfigError, first_line
from amp_exp.runtime.no_trace import leaves_no_trace
from amp_exp.tasks.base import Batch, DataBundle, Task
from amp_exp.tasks.classification import ClassificationTask
from amp_exp.tasks.custom import build_custom_data, build_custom_model
from amp_exp.tasks.gpt import GPT, flops_per_token
from amp_exp.tasks.hf import HFModel, build_hf_model, hf_flops_per_token
from amp_exp.tasks.images import build_data as build_image_data
from amp_exp.tasks.lm import LanguageModelTask
from amp_exp.tasks.metrics import TaskMetrics
from amp_exp.tasks.sampling import Placement
from amp_exp.tasks.tokens import build_synthetic_tokens, build_text
from amp_exp.tasks.vision_models import build_model as build_image_model
from amp_exp.tasks.vision_models import is_convolutional


@dataclass
class Workload:
    task: Task
    data: DataBundle
    # On the device, unwrapped: DDP and torch.compile wrap it later.
    model: nn.Module
    channels_last: bool
    # Training FLOPs per token, where a formula for the model is known (gpt, hf language models).
    flops_per_token: float | None = None


def build_data(cfg: RunConfig, placement: Placement) -> DataBundle:
    dataset = cfg.dataset
    if isinstance(dataset, ImageDatasetConfig):
        return build_image_data(dataset, placement)
    if isinstance(dataset, CustomDatasetConfig):
        return build_custom_data(dataset, cfg.task, placement)
    build = build_synthetic_tokens if isinstance(dataset, SyntheticTokensConfig) else build_text
    return build(dataset, token_seq_len(cfg), placement)


def token_seq_len(cfg: RunConfig) -> int:
    """How many tokens a sequence holds: dataset.seq_len, else the model's own (validate made
    sure one of the two says): a gpt's seq_len, an hf model's positions up to a cap."""
    model = cfg.model
    if cfg.dataset.seq_len:
        return cfg.dataset.seq_len
    return hf.default_seq_len(model) if isinstance(model, HFModelConfig) else model.seq_len


def build_gpt(cfg: GPTConfig, facts: dict[str, Any]) -> GPT:
    if facts["seq_len"] > cfg.seq_len:
        raise ConfigError(
            f"the data's sequences hold {facts['seq_len']} tokens, more than "
            f"model.seq_len={cfg.seq_len} positions"
        )
    return GPT(cfg, cfg.vocab_size or facts["vocab_size"])


def build_model(cfg: RunConfig, facts: dict[str, Any]) -> nn.Module:
    if isinstance(cfg.model, CustomModelConfig):
        return build_custom_model(cfg.model, facts)
    if isinstance(cfg.model, GPTConfig):
        return build_gpt(cfg.model, facts)
    if isinstance(cfg.model, HFModelConfig):
        return build_hf_model(cfg.model, cfg.task, facts)
    return build_image_model(cfg.model, facts["input_shape"], facts["num_classes"])


def check_output_fits(task: Task, model: nn.Module, batch: Batch, cfg: RunConfig) -> None:
    """One forward pass without gradients, in training mode (where torchvision's googlenet
    returns its auxiliary outputs), that leaves no trace (runtime.no_trace)."""
    try:
        with leaves_no_trace(model), torch.no_grad():
            problem = task.output_problem(model, task.to_device(batch))
    except Exception as error:
        problem = f"fails on one batch: {type(error).__name__}: {first_line(str(error))}"
        problem += memory_hint(cfg, error)
    if problem:
        raise ConfigError(
            f"model={cfg.model.name} cannot train on dataset={dataset_name(cfg.dataset)}: {problem}"
        )


# How a forward pass that ran out of memory says so, on CUDA and on the CPU.
MEMORY_MESSAGES = ("out of memory", "tried to allocate", "can't allocate memory")


def memory_hint(cfg: RunConfig, error: Exception) -> str:
    """For a batch that did not fit in memory: the two knobs that shrink it, and their values."""
    if not isinstance(error, MemoryError) and not any(
        words in str(error).lower() for words in MEMORY_MESSAGES
    ):
        return ""
    dataset = cfg.dataset
    if isinstance(dataset, ImageDatasetConfig | CustomDatasetConfig):
        return f"; a smaller dataset.batch_size (now {dataset.batch_size}) fits in less memory"
    return (
        f"; a smaller dataset.seq_len (now {token_seq_len(cfg)}) or dataset.batch_size (now "
        f"{dataset.batch_size}) fits in less memory"
    )


def model_label(cfg: RunConfig) -> str:
    model = cfg.model
    if isinstance(model, HFModelConfig):
        return f"model=hf model.name={model.name}"
    if isinstance(model, CustomModelConfig):
        return f"model._target_={model._target_}"
    return f"model={model.name}"


def check_causal(task: LanguageModelTask, model: nn.Module, batch: Batch, cfg: RunConfig) -> None:
    """The causal check (LanguageModelTask.future_leak), for every language model, before its
    precision prepares it: so in fp32 master weights, without autocast, on the run's device. In
    eval mode, where dropout (which would move every logit) is off; no gradients, no trace."""
    try:
        with leaves_no_trace(model), torch.no_grad():
            model.eval()
            problem = task.future_leak(model, task.to_device(batch))
    except Exception as error:
        raise ConfigError(
            f"{model_label(cfg)} fails in eval mode (the causal check of task=lm) on one batch: "
            f"{type(error).__name__}: {first_line(str(error))}"
        ) from None
    if problem is None:
        return
    if isinstance(cfg.model, HFModelConfig):
        cause = hf.causal_variant(cfg.model)
    else:
        cause = (
            "likely an encoder such as BERT, whose attention spans the whole sequence; a "
            "language model needs a causal mask (scaled_dot_product_attention's is_causal=True)"
        )
    raise ConfigError(f"{model_label(cfg)} fails the causal check of task=lm: {problem}; {cause}")


def make_task(
    cfg: RunConfig, facts: dict[str, Any], device: torch.device, channels_last: bool
) -> Task:
    """The task ``cfg.task`` names, sized by the data's facts."""
    if cfg.task is TaskName.classification:
        return ClassificationTask(device, facts["num_classes"], channels_last)
    return LanguageModelTask(device, facts["seq_len"], facts["vocab_size"])


def declared_metrics(task: TaskName) -> TaskMetrics:
    """What the task ``task`` names will evaluate, before anything is built (a failed run's
    summary holds the same metric keys as a completed one)."""
    return (ClassificationTask if task is TaskName.classification else LanguageModelTask).metrics


def check_trainable(model: nn.Module, cfg: RunConfig) -> None:
    """An optimizer needs parameters that take a gradient (floating point, requires_grad)."""
    parameters = list(model.parameters())
    if any(p.requires_grad for p in parameters):
        return
    found = (
        f"none of its {len(parameters)} parameters requires a gradient (all frozen or integer)"
        if parameters
        else "it has no parameters"
    )
    raise ConfigError(
        f"model={cfg.model.name} has nothing to train: {found}; give it floating-point "
        "parameters with requires_grad=True"
    )


def build_workload(cfg: RunConfig, placement: Placement) -> Workload:
    """The data where ``placement`` says, and the model on the same device."""
    device = placement.device
    data = build_data(cfg, placement)
    facts = data.facts
    model = build_model(cfg, facts).to(device)
    check_trainable(model, cfg)
    channels_last = cfg.trainer.channels_last
    if channels_last is None:
        # FSDP2 shards only contiguous parameters, and channels_last convolution weights are not.
        sharded = cfg.trainer.strategy is Strategy.fsdp2
        channels_last = device.type == "cuda" and is_convolutional(model) and not sharded
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    task = make_task(cfg, facts, device, channels_last)
    batch = next(iter(data.train))
    check_output_fits(task, model, batch, cfg)
    if isinstance(task, LanguageModelTask):
        check_causal(task, model, batch, cfg)
    flops = None
    if isinstance(model, GPT):
        flops = flops_per_token(model, facts["seq_len"])
    elif isinstance(model, HFModel) and cfg.task is TaskName.lm:
        flops = hf_flops_per_token(model, facts["seq_len"])
    return Workload(task, data, model, channels_last, flops)
