"""Values that must agree: with each other, with the model and the data, with the device, the
environment and the disk. Checked after each value passed on its own (config/values.py).

Which models train on which data, and for which task: image models classify images; gpt models
predict the next token. The task (``task=``) follows from the dataset unless the dataset is the
user's own; the user's own model fits either task, and so does a Hugging Face model whose type has
the auto class the data needs (config/hf.py). Activation checkpointing recomputes transformer
blocks, which amp_exp's own image models (tiny_cnn, mlp) do not have; whether a torchvision, timm,
hf or user model has them shows once it is built.

The commands' sections agree among themselves and with the run (``_check_commands``), and a
resumed evidence sweep with the plan it recorded (``check_resumed_plan``).

What a job needs from outside its config (``check_job``: the environment, the data on disk, the
device) and a directory to write to (``check_output_dir``) are checked by the pre-flight for every
job of a sweep, so a job that could never start fails before the first one trains. None of these
checks writes a file or trains anything, and torch is imported only when a job asks for CUDA.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from amp_exp.config import hf, precisions
from amp_exp.config.adaptive import EvidenceConfig
from amp_exp.config.datasets import (
    TOKEN_DATASETS,
    TOKENIZER_VOCAB,
    CustomDatasetConfig,
    DatasetConfig,
    DatasetName,
    ImageDatasetConfig,
    SyntheticTokensConfig,
    TextDatasetConfig,
    Tokenizer,
    dataset_name,
)
from amp_exp.config.models import (
    CustomModelConfig,
    GPTConfig,
    HFModelConfig,
    MLPConfig,
    TinyCNNConfig,
)
from amp_exp.config.schema import (
    DeviceChoice,
    PrecisionConfig,
    ReduceDtype,
    RunConfig,
    SGDConfig,
    Strategy,
    TaskName,
    TrainerConfig,
    WandbMode,
)
from amp_exp.errors import ConfigError, require, require_choice

IMAGE_DATASETS = ", ".join(name.value for name in DatasetName)
VALID_PAIRINGS = (
    "valid pairings: image models (tiny_cnn, mlp, resnet18, resnet50, torchvision, timm) with "
    f"image datasets ({IMAGE_DATASETS}); gpt models (gpt_tiny, gpt2_small) with token datasets "
    "(synthetic_tokens, text); model=custom, model=hf and dataset=custom with either, by "
    "task=classification or task=lm"
)
# WANDB_MODE values that wandb.init accepts, including its legacy spellings.
ENV_MODES = {
    "online": WandbMode.online,
    "run": WandbMode.online,
    "offline": WandbMode.offline,
    "dryrun": WandbMode.offline,
    "disabled": WandbMode.disabled,
}
# torchvision's IMG_EXTENSIONS (ImageFolder's default), spelled out: importing torchvision to read
# it would cost every start-up 1.5 s.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Where each torchvision data set lies under dataset.root once downloaded.
TORCHVISION_DATA_DIRS = {
    DatasetName.cifar10: "cifar-10-batches-py",
    DatasetName.cifar100: "cifar-100-python",
    DatasetName.mnist: "MNIST/raw",
    DatasetName.fashion_mnist: "FashionMNIST/raw",
}


def check_agreement(run: RunConfig) -> TaskName:
    """The run's task, after checking that its values agree; ``ConfigError`` on the first that
    does not."""
    trainer = run.trainer
    require(
        trainer.max_steps is not None or trainer.epochs is not None,
        "set trainer.max_steps or trainer.epochs (both are null, so the run would never end)",
    )
    validate_precision(run.precision, trainer)
    _check_commands(run)
    fsdp2 = trainer.strategy is Strategy.fsdp2
    require(
        not (trainer.channels_last and fsdp2),
        "trainer.channels_last=true cannot run with trainer.strategy=fsdp2, which shards only "
        "contiguous parameters (channels_last convolution weights are not); leave it null",
    )
    if isinstance(run.optimizer, SGDConfig):
        require(
            not run.optimizer.nesterov or run.optimizer.momentum > 0,
            "optimizer.nesterov=true needs optimizer.momentum > 0",
        )
        require(
            not (run.optimizer.fused and fsdp2),
            "optimizer.fused=true cannot run with trainer.strategy=fsdp2: FSDP2's DTensors have "
            "no fused SGD kernel; leave it null",
        )
    _check_synthetic_sizes(run)
    task = check_pairing(run)
    log_every = run.wandb.log_every
    require(
        log_every is None or log_every % trainer.log_every == 0,
        f"wandb.log_every={log_every} must be a multiple of "
        f"trainer.log_every={trainer.log_every}, the interval at which metrics are read",
    )
    return task


def validate_precision(precision: PrecisionConfig, trainer: TrainerConfig) -> None:
    """Raise ``ConfigError`` on the first precision value that cannot run with ``trainer``: a
    user's plugin registers first; then the name (one line with the valid choices), the plugin's
    options and its own rules, the strategy's values, and the chosen one's facts. (The values
    every precision reads, each on its own: config/values.py.)"""
    if precision._target_ is not None:
        precisions.register(precision._target_)
    spec = None
    if precision.name == precisions.AUTO:
        require(not precision.options, "precision=auto takes no precision.options")
    else:
        plugin = precisions.get(precision.name)
        spec = plugin.spec
        precisions.options_of(plugin, precision.options)
        with precisions.PluginHook(plugin, "check_config"):
            plugin.check_config(precision, trainer)
    reduce, fsdp2 = precision.reduce_dtype, trainer.strategy is Strategy.fsdp2
    specs = {name: precisions.get(name).spec for name in precisions.names()}
    if reduce is not None:
        require(
            fsdp2,
            f"precision.reduce_dtype={reduce.value} needs trainer.strategy=fsdp2; DDP reduces "
            "gradients in their own dtype (fp32)",
        )
        # Only a GradScaler notices a gradient that overflowed fp16 in the reduction.
        scaled = [name for name, s in specs.items() if s.grad_scaler]
        require(
            reduce is not ReduceDtype.fp16 or (spec is not None and spec.grad_scaler),
            f"precision.reduce_dtype=fp16 needs precision={' or '.join(scaled)}, whose "
            "GradScaler catches gradients that overflow fp16; valid choices here: fp32, bf16",
        )
    if precision.fsdp_cast_params:
        require(
            fsdp2,
            "precision.fsdp_cast_params=true needs trainer.strategy=fsdp2; DDP and one process "
            "compute under autocast from fp32 weights",
        )
        casting = [name for name, s in specs.items() if s.fsdp_param_dtype is not None]
        require(
            spec is None or spec.fsdp_param_dtype is not None,
            f"precision.fsdp_cast_params=true: precision={precision.name} has no dtype to cast "
            f"the parameters to; valid choices: {', '.join(casting)}",
        )
    if spec is not None:
        require(
            trainer.strategy in spec.strategies,
            f"precision={spec.name} does not run with trainer.strategy={trainer.strategy.value} "
            f"yet; valid choices: {', '.join(sorted(s.value for s in spec.strategies))}",
        )


def _check_commands(run: RunConfig) -> None:
    """The values of the commands' sections (speed.*, sensitivity.*, evidence.*) that must agree
    with each other, and the precisions sensitivity ranks with the run's precision and trainer."""
    speed, evidence, sensitivity = run.speed, run.evidence, run.sensitivity
    require(
        speed.max_rounds >= speed.rounds and speed.max_rounds % 2 == 0,
        f"speed.max_rounds={speed.max_rounds} must be even and at least speed.rounds="
        f"{speed.rounds}: the trial stops at the first look that knows, or there",
    )
    require(
        evidence.max_seeds >= evidence.min_seeds,
        f"evidence.max_seeds={evidence.max_seeds} must be at least evidence.min_seeds="
        f"{evidence.min_seeds}",
    )
    require(
        sensitivity.max_verify_seeds >= sensitivity.verify_seeds,
        f"sensitivity.max_verify_seeds={sensitivity.max_verify_seeds} must be at least "
        f"sensitivity.verify_seeds={sensitivity.verify_seeds}",
    )
    require(
        sensitivity.verify_steps >= 2 * sensitivity.verify_growth_interval,
        f"sensitivity.verify_steps={sensitivity.verify_steps} must be at least twice "
        f"sensitivity.verify_growth_interval={sensitivity.verify_growth_interval}, so that fp16's "
        "loss scale grows within a verification run",
    )
    precision = run.precision  # a user's plugin: registered by validate_precision already
    for chosen in precisions.target_precisions(sensitivity, precision.name):
        require_choice(
            chosen,
            precisions.rankable(),
            f"sensitivity.precisions: {chosen} is not ranked against fp32",
        )
        # fp8 needs what a run in fp8 needs: torchao, and a GPU or emulation. The run's options
        # are its own precision's; another ranked precision takes its defaults.
        options = precision.options if chosen == precision.name else {}
        ranked = dataclasses.replace(precision, name=chosen, options=options)
        validate_precision(ranked, run.trainer)


