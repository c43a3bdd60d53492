"""A user's own models and data, as they would write them: tests import them by _target_."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_classifier(input_shape: tuple[int, ...], num_classes: int, hidden: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


class TinyLM(nn.Module):
    """An embedding and a linear head: enough to learn which token follows which."""

    def __init__(self, vocab_size: int, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def make_lm(vocab_size: int, width: int = 16) -> nn.Module:
    return TinyLM(vocab_size, width)


def make_anything(**facts) -> nn.Module:
    """Takes every fact offered; remembers them for the test to read."""
    model = nn.LazyLinear(facts.get("num_classes", 1))
    model.facts = facts
    return nn.Sequential(nn.Flatten(), model)


def make_wrong_width(num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes + 1))


def make_labelled_vectors(seed: int, size: int = 96, classes: int = 3):
    """(train, eval) of 8-dimensional points whose class is the sign pattern of their mean."""
    generator = torch.Generator().manual_seed(seed)
    splits = []
    for count in (size, size // 2):
        labels = torch.randint(classes, (count,), generator=generator)
        points = torch.randn(count, 8, generator=generator) + 2.0 * labels[:, None]
        splits.append(TensorDataset(points, labels))
    return tuple(splits)


def make_counting(vocab_size: int = 11, seq_len: int = 8, size: int = 64):
    """(train, eval) of sequences that count up modulo vocab_size: target = input + 1."""
    starts = torch.arange(size) % vocab_size
    inputs = (starts[:, None] + torch.arange(seq_len)) % vocab_size
    dataset = TensorDataset(inputs, (inputs + 1) % vocab_size)
    return dataset, dataset


def make_token_labels(seed: int, vocab_size: int = 16, seq_len: int = 8, size: int = 64):
    """(train, eval) of token sequences labelled by whether their first token is even."""
    generator = torch.Generator().manual_seed(seed)
    splits = []
    for count in (size, size // 2):
        tokens = torch.randint(vocab_size, (count, seq_len), generator=generator)
        splits.append(TensorDataset(tokens, tokens[:, 0] % 2))
    return tuple(splits)


def make_transformers_gpt2(vocab_size: int) -> nn.Module:
    """A transformers model as a user would hand it over: it returns a ModelOutput."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=vocab_size)
    return AutoModelForCausalLM.from_config(config)
