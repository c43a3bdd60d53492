"""Typed config schemas: one dataclass per config group, enums for every closed choice.

A leaf: it imports no other amp_exp module, and nothing heavier than OmegaConf's ``MISSING``.
Each YAML file under ``conf/`` lists its schema first in its defaults list (``config.store``
registers them), so Hydra type-checks the YAML and every override against these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Union

from omegaconf import MISSING


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


class TaskName(str, Enum):
    classification = "classification"
    lm = "lm"


class Tokenizer(str, Enum):
    # Byte-level: every file is text, the vocabulary is 256, nothing to download.
    bytes = "bytes"
    # GPT-2's BPE through tiktoken (optional extra), from files already cached.
    gpt2 = "gpt2"


TOKENIZER_VOCAB = {Tokenizer.bytes: 256, Tokenizer.gpt2: 50257}


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


@dataclass
class GPTConfig:
    """A decoder-only transformer (tasks/gpt.py): pre-LayerNorm blocks, causal attention, a GELU
    MLP, and an output head tied to the token embedding."""

    name: str = "gpt"
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    # The longest context: the size of the position table. Token data is cut into windows of
    # dataset.seq_len tokens, which defaults to this.
    seq_len: int = 1024
    # null = the dataset's vocabulary; a larger value pads the output head (e.g. 50304).
    vocab_size: int | None = None
    dropout: float = 0.0
    # Biases in the linear layers and LayerNorms, as GPT-2 has them.
    bias: bool = True


@dataclass
class TimmModelConfig:
    """Any timm model by name (optional extra: pip install 'amp_exp[timm]'), random weights."""

    name: str = MISSING
    # Passed to timm.create_model, e.g. +model.kwargs.img_size=32 for a ViT on small images.
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class CustomModelConfig:
    """The user's own model: ``_target_`` names a callable that returns an nn.Module.

    It is called with ``kwargs`` plus those of the dataset's facts its signature accepts:
    num_classes and input_shape for images; vocab_size and seq_len for tokens.
    """

    name: str = "custom"
    _target_: str = MISSING
    kwargs: dict[str, Any] = field(default_factory=dict)


ModelConfig = Union[
    TinyCNNConfig, MLPConfig, TorchvisionModelConfig, GPTConfig, TimmModelConfig, CustomModelConfig
]

# --- dataset -----------------------------------------------------------------------------------


@dataclass
class ImageDatasetConfig:
    """Image classification data: synthetic, torchvision's sets, or a folder of images."""

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


@dataclass
class SyntheticTokensConfig:
    """Token sequences from a fixed, seeded, sparse random Markov chain, resident on the device.

    Each token can be followed by ``branching`` others, so the best possible loss (the chain's
    entropy, recorded as loss_floor) lies far below ln(vocab_size).
    """

    name: str = "synthetic_tokens"
    # Sequences per batch and rank.
    batch_size: int = 32
    # null = the training batch size.
    eval_batch_size: int | None = None
    # Tokens a model sees per sequence; null = the model's seq_len (gpt).
    seq_len: int | None = None
    vocab_size: int = 128
    branching: int = 4
    # Sequences in each split.
    train_size: int = 2048
    eval_size: int = 256


@dataclass
class TextDatasetConfig:
    """A text file, or a folder of .txt files, tokenized once and cached; resident on the device."""

    name: str = "text"
    path: str = MISSING
    tokenizer: Tokenizer = Tokenizer.bytes
    # The last eval_fraction of the tokens is held out for evaluation.
    eval_fraction: float = 0.1
    batch_size: int = 32
    eval_batch_size: int | None = None
    seq_len: int | None = None
    # Where tokenized data is cached when the data's own folder is read-only; null =
    # $XDG_CACHE_HOME/amp_exp/tokens (~/.cache/amp_exp/tokens).
    cache_dir: str | None = None


@dataclass
class CustomDatasetConfig:
    """The user's own data: ``_target_`` names a callable that returns (train, eval) torch
    Datasets of (input, target) pairs. It is called with ``kwargs``, plus ``seed`` if its
    signature accepts it."""

    name: str = "custom"
    _target_: str = MISSING
    kwargs: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    eval_batch_size: int | None = None
    num_workers: int = 0
    # What the model is built for, which the samples alone do not say: num_classes for
    # task=classification, vocab_size for task=lm. The input shape (images) and seq_len (tokens)
    # are read from the first training sample.
    num_classes: int | None = None
    vocab_size: int | None = None


DatasetConfig = Union[
    ImageDatasetConfig, SyntheticTokensConfig, TextDatasetConfig, CustomDatasetConfig
]
TOKEN_DATASETS = (SyntheticTokensConfig, TextDatasetConfig)


def dataset_name(dataset: DatasetConfig) -> str:
    """The option a dataset was chosen by: image datasets name theirs with an enum."""
    return getattr(dataset.name, "value", dataset.name)


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
    seed: int = 0


SCHEMAS: dict[str, dict[str, type]] = {
    "model": {
        "tiny_cnn": TinyCNNConfig,
        "mlp": MLPConfig,
        "torchvision": TorchvisionModelConfig,
        "gpt": GPTConfig,
        "timm": TimmModelConfig,
        "custom": CustomModelConfig,
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