def check_resumed_plan(evidence: EvidenceConfig, recorded: object) -> None:
    """Raise ``ConfigError`` unless an evidence sweep resumed with ``evidence`` keeps the plan it
    recorded (evidence.json's ``plan``): the same min_seeds, and max_seeds no higher. The looks
    planned set every look's level; more seeds would add looks the level did not pay for."""
    plan = recorded if isinstance(recorded, dict) else {}
    before = (plan.get("min_seeds"), plan.get("max_seeds"))
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in before):
        raise ConfigError(
            f"evidence.json holds no plan this sweep can read ({plan!r}); resume only a sweep "
            "amp_exp wrote there, or start a new sweep"
        )
    if evidence.max_seeds > before[1] or evidence.min_seeds != before[0]:
        raise ConfigError(
            f"evidence.min_seeds={evidence.min_seeds} evidence.max_seeds={evidence.max_seeds}: "
            f"this sweep was planned with min_seeds={before[0]} and max_seeds={before[1]}, and "
            "its looks' level holds only for those; resume it with them, or start a new sweep"
        )


def _check_synthetic_sizes(run: RunConfig) -> None:
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


def dataset_task(run: RunConfig) -> TaskName | None:
    """The task the data is for, or None for the user's own data, which does not say."""
    if isinstance(run.dataset, ImageDatasetConfig):
        return TaskName.classification
    if isinstance(run.dataset, TOKEN_DATASETS):
        return TaskName.lm
    return None


