"""Which linear layers a format converts (fp8's and the block-scaled formats' plans), and what a
linear layer is: an ``nn.Linear`` or transformers' ``Conv1D`` (GPT-2's: x @ W + b with W stored
[in, out], a Linear with its weight transposed).
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from amp_exp.training.keep_fp32 import is_within

# Float8 matmuls need both dimensions of the weight to be multiples of 16.
FP8_DIM_MULTIPLE = 16


def is_conv1d(module: nn.Module) -> bool:
    # transformers' Conv1D, where transformers is loaded (only its models hold one).
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return conv1d is not None and isinstance(module, conv1d)


def is_linear(module: nn.Module) -> bool:
    """A layer whose matmul fp8 converts: an ``nn.Linear`` or a transformers ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def linear_features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear layer (``is_linear``)."""
    rows, columns = module.weight.shape
    return (rows, columns) if is_conv1d(module) else (columns, rows)


@dataclass
class LinearConversion:
    """Which linear layers run their matmuls in fp8 or a block-scaled format, and why the others
    do not."""

    emulated: bool
    converted: list[str] = field(default_factory=list)
    # Layer name -> why it stays in bf16.
    skipped: dict[str, str] = field(default_factory=dict)


def plan_linears(
    model: nn.Module,
    skip: Sequence[str],
    skip_small_for: str | None = None,
    keep_fp32: Sequence[str] = (),
) -> LinearConversion:
    """Choose the linear layers to convert by their fully qualified names and shapes, as
    torchtitan does (torchao's ``module_filter_fn``): every linear whose dimensions are
    multiples of 16, except those inside a ``keep_fp32`` module, those a pattern of ``skip``
    names (fnmatch) and, for the recipe ``skip_small_for``, those torchao's auto filter expects
    no speed-up from."""
    too_small = None
    if skip_small_for is not None:
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

        too_small = _auto_filter_for_recipe(skip_small_for, filter_fqns=[])
    plan = LinearConversion(emulated=False)
    # nn.MultiheadAttention multiplies by its out_proj's weight in F.multi_head_attention_forward,
    # never calling the layer: converted, it would run in bf16 under fp8's name.
    functional = {
        f"{name}.out_proj" if name else "out_proj"
        for name, module in model.named_modules()
        if isinstance(module, nn.MultiheadAttention)
    }
    for name, module in model.named_modules():
        if not is_linear(module):
            continue
        if name in functional:
            plan.skipped[name] = "nn.MultiheadAttention's, which it never calls as a layer"
            continue
        in_features, out_features = linear_features(module)
        shape = f"{in_features}x{out_features}"
        named = [pattern for pattern in skip if fnmatch.fnmatchcase(name, pattern)]
        if is_within(name, keep_fp32):
            plan.skipped[name] = "precision.keep_fp32"
        elif named:
            plan.skipped[name] = f"precision.options.skip: {named[0]}"
        elif in_features % FP8_DIM_MULTIPLE or out_features % FP8_DIM_MULTIPLE:
            plan.skipped[name] = f"{shape} not multiples of {FP8_DIM_MULTIPLE}"
        elif too_small is not None and not too_small(as_linear_shape(module), name):
            plan.skipped[name] = f"{shape} below torchao's {skip_small_for} size thresholds"
        else:
            plan.converted.append(name)
    return plan


def as_linear_shape(module: nn.Module) -> nn.Module:
    """``module`` as torchao's size filters take it: an ``nn.Linear`` (on the meta device, for
    its shape alone) where it is a ``Conv1D``."""
    return nn.Linear(*linear_features(module), device="meta") if is_conv1d(module) else module


def replacement(linear: nn.Module, layer_class: type[nn.Module], **options: Any) -> nn.Module:
    """A ``layer_class(in, out, bias, **options)`` holding the linear layer's own parameters
    (those the optimizer and FSDP2 know, a ``Conv1D``'s weight as stored), built on the meta
    device so nothing is initialised twice."""
    with torch.device("meta"):
        layer = layer_class(*linear_features(linear), bias=linear.bias is not None, **options)
    layer.weight, layer.bias = linear.weight, linear.bias
    return layer


def swap_linears(
    model: nn.Module, names: Sequence[str], layer_class: type[nn.Module], **options: Any
) -> nn.Module:
    """The named linear layers replaced by ``layer_class`` ones (in place)."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, replacement(getattr(parent, child), layer_class, **options))
    return model
