"""Dataset schemas: one dataclass per family of data, registered in ``SCHEMAS["dataset"]``.

Images (synthetic, torchvision's sets, a folder) share ``ImageDatasetConfig``, whose ``name`` is
an enum; token data (synthetic_tokens, text) and the user's own data (custom) have a dataclass
each. A leaf like config/schema.py: it imports nothing from amp_exp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Union

from omegaconf import MISSING


class DatasetName(str, Enum):
    synthetic = "synthetic"
    cifar10 = "cifar10"
    cifar100 = "cifar100"
    mnist = "mnist"
    fashion_mnist = "fashion_mnist"
    image_folder = "image_folder"


class Tokenizer(str, Enum):
    # Byte-level: every file is text, the vocabulary is 256, nothing to download.
    bytes = "bytes"
    # GPT-2's BPE through tiktoken (optional extra), from files already cached.
    gpt2 = "gpt2"
    # A local Hugging Face tokenizer folder (dataset.tokenizer_path), through AutoTokenizer.
    hf = "hf"


# tokenizer=hf: the tokenizer's own length (config/hf.py).
TOKENIZER_VOCAB = {Tokenizer.bytes: 256, Tokenizer.gpt2: 50257}


@dataclass
class ImageDatasetConfig:
    """Image classification data: synthetic, torchvision's sets, or a folder of images."""

    name: DatasetName = DatasetName.synthetic
    # Torchvision datasets and image_folder read from here (relative to the launch directory).
    root: str = "data"
    download: bool = False
    batch_size: int = field(default=128, metadata={"bound": "positive"})
    # null = the training batch size.
    eval_batch_size: int | None = field(default=None, metadata={"bound": "positive_or_null"})
    num_workers: int = field(default=2, metadata={"bound": "at_least_0"})
    # Synthetic data: how many images of what shape, and how many classes.
    num_classes: int = field(default=10, metadata={"bound": "positive"})
    image_size: int = field(default=32, metadata={"bound": "positive"})
    channels: int = field(default=3, metadata={"bound": "positive"})
    train_size: int = field(default=4096, metadata={"bound": "positive"})
    eval_size: int = field(default=1024, metadata={"bound": "positive"})
    # Synthetic images are a smooth class prototype plus this much Gaussian noise; higher is harder.
    noise_std: float = field(default=4.0, metadata={"bound": "at_least_0"})
    # image_folder without train/ and val/ sub-directories holds out this fraction for eval.
    eval_fraction: float = field(default=0.1, metadata={"bound": "open_unit"})


@dataclass
class SyntheticTokensConfig:
    """Token sequences from a fixed, seeded, sparse random Markov chain, resident on the device.

    Each token can be followed by ``branching`` others, so the best possible loss (the chain's
    entropy, recorded as loss_floor) lies far below ln(vocab_size).
    """

    name: str = "synthetic_tokens"
    # Sequences per batch and rank.
    batch_size: int = field(default=32, metadata={"bound": "positive"})
    # null = the training batch size.
    eval_batch_size: int | None = field(default=None, metadata={"bound": "positive_or_null"})
    # Tokens a model sees per sequence; null = the model's seq_len (gpt), or for model=hf its
    # max_position_embeddings up to 1,024 (config/hf.py DEFAULT_SEQ_LEN).
    seq_len: int | None = field(default=None, metadata={"bound": "positive_or_null"})
    vocab_size: int = 128
    branching: int = 4
    # Sequences in each split.
    train_size: int = field(default=2048, metadata={"bound": "positive"})
    eval_size: int = field(default=256, metadata={"bound": "positive"})


@dataclass
class TextDatasetConfig:
    """A text file, or a folder of .txt files, tokenized once and cached; resident on the device."""

    name: str = "text"
    path: str = MISSING
    tokenizer: Tokenizer = Tokenizer.bytes
    # tokenizer=hf: a folder written by a tokenizer's save_pretrained (local_files_only).
    tokenizer_path: str | None = None
    # The last eval_fraction of the tokens is held out for evaluation.
    eval_fraction: float = field(default=0.1, metadata={"bound": "open_unit"})
    batch_size: int = field(default=32, metadata={"bound": "positive"})
    eval_batch_size: int | None = field(default=None, metadata={"bound": "positive_or_null"})
    seq_len: int | None = field(default=None, metadata={"bound": "positive_or_null"})
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
    batch_size: int = field(default=32, metadata={"bound": "positive"})
    eval_batch_size: int | None = field(default=None, metadata={"bound": "positive_or_null"})
    num_workers: int = field(default=0, metadata={"bound": "at_least_0"})
    # What the model is built for, which the samples alone do not say: num_classes for
    # task=classification, vocab_size for task=lm. The input shape (images) and seq_len (tokens)
    # are read from the first training sample.
    num_classes: int | None = field(default=None, metadata={"bound": "positive_or_null"})
    vocab_size: int | None = None


DatasetConfig = Union[
    ImageDatasetConfig, SyntheticTokensConfig, TextDatasetConfig, CustomDatasetConfig
]
TOKEN_DATASETS = (SyntheticTokensConfig, TextDatasetConfig)


def dataset_name(dataset: DatasetConfig) -> str:
    """The option a dataset was chosen by: image datasets name theirs with an enum."""
    return getattr(dataset.name, "value", dataset.name)