def model_tasks(run: RunConfig) -> set[TaskName]:
    if isinstance(run.model, (CustomModelConfig, HFModelConfig)):
        return set(TaskName)
    return {TaskName.lm} if isinstance(run.model, GPTConfig) else {TaskName.classification}


def text_vocab_size(dataset: TextDatasetConfig) -> int:
    """The vocabulary of a text dataset's tokenizer."""
    require(
        (dataset.tokenizer is Tokenizer.hf) == (dataset.tokenizer_path is not None),
        "dataset.tokenizer=hf and dataset.tokenizer_path=DIR (a tokenizer folder written by "
        "save_pretrained) go together",
    )
    if dataset.tokenizer is Tokenizer.hf:
        return hf.tokenizer_vocab_size(dataset.tokenizer_path)
    return TOKENIZER_VOCAB[dataset.tokenizer]


def data_vocab_size(run: RunConfig) -> int | None:
    dataset = run.dataset
    if isinstance(dataset, SyntheticTokensConfig):
        return dataset.vocab_size
    if isinstance(dataset, TextDatasetConfig):
        return text_vocab_size(dataset)
    return dataset.vocab_size if isinstance(dataset, CustomDatasetConfig) else None


def no_blocks(model_name: str) -> ConfigError:
    """Activation checkpointing asked of a model without blocks; refused here for the built-in
    models before a job starts, and by tasks.blocks for the user's own once built."""
    return ConfigError(
        f"trainer.activation_checkpointing=true recomputes the blocks of a transformer "
        f"(model.blocks, or a Hugging Face model's _no_split_modules), and model "
        f"{model_name} has none; set it to false"
    )


