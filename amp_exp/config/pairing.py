"""Which models train on which data, and for which task: checked before anything is built.

Image models classify images; gpt models predict the next token. The task (``task=``) follows
from the dataset unless the dataset is the user's own; the user's own model fits either task, and
so does a Hugging Face model whose type has the auto class the data needs (config/hf.py).
Activation checkpointing recomputes transformer blocks, which amp_exp's own image models (tiny_cnn,
mlp) do not have; whether a torchvision, timm, hf or user model has them shows once it is built.
"""

from __future__ import annotations

from amp_exp.config import hf
from amp_exp.config.datasets import (
    TOKEN_DATASETS,
    TOKENIZER_VOCAB,
    CustomDatasetConfig,
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
from amp_exp.config.schema import RunConfig, TaskName
from amp_exp.errors import ConfigError

IMAGE_DATASETS = ", ".join(name.value for name in DatasetName)
VALID_PAIRINGS = (
    "valid pairings: image models (tiny_cnn, mlp, resnet18, resnet50, torchvision, timm) with "
    f"image datasets ({IMAGE_DATASETS}); gpt models (gpt_tiny, gpt2_small) with token datasets "
    "(synthetic_tokens, text); model=custom, model=hf and dataset=custom with either, by "
    "task=classification or task=lm"
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
    if (dataset.tokenizer is Tokenizer.hf) != (dataset.tokenizer_path is not None):
        raise ConfigError(
            "dataset.tokenizer=hf and dataset.tokenizer_path=DIR (a tokenizer folder written by "
            "save_pretrained) go together"
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
    if run.task is None and implied is None:
        raise ConfigError(
            f"dataset={data_name} needs task=classification or task=lm: your data does not say"
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
        if getattr(run.dataset, needed) is None:
            raise ConfigError(
                f"dataset=custom with task={task.value} needs dataset.{needed}=N: the model is "
                "built for it"
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
        if data_seq_len is not None and data_seq_len > model.seq_len:
            raise ConfigError(
                f"dataset.seq_len={data_seq_len} exceeds model.seq_len={model.seq_len}, the "
                "positions the model has"
            )
        if model.vocab_size is not None and vocab is not None and model.vocab_size < vocab:
            raise ConfigError(
                f"model.vocab_size={model.vocab_size} is smaller than the data's vocabulary "
                f"({vocab}); set it to at least that, or null to take the data's"
            )
    elif isinstance(model, HFModelConfig):
        _check_hf_token_sizes(model, data_seq_len, vocab)
    elif isinstance(dataset, TOKEN_DATASETS) and data_seq_len is None:
        raise ConfigError(
            f"dataset={dataset_name(dataset)} with model={model.name} needs dataset.seq_len=N "
            "(only gpt and hf models bring their own)"
        )


def _check_hf_token_sizes(model: HFModelConfig, data_seq_len: int | None, vocab: int | None):
    positions = hf.max_positions(model)
    if data_seq_len is None and positions is None:
        raise ConfigError(
            f"model.name={model.name} has no max_position_embeddings: set dataset.seq_len=N"
        )
    if data_seq_len is not None and positions is not None and data_seq_len > positions:
        raise ConfigError(
            f"dataset.seq_len={data_seq_len} exceeds the {model.name} config's "
            f"max_position_embeddings={positions}; set +model.config.max_position_embeddings or "
            "a shorter dataset.seq_len"
        )
    model_vocab = hf.model_vocab_size(model)
    if model_vocab is not None and vocab is not None and model_vocab < vocab:
        where = "model.path's config" if model.path else "model.config.vocab_size"
        raise ConfigError(
            f"the model's vocabulary ({model_vocab}, {where}) is smaller than the data's "
            f"({vocab}); they must match, or the model's be larger"
        )
