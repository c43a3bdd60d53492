"""Typed config schemas: one dataclass per config group, enums for every closed choice.

A leaf: it imports nothing heavier than OmegaConf's ``MISSING``, and from amp_exp only the model,
dataset and adaptive schemas (leaves too). Each YAML file under ``conf/`` lists its schema first
in its defaults list (``config.store``), so Hydra type-checks it and every override against these.
A field's ``metadata={"bound": RULE}`` (here and in the model and dataset schemas) names the range
its values must keep; config/values.py's ``BOUNDS`` words and checks each rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Union

from omegaconf import MISSING

from amp_exp.config.adaptive import COMPILE_AUTO, EvidenceConfig, SpeedStopping
from amp_exp.config.datasets import (
    CustomDatasetConfig,
    ImageDatasetConfig,
    SyntheticTokensConfig,
    TextDatasetConfig,
)
from amp_exp.config.models import (
    CustomModelConfig,
    GPTConfig,
    HFModelConfig,
    MLPConfig,
    TimmModelConfig,
    TinyCNNConfig,
    TorchvisionModelConfig,
)


class ReduceDtype(str, Enum):
    """The dtype FSDP2 reduce-scatters gradients in."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Strategy(str, Enum):
    """How the ranks of a torchrun job share the model: replicated (DDP) or sharded (FSDP2)."""

    ddp = "ddp"
    fsdp2 = "fsdp2"