def check_pairing(run: RunConfig) -> TaskName:
    """The run's task, after checking that model, data and task fit together."""
    if isinstance(run.model, HFModelConfig):
        hf.check_model(run.model)  # names the model (from model.path) before it is named below
    data_name, model_name = dataset_name(run.dataset), run.model.name
    implied = dataset_task(run)
    require(
        run.task is not None or implied is not None,
        f"dataset={data_name} needs task=classification or task=lm: your data does not say",
    )
    task = run.task or implied
    if implied is not None and task is not implied:
        raise ConfigError(
            f"task={task.value} does not fit dataset={data_name}, which is for "
            f"task={implied.value}; {VALID_PAIRINGS}"
        )
    if task not in model_tasks(run):
        what = "image" if task is TaskName.classification else "token"
        raise ConfigError(
            f"model={model_name} cannot train on dataset={data_name} ({what} data, "
            f"task={task.value}); {VALID_PAIRINGS}"
        )
    if isinstance(run.dataset, CustomDatasetConfig):
        needed = "num_classes" if task is TaskName.classification else "vocab_size"
        require(
            getattr(run.dataset, needed) is not None,
            f"dataset=custom with task={task.value} needs dataset.{needed}=N: the model is "
            "built for it",
        )
    images = isinstance(run.dataset, ImageDatasetConfig)
    # The user's own labelled data is images or token sequences: its first sample tells, at build.
    if isinstance(run.model, HFModelConfig) and (images or task is TaskName.lm):
        hf.check_auto_class(run.model, task, images)
    if task is TaskName.lm:
        _check_token_sizes(run)
    if run.trainer.activation_checkpointing and isinstance(run.model, (TinyCNNConfig, MLPConfig)):
        raise no_blocks(model_name)
    return task


def _check_token_sizes(run: RunConfig) -> None:
    model, dataset = run.model, run.dataset
    data_seq_len = getattr(dataset, "seq_len", None)
    vocab = data_vocab_size(run)
    if isinstance(model, GPTConfig):
        require(
            data_seq_len is None or data_seq_len <= model.seq_len,
            f"dataset.seq_len={data_seq_len} exceeds model.seq_len={model.seq_len}, the "
            "positions the model has",
        )
        require(
            model.vocab_size is None or vocab is None or model.vocab_size >= vocab,
            f"model.vocab_size={model.vocab_size} is smaller than the data's vocabulary "
            f"({vocab}); set it to at least that, or null to take the data's",
        )
    elif isinstance(model, HFModelConfig):
        _check_hf_token_sizes(model, data_seq_len, vocab)
    else:
        require(
            not isinstance(dataset, TOKEN_DATASETS) or data_seq_len is not None,
            f"dataset={dataset_name(dataset)} with model={model.name} needs dataset.seq_len=N "
            "(only gpt and hf models bring their own)",
        )


def _check_hf_token_sizes(model: HFModelConfig, data_seq_len: int | None, vocab: int | None):
    positions = hf.max_positions(model)
    require(
        data_seq_len is not None or positions is not None,
        f"model.name={model.name} has no max_position_embeddings: set dataset.seq_len=N",
    )
    require(
        data_seq_len is None or positions is None or data_seq_len <= positions,
        f"dataset.seq_len={data_seq_len} exceeds the {model.name} config's "
        f"max_position_embeddings={positions}; set +model.config.max_position_embeddings or "
        "a shorter dataset.seq_len",
    )
    model_vocab = hf.model_vocab_size(model)
    if model_vocab is not None and vocab is not None and model_vocab < vocab:
        where = "model.path's config" if model.path else "model.config.vocab_size"
        raise ConfigError(
            f"the model's vocabulary ({model_vocab}, {where}) is smaller than the data's "
            f"({vocab}); they must match, or the model's be larger"
        )


def resolve_mode(configured: WandbMode, environ: Mapping[str, str]) -> WandbMode:
    """An explicit wandb.mode wins, as ``wandb.init(mode=...)`` does; under auto, WANDB_MODE."""
    from_env = environ.get("WANDB_MODE", "").strip().lower()
    if configured is not WandbMode.auto or not from_env:
        return configured
    require(
        from_env in ENV_MODES,
        f"WANDB_MODE={from_env} is not a W&B mode; use online, offline or disabled",
    )
    return ENV_MODES[from_env]


