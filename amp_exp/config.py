"""Typed config schemas for every config group, registered in Hydra's ConfigStore.

Each YAML file under ``conf/`` lists its schema first in its defaults list, so Hydra type-checks
the YAML and every command-line override against these dataclasses. ``validate`` then applies the
checks that a type alone cannot express (ranges and cross-field rules) and returns the typed
``RunConfig``. Nothing here imports torch: a bad value is rejected before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from importlib.util import find_spec
from operator import attrgetter
from pathlib import Path
from typing import Any, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

SCHEMA_GROUP = "schema"
# Optional: hydra/launcher=slurm and submitit_* (amp_exp.launchers).
SUBMITIT_PLUGIN = "hydra_plugins.hydra_submitit_launcher"


class ConfigError(ValueError):
    """A config value that cannot run; its message is one line that says what to change."""


class Precision(str, Enum):
    auto = "auto"
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


class DeviceChoice(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DatasetName(str, Enum):
    synthetic = "synthetic"
    cifar10 = "cifar10"
    cifar100 = "cifar100"
    mnist = "mnist"
    fashion_mnist = "fashion_mnist"
    image_folder = "image_folder"


class SchedulerName(str, Enum):
    none = "none"
    cosine = "cosine"
    onecycle = "onecycle"


class NonFiniteAction(str, Enum):
    skip = "skip"
    stop = "stop"
    off = "off"


class WandbMode(str, Enum):
    auto = "auto"
    online = "online"
    offline = "offline"
    disabled = "disabled"


class CompileMode(str, Enum):
    default = "default"
    reduce_overhead = "reduce-overhead"
    max_autotune = "max-autotune"
    max_autotune_no_cudagraphs = "max-autotune-no-cudagraphs"


# --- model -------------------------------------------------------------------------------------


@dataclass
class TinyCNNConfig:
    """Two 3x3 convolutions, global average pooling and a linear head."""

    name: str = "tiny_cnn"
    width: int = 32
    # L2-normalize the pooled features with a custom autograd function that runs in fp32.
    normalize_features: bool = False


@dataclass
class MLPConfig:
    """Flattened input, ``depth`` hidden layers of ``hidden_dim`` units."""

    name: str = "mlp"
    hidden_dim: int = 256
    depth: int = 2


@dataclass
class TorchvisionModelConfig:
    """Any torchvision classification model by name, built with random weights."""

    name: str = MISSING


ModelConfig = Union[TinyCNNConfig, MLPConfig, TorchvisionModelConfig]

# --- dataset -----------------------------------------------------------------------------------


@dataclass
class DatasetConfig:
    name: DatasetName = DatasetName.synthetic
    # Torchvision datasets and image_folder read from here (relative to the launch directory).
    root: str = "data"
    download: bool = False
    batch_size: int = 128
    # null = the training batch size.
    eval_batch_size: int | None = None
    num_workers: int = 2
    # Synthetic data: how many images of what shape, and how many classes.
    num_classes: int = 10
    image_size: int = 32
    channels: int = 3
    train_size: int = 4096
    eval_size: int = 1024
    # Synthetic images are a smooth class prototype plus this much Gaussian noise; higher is harder.
    noise_std: float = 4.0
    # image_folder without train/ and val/ sub-directories holds out this fraction for eval.
    eval_fraction: float = 0.1


# --- optimizer and scheduler --------------------------------------------------------------------


@dataclass
class SGDConfig:
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4


@dataclass
class AdamWConfig:
    name: str = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.05
    # null = fused kernels on CUDA, except under fp16 (see optim.build_optimizer).
    fused: bool | None = None


OptimizerConfig = Union[SGDConfig, AdamWConfig]


@dataclass
class SchedulerConfig:
    name: SchedulerName = SchedulerName.cosine
    # Linear warm-up for cosine; onecycle uses pct_start instead.
    warmup_steps: int = 20
    # The cosine schedule ends at lr * min_lr_ratio.
    min_lr_ratio: float = 0.0
    pct_start: float = 0.25


# --- precision and trainer ---------------------------------------------------------------------


@dataclass
class PrecisionConfig:
    # auto: fp16 with loss scaling on CUDA GPUs with Tensor Cores, fp32 elsewhere.
    name: Precision = Precision.auto
    # GradScaler knobs; they only take effect when fp16 runs.
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    # Max total gradient norm after unscaling; null = no clipping.
    clip_grad_norm: float | None = None
    # fp16 stops with a diagnosis after this many skipped steps in a row, or when the loss scale
    # falls below min_scale (below 1 the true gradients themselves overflow fp16).
    max_consecutive_skips: int = 50
    min_scale: float = 1.0


@dataclass
class TrainerConfig:
    device: DeviceChoice = DeviceChoice.auto
    # Training stops at whichever of max_steps and epochs comes first; null = no limit.
    max_steps: int | None = 300
    epochs: int | None = None
    grad_accum_steps: int = 1
    log_every: int = 25
    # 0 = evaluate only at the end; null = never.
    eval_every: int | None = 0
    # null = the whole eval split.
    eval_batches: int | None = None
    # Optimizer steps left out of throughput: allocator warm-up, cudnn autotuning, compilation.
    timing_warmup_steps: int = 5
    # null = on for convolutional models on CUDA.
    channels_last: bool | None = None
    compile: bool = False
    compile_mode: CompileMode = CompileMode.default
    deterministic: bool = False
    # Let fp32 matmuls and convolutions use TF32 Tensor Cores on CUDA (Ampere and newer).
    tf32: bool = True
    # fp32/bf16 have no scaler to skip a step with inf/NaN gradients: skip it here, stop the
    # run, or (off) apply it. skip and stop read one flag from the device per step.
    on_nonfinite: NonFiniteAction = NonFiniteAction.skip


@dataclass
class CheckpointConfig:
    # Write checkpoints/last.pt every this many steps; 0 = only at the end, null = never.
    every_steps: int | None = 0
    # Numbered step checkpoints kept besides last.pt.
    keep: int = 0


@dataclass
class DiagnosticsConfig:
    # Check master weights and unscaled gradients on the first check_steps optimizer steps.
    checks: bool = True
    check_steps: int = 3
    # Measure how fp16 would treat the gradients every this many steps; 0 = off.
    underflow_every: int = 100


# --- Weights & Biases ----------------------------------------------------------------------------

# W&B rejects longer tags at init, which would cost the run its dashboard entry.
WANDB_TAG_MAX_CHARS = 64


@dataclass
class WandbConfig:
    # auto: online when an API key is configured, else offline. While this is auto, WANDB_MODE
    # in the environment decides; an explicit value here wins over it.
    mode: WandbMode = WandbMode.auto
    project: str = "amp_exp"
    # null = the API key's default entity.
    entity: str | None = None
    # null = the sweep in a multirun; no group for a single run.
    group: str | None = None
    # null = model-precision-s<seed>, plus this job's values of the swept keys in a multirun.
    name: str | None = None
    # Added to the automatic tags: model, precision, dataset and device.
    tags: list[str] = field(default_factory=list)
    # null = every trainer.log_every row; else a multiple of it, as W&B only sees rows the
    # trainer already read from the device.
    log_every: int | None = None
    # Seconds to wait for the W&B server before the run logs offline instead. With W&B's import
    # and the offline start, the fallback then comes within about 20 s even on a busy machine.
    init_timeout: float = 15.0
    # Seconds finish() may spend uploading; what is left stays on disk for `wandb sync`.
    finish_timeout: float = 60.0
    # Upload the code, the git state and the pip requirements (W&B's save_code and friends).
    save_code: bool = False
    # Record W&B's run metadata: command-line arguments, program, host, OS and hardware.
    save_metadata: bool = False


# --- report ------------------------------------------------------------------------------------


@dataclass
class ReportConfig:
    # A low-precision run whose eval accuracy lies further than this many percentage points from
    # its fp32 run's is called out in the sweep report's verdict.
    accuracy_tolerance: float = 0.5


@dataclass
class RunConfig:
    model: Any = MISSING
    dataset: DatasetConfig = MISSING
    optimizer: Any = MISSING
    scheduler: SchedulerConfig = MISSING
    precision: PrecisionConfig = MISSING
    trainer: TrainerConfig = MISSING
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    # null = start fresh; auto = the newest valid checkpoint in this run directory, if any;
    # or the path of a run directory or checkpoint file.
    resume: str | None = None
    wandb: WandbConfig = MISSING
    report: ReportConfig = MISSING
    seed: int = 0


SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"tiny_cnn": TinyCNNConfig, "mlp": MLPConfig, "torchvision": TorchvisionModelConfig},
    "dataset": {"dataset": DatasetConfig},
    "optimizer": {"sgd": SGDConfig, "adamw": AdamWConfig},
    "scheduler": {"scheduler": SchedulerConfig},
    "precision": {"precision": PrecisionConfig},
    "trainer": {"trainer": TrainerConfig},
    "wandb": {"wandb": WandbConfig},
    "report": {"report": ReportConfig},
}


def register_configs() -> None:
    """Store the schemas under ``schema/<group>/`` so they never show up as group options, and
    register the resolvers conf/config.yaml uses."""
    from amp_exp.ranks import register_resolvers

    register_resolvers()
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(group=f"{SCHEMA_GROUP}/{group}", name=name, node=schema)
    # hydra/launcher=submitit_*: jobs that resume when requeued, if the optional plugin is there.
    if find_spec(SUBMITIT_PLUGIN) is not None:
        from amp_exp.launchers import register_launchers

        register_launchers()


# --- validation ----------------------------------------------------------------------------------

_POSITIVE = (
    "dataset.batch_size",
    "dataset.num_classes",
    "dataset.image_size",
    "dataset.channels",
    "dataset.train_size",
    "dataset.eval_size",
    "trainer.grad_accum_steps",
    "trainer.log_every",
    "precision.growth_interval",
    "wandb.init_timeout",
)
_POSITIVE_OR_NULL = (
    "dataset.eval_batch_size",
    "trainer.max_steps",
    "trainer.epochs",
    "trainer.eval_batches",
    "precision.clip_grad_norm",
    "wandb.log_every",
)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(cfg: DictConfig) -> RunConfig:
    """Turn a composed config into a typed ``RunConfig``, or raise ``ConfigError``."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    _check(
        not missing, f"{', '.join(missing)} must be set, e.g. {missing[0] if missing else ''}=..."
    )
    _reject_unknown_keys(cfg)
    run: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    for key in _POSITIVE:
        value = attrgetter(key)(run)
        _check(value > 0, f"{key}={value} must be positive")
    for key in _POSITIVE_OR_NULL:
        value = attrgetter(key)(run)
        _check(value is None or value > 0, f"{key}={value} must be positive or null")
    _check(run.dataset.num_workers >= 0, "dataset.num_workers must be 0 or more")
    _check(run.dataset.noise_std >= 0, "dataset.noise_std must be 0 or more")
    _check(
        run.dataset.name is not DatasetName.image_folder or Path(run.dataset.root).is_dir(),
        f"dataset.root={run.dataset.root} is not a directory; dataset=image_folder needs "
        "dataset.root=/path/to/images with one sub-folder per class",
    )
    _check(
        0 < run.dataset.eval_fraction < 1, "dataset.eval_fraction must lie strictly between 0 and 1"
    )
    _check(
        run.trainer.max_steps is not None or run.trainer.epochs is not None,
        "set trainer.max_steps or trainer.epochs (both are null, so the run would never end)",
    )
    _check(
        run.trainer.eval_every is None or run.trainer.eval_every >= 0,
        "trainer.eval_every must be 0 (only at the end), a positive step interval, or null (never)",
    )
    _check(run.trainer.timing_warmup_steps >= 0, "trainer.timing_warmup_steps must be 0 or more")
    every = run.checkpoint.every_steps
    _check(every is None or every >= 0, "checkpoint.every_steps must be 0 (at the end), N or null")
    _check(run.checkpoint.keep >= 0, "checkpoint.keep must be 0 or more")
    _check(run.diagnostics.check_steps >= 0, "diagnostics.check_steps must be 0 or more")
    _check(
        run.diagnostics.underflow_every >= 0, "diagnostics.underflow_every must be 0 (off) or more"
    )
    _check(run.report.accuracy_tolerance >= 0, "report.accuracy_tolerance must be 0 or more")
    _validate_precision(run.precision)
    _validate_optimizer(run.optimizer)
    _validate_scheduler(run.scheduler)
    _validate_model(run.model)
    _validate_wandb(run.wandb, run.trainer)
    return run