class DeviceChoice(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class TaskName(str, Enum):
    classification = "classification"
    lm = "lm"


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


# --- optimizer and scheduler --------------------------------------------------------------------


@dataclass
class SGDConfig:
    name: str = "sgd"
    lr: float = field(default=0.1, metadata={"bound": "positive"})
    momentum: float = field(default=0.9, metadata={"bound": "half_open_unit"})
    nesterov: bool = True
    weight_decay: float = field(default=5e-4, metadata={"bound": "at_least_0"})
    # null = the fused kernel on CUDA, except under FSDP2 (DTensor has none for SGD).
    fused: bool | None = None


@dataclass
class AdamWConfig:
    name: str = "adamw"
    lr: float = field(default=1e-3, metadata={"bound": "positive"})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = field(default=0.05, metadata={"bound": "at_least_0"})
    # null = fused kernels on CUDA (they skip a non-finite step on the device, with no sync).
    fused: bool | None = None


OptimizerConfig = Union[SGDConfig, AdamWConfig]


@dataclass
class SchedulerConfig:
    name: SchedulerName = SchedulerName.cosine
    # Linear warm-up for cosine; onecycle uses pct_start instead.
    warmup_steps: int = field(default=20, metadata={"bound": "at_least_0"})
    # The cosine schedule ends at lr * min_lr_ratio.
    min_lr_ratio: float = field(default=0.0, metadata={"bound": "unit"})
    pct_start: float = field(default=0.25, metadata={"bound": "open_unit"})


# --- precision and trainer ---------------------------------------------------------------------


@dataclass
class PrecisionConfig:
    # A precision of the registry (config/precisions.py: the plugins of
    # amp_exp/training/precisions/, of installed packages, and ``_target_``'s), or auto: time the
    # model in fp32 and each candidate the device's measured speeds do not rule out; a low
    # precision must be established faster by the speed trial's interval (capability/auto.py).
    name: str = "auto"
    # A user's own plugin: the dotted path of its PrecisionPlugin class, registered before
    # ``name`` is looked up (docs/precision.md, "Adding a precision").
    _target_: str | None = None
    # The plugin's own options (bf16_true's rounding, fp8's recipe and filters, a block-scaled
    # format's recipe), checked against its ``Options`` dataclass before torch loads;
    # conf/precision/NAME.yaml lists them with their defaults.
    options: dict[str, Any] = field(default_factory=dict)
    # GradScaler knobs; they only take effect when fp16 runs.
    init_scale: float = field(default=65536.0, metadata={"bound": "positive_number"})
    growth_factor: float = 2.0
    backoff_factor: float = field(default=0.5, metadata={"bound": "open_unit"})
    growth_interval: int = field(default=2000, metadata={"bound": "positive"})
    # Max total gradient norm after unscaling; null = no clipping.
    clip_grad_norm: float | None = field(default=None, metadata={"bound": "positive_or_null"})
    # Every precision stops with a diagnosis after this many skipped steps in a row; fp16 also
    # when the loss scale falls below min_scale (below 1 the true gradients overflow fp16).
    max_consecutive_skips: int = field(default=50, metadata={"bound": "positive_number"})
    min_scale: float = field(default=1.0, metadata={"bound": "positive_number"})
    # Emulate the format's matmuls (fp8's and the block-scaled formats'), on any device
    # (numerics and tests; slow, so never timed). Shared, not an option of one plugin: commands
    # that rank or predict other precisions than the run's (sensitivity.precisions=[fp8]) read it.
    emulate: bool = False
    # trainer.strategy=fsdp2 only: the dtype gradients are reduce-scattered in; null = fp32.
    reduce_dtype: ReduceDtype | None = None
    # trainer.strategy=fsdp2 only: gather parameters cast to bf16/fp16, no autocast (torchtitan's
    # policy): half the all-gather traffic, but norms, embeddings and the residual stream then run
    # in low precision, unlike DDP; false = autocast over fp32 weights, as DDP and one process.
    fsdp_cast_params: bool = False
    # Globs over the model's module names (named_modules) that run in fp32 in every mode.
    keep_fp32: list[str] = field(default_factory=list)


@dataclass
class TrainerConfig:
    device: DeviceChoice = DeviceChoice.auto
    # Under torchrun: ddp replicates the model, fsdp2 shards it (fully_shard, each block of
    # model.blocks then the root). fsdp2 without torchrun runs as a group of one process.
    strategy: Strategy = Strategy.ddp
    # Training stops at whichever of max_steps and epochs comes first; null = no limit.
    max_steps: int | None = field(default=300, metadata={"bound": "positive_or_null"})
    epochs: int | None = field(default=None, metadata={"bound": "positive_or_null"})
    grad_accum_steps: int = field(default=1, metadata={"bound": "positive"})
    log_every: int = field(default=25, metadata={"bound": "positive"})
    # 0 = evaluate only at the end; null = never.
    eval_every: int | None = 0
    # null = the whole eval split.
    eval_batches: int | None = field(default=None, metadata={"bound": "positive_or_null"})
    # Optimizer steps left out of throughput: allocator warm-up, cudnn autotuning, compilation.
    timing_warmup_steps: int = field(default=5, metadata={"bound": "at_least_0"})
    # null = on for convolutional models on CUDA.
    channels_last: bool | None = None
    # true, false or auto (config/adaptive.py). Under fsdp2, blocks compile, then are sharded.
    compile: Any = COMPILE_AUTO
    compile_mode: CompileMode = CompileMode.default
    deterministic: bool = False
    # Recompute each block's activations (model.blocks) in the backward instead of keeping them.
    activation_checkpointing: bool = False
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
    keep: int = field(default=0, metadata={"bound": "at_least_0"})


@dataclass
class DiagnosticsConfig:
    # Check master weights and unscaled gradients on the first check_steps optimizer steps.
    checks: bool = True
    check_steps: int = field(default=3, metadata={"bound": "at_least_0"})
    # Every this many steps, measure how fp16 would treat the gradients and the share of weights
    # that did not change since the last time (holds one copy of the weights); 0 = off.
    underflow_every: int = 100
    # Audit one training step: the dtype of every matmul, the bytes saved for backward, the
    # state and communication dtypes, and whether the precision engaged (training/audit/).
    audit: bool = True
    # The step audited; null = the first timed step, after trainer.timing_warmup_steps.
    audit_step: int | None = None
    # A "signals" row at each log step for `python -m amp_exp.forecast` (training/signals.py).
    signals: bool = True


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
    log_every: int | None = field(default=None, metadata={"bound": "positive_or_null"})
    # Seconds to wait for the W&B server before the run logs offline instead. With W&B's import
    # and the offline start, the fallback then comes within about 20 s even on a busy machine.
    init_timeout: float = field(default=15.0, metadata={"bound": "positive"})
    # Seconds finish() may spend uploading; what is left stays on disk for `wandb sync`.
    finish_timeout: float = 60.0
    # Upload the code, the git state and the pip requirements (W&B's save_code and friends).
    save_code: bool = False
    # Record W&B's run metadata: command-line arguments, program, host, OS and hardware.
    save_metadata: bool = False


# --- report ------------------------------------------------------------------------------------


# report.familywise: Holm across a report's comparisons, or each at its own level.
FAMILYWISE = ("holm", "none")


@dataclass
class ReportConfig:
    # How far a low-precision run's quality metric may lie from its fp32 run's, in the unit the
    # task declares (classification: accuracy points; language models: relative eval loss);
    # null = the task's own default (0.5 points; 1%).
    tolerance: float | None = None
    # Also save the comparison as a W&B Report when a multirun whose runs logged online ends
    # (needs amp_exp[wandb-report]); `python -m amp_exp.report DIR --wandb` makes one later.
    wandb: bool = False
    # Seconds the W&B Report may take to reach the server and save, before it is given up.
    wandb_timeout: float = field(default=10.0, metadata={"bound": "positive"})
    # Time each model and setting of a sweep that varies precision in the speed trial (speed.*).
    speed_trial: bool = True
    # holm: Holm across the report's comparisons, a family per claim (matches, not_worse, worse,
    # better) at 2.5% each; none: each comparison holds at its own level (docs/sweeps.md).
    familywise: str = "holm"
    # GPUs of devices.py (h100, ...) whose roofline speedups (amp_exp.predict) the
    # report shows beside the measured ones, labelled as predicted.
    predict: list[str] = field(default_factory=list)
    # The length each precision's signals are forecast to (amp_exp.forecast); null = 10x a run's.
    forecast_steps: int | None = field(default=None, metadata={"bound": "positive_or_null"})


@dataclass
class SensitivityConfig:
    """python -m amp_exp.sensitivity's settings (rules: config/values.py); runs ignore them."""

    # The precisions ranked (fp16, bf16, fp8); null = precision= if one of those, else fp16, bf16.
    precisions: list[str] | None = None
    # Training batches measured, each against its own fp32 reference; modules listed per precision.
    batches: int = field(default=2, metadata={"bound": "positive"})
    show: int = field(default=10, metadata={"bound": "positive"})
    # Search for the modules to keep in fp32 (at most max_trials sets), each proven by the report's
    # verdict on verify_seeds .. max_verify_seeds seeds (docs/precision.md); null tolerance: task's.
    repair: bool = False
    max_trials: int = field(default=6, metadata={"bound": "positive"})
    verify_seeds: int = 3
    max_verify_seeds: int = 5
    verify_steps: int = field(default=40, metadata={"bound": "positive"})
    verify_growth_interval: int = field(default=10, metadata={"bound": "positive"})
    tolerance: float | None = None


@dataclass
class SpeedConfig(SpeedStopping):
    """The speed trial (amp_exp/speed/; rules: config/values.py): each precision against fp32
    in a pair of its own, warmed up until steady, timed AB, BA, ... until it knows (adaptive.py)"""

    # python -m amp_exp.speed times these and fp32; a sweep's trial, the precisions it ran.
    precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16", "fp16"])
    # The cap on each side's warm-up steps, when its step time has not settled before.
    max_warmup_steps: int = 100
    steps: int = field(default=5, metadata={"bound": "positive"})


@dataclass
class PredictConfig:
    """python -m amp_exp.predict's settings (rules: config/values.py); runs ignore them."""

    # Keys of devices.py's table: h100, h200, b200, a100.
    devices: list[str] = field(default_factory=lambda: ["h100"])
    # The precisions predicted; bf16 and fp32 are added, the speedups' baselines.
    precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16", "fp8"])
    # GPUs the batch is data-parallel over; above 1, FSDP2 shards weights, gradients and state.
    world_size: int = field(default=1, metadata={"bound": "at_least_1"})
    # GB/s one GPU sends and receives over the interconnect (NVLink 4 on H100 SXM: 450 each way).
    interconnect_gb_per_s: float = field(default=450.0, metadata={"bound": "positive"})


@dataclass
class RunConfig:
    model: Any = MISSING
    dataset: Any = MISSING
    # What is trained: the loss and the metrics. null = what the dataset holds (images:
    # classification, tokens: lm); dataset=custom needs it set.
    task: TaskName | None = None
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
    sensitivity: SensitivityConfig = field(default_factory=SensitivityConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)
    evidence: EvidenceConfig = field(default_factory=EvidenceConfig)
    # Jobs of a sweep that differ only in seed are replicates (docs/sweeps.md).
    seed: int = 0


SCHEMAS: dict[str, dict[str, type]] = {
    "model": {
        "tiny_cnn": TinyCNNConfig,
        "mlp": MLPConfig,
        "torchvision": TorchvisionModelConfig,
        "gpt": GPTConfig,
        "timm": TimmModelConfig,
        "custom": CustomModelConfig,
        "hf": HFModelConfig,
    },
    "dataset": {
        "images": ImageDatasetConfig,
        "synthetic_tokens": SyntheticTokensConfig,
        "text": TextDatasetConfig,
        "custom": CustomDatasetConfig,
    },
    "optimizer": {"sgd": SGDConfig, "adamw": AdamWConfig},
    "scheduler": {"scheduler": SchedulerConfig},
    "precision": {"precision": PrecisionConfig},
    "trainer": {"trainer": TrainerConfig},
    "wandb": {"wandb": WandbConfig},
    "report": {"report": ReportConfig},
}
