"""Checks a type alone cannot express (ranges, cross-field rules), and the typed ``RunConfig``.

``validate`` turns a composed config into a ``RunConfig`` or raises ``ConfigError`` with one line
that names the key and the valid choices. Nothing here imports torch: a bad value is rejected
before anything heavy loads. What a job needs beyond its config (data on disk, a device, the
environment) is checked in ``config/checks.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from operator import attrgetter
from typing import Any

from omegaconf import DictConfig, OmegaConf

from amp_exp.config.adaptive import COMPILE_AUTO
from amp_exp.config.commands import (
    validate_devices,
    validate_evidence,
    validate_predict,
    validate_sensitivity,
    validate_speed,
)
from amp_exp.config.datasets import (
    TOKEN_DATASETS,
    CustomDatasetConfig,
    DatasetConfig,
    DatasetName,
    ImageDatasetConfig,
    SyntheticTokensConfig,
    TextDatasetConfig,
)
from amp_exp.config.models import (
    CustomModelConfig,
    GPTConfig,
    MLPConfig,
    ModelConfig,
    TimmModelConfig,
    TinyCNNConfig,
    TorchvisionModelConfig,
)
from amp_exp.config.pairing import check_pairing
from amp_exp.config.precisions import validate_precision
from amp_exp.config.schema import (
    FAMILYWISE,
    SCHEMAS,
    WANDB_TAG_MAX_CHARS,
    AdamWConfig,
    OptimizerConfig,
    RunConfig,
    SchedulerConfig,
    Strategy,
    TrainerConfig,
    WandbConfig,
)
from amp_exp.errors import ConfigError, first_line, require

# NumPy seeds its generator with an unsigned 32-bit integer.
SEED_RANGE = range(2**32)
# What W&B refuses in a project name at init, which would cost the run its dashboard entry.
WANDB_PROJECT_MAX_CHARS = 128
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"
_POSITIVE = (
    "dataset.batch_size",
    "trainer.grad_accum_steps",
    "trainer.log_every",
    "precision.growth_interval",
    "wandb.init_timeout",
    "report.wandb_timeout",
)
_POSITIVE_OR_NULL = (
    "dataset.eval_batch_size",
    "trainer.max_steps",
    "trainer.epochs",
    "trainer.eval_batches",
    "precision.clip_grad_norm",
    "wandb.log_every",
    "report.forecast_steps",
)


@functools.cache
def torchvision_model_names() -> tuple[str, ...]:
    """The classification models torchvision can build (imports torchvision: about 1.5 s)."""
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def validate(cfg: DictConfig) -> RunConfig:
    """Turn a composed config into a typed ``RunConfig``, or raise ``ConfigError``."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    require(
        not missing, f"{', '.join(missing)} must be set, e.g. {missing[0] if missing else ''}=..."
    )
    _reject_unknown_keys(cfg)
    run: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    # inf and NaN pass every range check below (or fail it with a misleading message), and an
    # infinite learning rate or loss scale makes every step non-finite: the run would skip them
    # all and report success.
    for key, value in _floats(run):
        require(math.isfinite(value), f"{key}={value} must be a finite number")
    require(
        run.seed in SEED_RANGE, f"seed={run.seed} must lie in [0, 2**32 - 1] (NumPy's seed range)"
    )
    require(
        run.resume is None or bool(run.resume.strip()),
        f"resume={run.resume!r} is empty; use resume=null (start fresh), resume=auto, or the path "
        "of a run directory or checkpoint",
    )
    for key in _POSITIVE:
        value = attrgetter(key)(run)
        require(value > 0, f"{key}={value} must be positive")
    for key in _POSITIVE_OR_NULL:
        value = attrgetter(key)(run)
        require(value is None or value > 0, f"{key}={value} must be positive or null")
    _validate_dataset(run.dataset)
    require(
        run.trainer.max_steps is not None or run.trainer.epochs is not None,
        "set trainer.max_steps or trainer.epochs (both are null, so the run would never end)",
    )
    require(
        run.trainer.eval_every is None or run.trainer.eval_every >= 0,
        "trainer.eval_every must be 0 (only at the end), a positive step interval, or null (never)",
    )
    require(run.trainer.timing_warmup_steps >= 0, "trainer.timing_warmup_steps must be 0 or more")
    every = run.checkpoint.every_steps
    require(every is None or every >= 0, "checkpoint.every_steps must be 0 (at the end), N or null")
    require(run.checkpoint.keep >= 0, "checkpoint.keep must be 0 or more")
    require(run.diagnostics.check_steps >= 0, "diagnostics.check_steps must be 0 or more")
    require(
        run.diagnostics.underflow_every >= 0, "diagnostics.underflow_every must be 0 (off) or more"
    )
    require(
        isinstance(run.trainer.compile, bool) or run.trainer.compile == COMPILE_AUTO,
        f"trainer.compile={run.trainer.compile} must be true, false or {COMPILE_AUTO} (compile "
        "where the precision needs it to be fast: fp8 on CUDA)",
    )
    audit_step = run.diagnostics.audit_step
    require(
        audit_step is None or audit_step >= 1,
        "diagnostics.audit_step must be 1 or more, or null (the first timed step)",
    )
    require(
        run.report.tolerance is None or run.report.tolerance >= 0,
        "report.tolerance must be 0 or more, or null (the task's default)",
    )
    require(
        run.report.familywise in FAMILYWISE,
        f"report.familywise={run.report.familywise}: one of {', '.join(FAMILYWISE)}",
    )
    validate_devices("report.predict", run.report.predict)
    validate_speed(run.speed)
    validate_evidence(run.evidence)
    validate_precision(run.precision, run.trainer)
    validate_sensitivity(run.sensitivity, run.precision, run.trainer)
    validate_predict(run.predict)
    require(
        not (run.trainer.channels_last and run.trainer.strategy is Strategy.fsdp2),
        "trainer.channels_last=true cannot run with trainer.strategy=fsdp2, which shards only "
        "contiguous parameters (channels_last convolution weights are not); leave it null",
    )
    _validate_optimizer(run.optimizer, run.trainer)
    _validate_scheduler(run.scheduler)
    _validate_model(run.model)
    _validate_synthetic_sizes(run)
    run.task = check_pairing(run)
    _validate_wandb(run.wandb, run.trainer)
    return run