def _reject_unknown_keys(cfg: DictConfig) -> None:
    """``+group.key=value`` opens a typed node; a key its schema lacks would be silently lost."""
    for section in [*SCHEMAS, "checkpoint", "diagnostics"]:
        node = cfg[section]
        known = {f.name for f in fields(OmegaConf.get_type(node))}
        unknown = sorted(set(node.keys()) - known)
        _check(
            not unknown,
            f"{section}.{unknown[0] if unknown else ''} is not a known key; "
            f"valid keys: {', '.join(sorted(known))}",
        )


def _validate_precision(precision: PrecisionConfig) -> None:
    _check(precision.init_scale > 0, "precision.init_scale must be positive")
    _check(precision.growth_factor > 1, "precision.growth_factor must be greater than 1")
    _check(precision.max_consecutive_skips > 0, "precision.max_consecutive_skips must be positive")
    _check(precision.min_scale > 0, "precision.min_scale must be positive")
    _check(
        0 < precision.backoff_factor < 1,
        "precision.backoff_factor must lie strictly between 0 and 1",
    )


def _validate_optimizer(optimizer: OptimizerConfig) -> None:
    _check(optimizer.lr > 0, f"optimizer.lr={optimizer.lr} must be positive")
    _check(optimizer.weight_decay >= 0, "optimizer.weight_decay must be 0 or more")
    if isinstance(optimizer, AdamWConfig):
        _check(
            len(optimizer.betas) == 2 and all(0 <= b < 1 for b in optimizer.betas),
            "optimizer.betas must be two numbers in [0, 1)",
        )
    else:
        _check(0 <= optimizer.momentum < 1, "optimizer.momentum must lie in [0, 1)")
        _check(
            not optimizer.nesterov or optimizer.momentum > 0,
            "optimizer.nesterov=true needs optimizer.momentum > 0",
        )


