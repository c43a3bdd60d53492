"""A sample as the user's data gives it, and the model called on it as the user's code would.

A sample's inputs are one tensor (``model(x)``), a tuple of tensors (``model(*inputs)``) or a
dict of tensors (``model(**inputs)``). Its target is the second item of an ``(inputs, target)``
pair or, as Hugging Face datasets hold it, the dict's ``labels``, taken out of the inputs: the
model is never handed its labels, so it computes no loss of its own, and every precision is
judged by the task's one loss on the model's logits. A model's output is its logits, or a
``ModelOutput`` (or any dict) holding them under ``logits``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

Inputs = torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]

# Where a dict sample holds its target (transformers' name).
LABELS = "labels"
# The dict input that says how many samples and which token ids a batch holds, where a dict
# holds one of them (transformers' names); otherwise its first tensor.
PRIMARY_NAMES = ("input_ids", "pixel_values", "input_values", "inputs_embeds")


def split(sample: Any) -> tuple[Inputs, torch.Tensor]:
    """(inputs, target) of one sample or batch: an ``(inputs, target)`` pair, or a dict holding
    its target under ``labels``. A collated tuple of inputs comes back a list: a tuple again."""
    if isinstance(sample, Mapping):
        if LABELS not in sample:
            raise ValueError(
                f"a dict sample holds its target under {LABELS!r}; this one holds {sorted(sample)}"
            )
        return {key: value for key, value in sample.items() if key != LABELS}, sample[LABELS]
    inputs, target = sample
    return (tuple(inputs) if isinstance(inputs, list) else inputs), target


def primary(inputs: Inputs) -> torch.Tensor:
    """The input that counts the batch's samples (its first dimension) and holds a language
    model's token ids."""
    if isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, Mapping):
        named = next((inputs[name] for name in PRIMARY_NAMES if name in inputs), None)
        return named if named is not None else next(iter(inputs.values()))
    return inputs[0]


def with_primary(inputs: Inputs, tensor: torch.Tensor) -> Inputs:
    """``inputs`` with ``tensor`` in place of their primary input."""
    if isinstance(inputs, torch.Tensor):
        return tensor
    old = primary(inputs)
    if isinstance(inputs, Mapping):
        return {key: tensor if value is old else value for key, value in inputs.items()}
    return tuple(tensor if value is old else value for value in inputs)


def each_tensor(inputs: Inputs, fn: Callable[[torch.Tensor], torch.Tensor]) -> Inputs:
    """``fn`` applied to every tensor of ``inputs``, in the same structure."""
    return tree_map_only(torch.Tensor, fn, inputs)


def logits(output: Any) -> Any:
    """The logits in a model's output: the output itself, or a ``ModelOutput``'s or a dict's
    ``logits``. Anything else comes back as it is, for the task to say what it is."""
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    return output


def call(model: nn.Module, inputs: Inputs) -> Any:
    """The model's logits on ``inputs``, passed as its forward takes them."""
    if isinstance(inputs, Mapping):
        return logits(model(**inputs))
    if isinstance(inputs, tuple):
        return logits(model(*inputs))
    return logits(model(inputs))