def _floats(node: Any, key: str = "") -> Iterator[tuple[str, float]]:
    """Every float in a typed config, with its dotted key."""
    if is_dataclass(node):
        for f in fields(node):
            yield from _floats(getattr(node, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _floats(item, f"{key}[{i}]")
    elif isinstance(node, float):
        yield key, node


def _reject_unknown_keys(cfg: DictConfig) -> None:
    """``+key=value`` and ``+group.key=value`` open a typed node; a key its schema lacks would be
    silently lost."""
    known = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(cfg.keys()) - known)
    require(
        not unknown,
        f"{unknown[0] if unknown else ''} is not a known key or config group; "
        f"valid top-level keys: {', '.join(sorted(known))}",
    )
    for section in [*SCHEMAS, "checkpoint", "diagnostics", "sensitivity", "speed", "predict"]:
        node = cfg[section]
        known = {f.name for f in fields(OmegaConf.get_type(node))}
        unknown = sorted(set(node.keys()) - known)
        require(
            not unknown,
            f"{section}.{unknown[0] if unknown else ''} is not a known key; "
            f"valid keys: {', '.join(sorted(known))}",
        )


def _validate_optimizer(optimizer: OptimizerConfig, trainer: TrainerConfig) -> None:
    require(optimizer.lr > 0, f"optimizer.lr={optimizer.lr} must be positive")
    require(optimizer.weight_decay >= 0, "optimizer.weight_decay must be 0 or more")
    if isinstance(optimizer, AdamWConfig):
        require(
            len(optimizer.betas) == 2 and all(0 <= b < 1 for b in optimizer.betas),
            "optimizer.betas must be two numbers in [0, 1)",
        )
    else:
        require(0 <= optimizer.momentum < 1, "optimizer.momentum must lie in [0, 1)")
        require(
            not optimizer.nesterov or optimizer.momentum > 0,
            "optimizer.nesterov=true needs optimizer.momentum > 0",
        )
        require(
            not (optimizer.fused and trainer.strategy is Strategy.fsdp2),
            "optimizer.fused=true cannot run with trainer.strategy=fsdp2: FSDP2's DTensors have "
            "no fused SGD kernel; leave it null",
        )


def _validate_scheduler(scheduler: SchedulerConfig) -> None:
    require(scheduler.warmup_steps >= 0, "scheduler.warmup_steps must be 0 or more")
    require(0 <= scheduler.min_lr_ratio <= 1, "scheduler.min_lr_ratio must lie in [0, 1]")
    require(0 < scheduler.pct_start < 1, "scheduler.pct_start must lie strictly between 0 and 1")


def _check_positive(section: object, prefix: str, *keys: str) -> None:
    for key in keys:
        value = getattr(section, key)
        require(value > 0, f"{prefix}.{key}={value} must be positive")


def _validate_dataset(dataset: DatasetConfig) -> None:
    if isinstance(dataset, ImageDatasetConfig):
        _check_positive(
            dataset, "dataset", "num_classes", "image_size", "channels", "train_size", "eval_size"
        )
        require(dataset.noise_std >= 0, "dataset.noise_std must be 0 or more")
    if isinstance(dataset, (ImageDatasetConfig, CustomDatasetConfig)):
        require(dataset.num_workers >= 0, "dataset.num_workers must be 0 or more")
    if isinstance(dataset, (ImageDatasetConfig, TextDatasetConfig)):
        require(
            0 < dataset.eval_fraction < 1,
            "dataset.eval_fraction must lie strictly between 0 and 1",
        )
    if isinstance(dataset, TOKEN_DATASETS):
        require(
            dataset.seq_len is None or dataset.seq_len > 0,
            f"dataset.seq_len={dataset.seq_len} must be positive or null",
        )
    if isinstance(dataset, SyntheticTokensConfig):
        _check_positive(dataset, "dataset", "train_size", "eval_size")
        require(dataset.vocab_size >= 2, "dataset.vocab_size must be 2 or more")
        require(
            0 < dataset.branching <= dataset.vocab_size,
            f"dataset.branching={dataset.branching} must lie in [1, dataset.vocab_size]",
        )
    if isinstance(dataset, CustomDatasetConfig):
        require(
            dataset.num_classes is None or dataset.num_classes > 0,
            f"dataset.num_classes={dataset.num_classes} must be positive or null",
        )
        require(
            dataset.vocab_size is None or dataset.vocab_size >= 2,
            f"dataset.vocab_size={dataset.vocab_size} must be 2 or more, or null",
        )
        _check_target("dataset", dataset._target_)


def _check_target(section: str, target: str) -> None:
    """The user's callable must import: checked here, before any job of a sweep starts."""
    # What instantiate itself uses; hydra.utils.get_object would also log a multi-line error.
    from hydra._internal.utils import _locate

    try:
        found = _locate(target)
    except Exception as error:
        cause = error.__cause__ or error
        raise ConfigError(
            f"{section}._target_={target} cannot be imported ({type(cause).__name__}: "
            f"{first_line(str(cause))}); is its package installed or its folder on PYTHONPATH?"
        ) from None
    require(callable(found), f"{section}._target_={target} is not callable")


def _validate_model(model: ModelConfig) -> None:
    if isinstance(model, TinyCNNConfig):
        require(model.width > 0, "model.width must be a positive integer")
    elif isinstance(model, MLPConfig):
        require(model.hidden_dim > 0, "model.hidden_dim must be a positive integer")
        require(model.depth >= 0, "model.depth must be 0 or more")
    elif isinstance(model, GPTConfig):
        _check_positive(model, "model", "n_layer", "n_head", "d_model", "seq_len")
        require(
            model.d_model % model.n_head == 0,
            f"model.d_model={model.d_model} must be a multiple of model.n_head={model.n_head}",
        )
        require(
            model.vocab_size is None or model.vocab_size > 0,
            "model.vocab_size must be positive or null (the dataset's)",
        )
        require(0 <= model.dropout < 1, "model.dropout must lie in [0, 1)")
    elif isinstance(model, TimmModelConfig):
        _validate_timm(model)
    elif isinstance(model, CustomModelConfig):
        _check_target("model", model._target_)
    elif isinstance(model, TorchvisionModelConfig):  # hf models: config/hf.py, from pairing
        names = torchvision_model_names()
        require(
            model.name in names,
            f"model.name={model.name!r} is not a torchvision classification model; "
            f"valid choices: {', '.join(names)}",
        )


def _validate_synthetic_sizes(run: RunConfig) -> None:
    """Synthetic data has its sizes in the config, so a batch or an accumulation window longer
    than an epoch is caught here rather than when the job builds its data (DDP ranks, which
    share the epoch, are checked then)."""
    dataset, accum = run.dataset, run.trainer.grad_accum_steps
    synthetic_images = (
        isinstance(dataset, ImageDatasetConfig) and dataset.name is DatasetName.synthetic
    )
    if not (synthetic_images or isinstance(dataset, SyntheticTokensConfig)):
        return
    require(
        dataset.batch_size <= dataset.train_size,
        f"dataset.batch_size={dataset.batch_size} exceeds dataset.train_size={dataset.train_size}",
    )
    batches = dataset.train_size // dataset.batch_size
    require(
        accum <= batches,
        f"an epoch has {batches} batches (dataset.train_size={dataset.train_size} / "
        f"dataset.batch_size={dataset.batch_size}), fewer than trainer.grad_accum_steps={accum}; "
        "lower it or the batch size",
    )


def _validate_timm(model: TimmModelConfig) -> None:
    try:
        import timm
    except ImportError:
        raise ConfigError("model=timm needs timm: pip install 'amp_exp[timm]'") from None
    require(
        timm.is_model(model.name),
        f"model.name={model.name!r} is not a timm model; timm.list_models() lists them",
    )


def _validate_wandb(wandb: WandbConfig, trainer: TrainerConfig) -> None:
    require(bool(wandb.project.strip()), "wandb.project must not be empty")
    forbidden = sorted(set(WANDB_PROJECT_FORBIDDEN) & set(wandb.project))
    require(
        not forbidden and len(wandb.project) <= WANDB_PROJECT_MAX_CHARS,
        f"wandb.project={wandb.project!r}: W&B project names have at most "
        f"{WANDB_PROJECT_MAX_CHARS} characters and none of {' '.join(WANDB_PROJECT_FORBIDDEN)}",
    )
    require(wandb.finish_timeout >= 0, "wandb.finish_timeout must be 0 (wait for all) or more")
    require(
        wandb.log_every is None or wandb.log_every % trainer.log_every == 0,
        f"wandb.log_every={wandb.log_every} must be a multiple of "
        f"trainer.log_every={trainer.log_every}, the interval at which metrics are read",
    )
    long_tags = [tag for tag in wandb.tags if len(tag) > WANDB_TAG_MAX_CHARS]
    require(
        not long_tags,
        f"wandb.tags: {long_tags[0] if long_tags else ''!r} is longer than "
        f"{WANDB_TAG_MAX_CHARS} characters",
    )