def _validate_scheduler(scheduler: SchedulerConfig) -> None:
    _check(scheduler.warmup_steps >= 0, "scheduler.warmup_steps must be 0 or more")
    _check(0 <= scheduler.min_lr_ratio <= 1, "scheduler.min_lr_ratio must lie in [0, 1]")
    _check(0 < scheduler.pct_start < 1, "scheduler.pct_start must lie strictly between 0 and 1")


def _validate_model(model: ModelConfig) -> None:
    if isinstance(model, TinyCNNConfig):
        _check(model.width > 0, "model.width must be a positive integer")
    elif isinstance(model, MLPConfig):
        _check(model.hidden_dim > 0, "model.hidden_dim must be a positive integer")
        _check(model.depth >= 0, "model.depth must be 0 or more")
    else:
        from amp_exp.models import torchvision_model_names

        names = torchvision_model_names()
        _check(
            model.name in names,
            f"model.name={model.name!r} is not a torchvision classification model; "
            f"valid choices: {', '.join(names)}",
        )


def _validate_wandb(wandb: WandbConfig, trainer: TrainerConfig) -> None:
    _check(bool(wandb.project.strip()), "wandb.project must not be empty")
    _check(wandb.finish_timeout >= 0, "wandb.finish_timeout must be 0 (wait for all) or more")
    _check(
        wandb.log_every is None or wandb.log_every % trainer.log_every == 0,
        f"wandb.log_every={wandb.log_every} must be a multiple of "
        f"trainer.log_every={trainer.log_every}, the interval at which metrics are read",
    )
    long_tags = [tag for tag in wandb.tags if len(tag) > WANDB_TAG_MAX_CHARS]
    _check(
        not long_tags,
        f"wandb.tags: {long_tags[0] if long_tags else ''!r} is longer than "
        f"{WANDB_TAG_MAX_CHARS} characters",
    )


def to_plain_dict(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python types (enums become their values)."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]