def image_folder_splits(root: Path) -> tuple[Path, Path | None]:
    """The train and eval folders of an image folder, or (root, None) when the images are not
    split yet and dataset.eval_fraction holds some out."""
    eval_dir = next((root / d for d in ("val", "test") if (root / d).is_dir()), None)
    if (root / "train").is_dir() and eval_dir is not None:
        return root / "train", eval_dir
    return root, None


def _has_image(directory: Path) -> bool:
    # ImageFolder follows links and finds images at any depth below a class folder.
    for _, _, files in os.walk(directory, followlinks=True):
        if any(name.lower().endswith(IMAGE_EXTENSIONS) for name in files):
            return True
    return False


def check_image_folder(root: Path) -> None:
    """Each split has class folders, and each class folder at least one image file (by name:
    opening every image would cost a pass over the data set)."""
    require(
        root.is_dir(),
        f"dataset.root={root} is not a directory; dataset=image_folder needs "
        "dataset.root=/path/to/images with one sub-folder per class",
    )
    for split in filter(None, image_folder_splits(root)):
        classes = sorted(entry for entry in split.iterdir() if entry.is_dir())
        require(
            bool(classes),
            f"dataset.root: {split} has no class sub-folders; put each class's images in "
            "a folder of its own",
        )
        empty = [folder.name for folder in classes if not _has_image(folder)]
        require(
            not empty,
            f"dataset.root: class folder(s) {', '.join(empty)} in {split} hold no image "
            f"file ({', '.join(IMAGE_EXTENSIONS)})",
        )


def check_data(dataset: DatasetConfig) -> None:
    """The data set is on disk, or will be downloaded."""
    if isinstance(dataset, TextDatasetConfig):
        path = Path(dataset.path).expanduser()
        require(
            path.is_file() or path.is_dir(),
            f"dataset.path={dataset.path}: no such file or directory; dataset=text needs "
            "dataset.path=/path/to/file.txt or a folder of .txt files",
        )
        return
    if not isinstance(dataset, ImageDatasetConfig):
        return
    root = Path(dataset.root).expanduser().resolve()
    if dataset.name is DatasetName.image_folder:
        check_image_folder(root)
    folder = TORCHVISION_DATA_DIRS.get(dataset.name)
    require(
        folder is None or dataset.download or (root / folder).is_dir(),
        f"dataset={dataset.name.value}: no copy under {root} (no {folder}/ there); set "
        "dataset.root to it, or dataset.download=true to fetch it",
    )


def require_cuda() -> None:
    """trainer.device=cuda needs a CUDA device that torch can use."""
    import torch  # only when a CUDA device is asked for: the other checks stay light

    require(
        torch.cuda.is_available(),
        f"trainer.device=cuda, but no CUDA device is available to torch {torch.__version__}; "
        "use trainer.device=auto or trainer.device=cpu",
    )


def check_job(run: RunConfig, environ: Mapping[str, str]) -> None:
    """Everything one job needs that its config alone cannot promise."""
    resolve_mode(run.wandb.mode, environ)
    check_data(run.dataset)
    if run.trainer.device is DeviceChoice.cuda:
        require_cuda()


def check_output_dir(key: str, value: str) -> None:
    """Hydra can create ``value`` (a run or sweep directory) and write into it.

    A directory is created and removed again in the nearest existing parent: only trying tells a
    read-only file system, /proc or a missing permission apart from a directory that works.
    """
    path = Path(value).expanduser()
    parent = path
    # os.path.exists, unlike Path.exists, says False instead of raising where access is denied.
    while not os.path.exists(parent) and parent != parent.parent:
        parent = parent.parent
    require(
        parent.is_dir(),
        f"{key}={value}: {parent} is a file, not a directory; choose another directory",
    )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".amp_exp-probe-", dir=parent))
    except OSError as error:
        raise ConfigError(
            f"{key}={value}: cannot create a directory in {parent} ({error.strerror}); "
            "choose a writable directory"
        ) from None
