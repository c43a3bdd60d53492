"""Model preparation for the precisions beyond autocast: pure bf16 (bf16_true) and fp8.

``to_bf16_true`` stores the model in bf16, apart from normalization layers (and modules that set
``keep_in_fp32 = True`` or that ``precision.keep_fp32`` names), which keep fp32 parameters,
buffers and arithmetic. Why the norms:
BatchNorm's running statistics are moving averages whose small increments round away in bf16,
as weight updates do, and reductions over a whole batch or feature dimension lose digits in
bf16; their parameters are a tiny share of any model, so bf16 would save almost nothing.
PyTorch does run BatchNorm in bf16; keeping it fp32 is the safer of two working choices.

The model takes float inputs in bf16 and hands back fp32 outputs, so the loss is computed from
fp32 logits (cross-entropy's log-sum-exp over many classes loses digits in bf16).

``convert_to_fp8`` swaps the eligible linear layers for torchao's ``Float8Linear``; the rest of
the model runs under bf16 autocast, as in ``precision=bf16``. A linear layer is an ``nn.Linear``
or transformers' ``Conv1D`` (GPT-2's: x @ W + b with W stored [in, out], a Linear with its weight
transposed), which becomes a ``Float8Linear`` that takes that weight as it is stored, so its
parameter, its name and its layout stay what the optimizer and checkpoints know.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from amp_exp.config.schema import PrecisionConfig
from amp_exp.training.keep_fp32 import cast_floats, is_within, outermost

NORM_LAYERS = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)
# Float8 matmuls need both dimensions of the weight to be multiples of 16.
FP8_DIM_MULTIPLE = 16


def _cast_inputs(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast_floats(args, dtype), cast_floats(kwargs, dtype)

    return hook


def _cast_output(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple, output):
        return cast_floats(output, dtype)

    return hook


def _to_bf16(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor


def keeps_fp32(module: nn.Module) -> bool:
    return isinstance(module, NORM_LAYERS) or getattr(module, "keep_in_fp32", False)


def to_bf16_true(model: nn.Module, keep_fp32: Sequence[str] = ()) -> nn.Module:
    """The model in bf16, its norm layers and the ``keep_fp32`` modules in fp32, taking bf16
    inputs and giving fp32 outputs.

    Only the outermost fp32 modules are hooked: a norm inside a kept module takes fp32 from the
    layer before it and must hand fp32 to the layer after it.
    """
    fp32_names = [name for name, module in model.named_modules() if name and keeps_fp32(module)]
    kept = outermost([*fp32_names, *keep_fp32])
    for name, module in model.named_modules():
        if not is_within(name, kept):
            # Only the module's own tensors: a kept module is never rounded through bf16, which
            # would lose digits of loaded weights and of buffers such as rotary frequencies.
            module._apply(_to_bf16, recurse=False)
    for name in kept:
        module = model.get_submodule(name).float()
        module.register_forward_pre_hook(_cast_inputs(torch.float32), with_kwargs=True)
        # Back to bf16 for the layer after it, whose weights are bf16.
        module.register_forward_hook(_cast_output(torch.bfloat16))
    model.register_forward_pre_hook(_cast_inputs(torch.bfloat16), with_kwargs=True)
    model.register_forward_hook(_cast_output(torch.float32))
    return model


def conv1d_class() -> type[nn.Module] | None:
    """transformers' ``Conv1D``, where transformers is loaded (only its models hold one)."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def is_conv1d(module: nn.Module) -> bool:
    conv1d = conv1d_class()
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


def plan_fp8(
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
            plan.skipped[name] = f"precision.fp8_skip: {named[0]}"
        elif in_features % FP8_DIM_MULTIPLE or out_features % FP8_DIM_MULTIPLE:
            plan.skipped[name] = f"{shape} not multiples of {FP8_DIM_MULTIPLE}"
        elif too_small is not None and not too_small(as_linear_shape(module), name):
            plan.skipped[name] = f"{shape} below torchao's {skip_small_for} size thresholds"
        else:
            plan.converted.append(name)
    return plan


def convert_to_fp8(
    model: nn.Module, cfg: PrecisionConfig, keep_fp32: Sequence[str] = ()
) -> tuple[nn.Module, LinearConversion]:
    """Swap the planned linears for torchao ``Float8Linear`` (in place, weights kept)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = cfg.fp8_recipe.value
    skip_small_for = recipe if cfg.fp8_skip_small else None
    plan = plan_fp8(model, list(cfg.fp8_skip), skip_small_for, keep_fp32)
    plan.emulated = cfg.emulate
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=cfg.emulate)
    chosen = set(plan.converted)
    model = convert_to_float8_training(
        model, module_filter_fn=lambda _, name: name in chosen, config=config
    )
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, child)
        if is_conv1d(layer):
            setattr(parent, child, float8_conv1d(layer, config))
    for name in chosen:
        model.get_submodule(name).register_forward_pre_hook(_cast_to_cpu_autocast)
    return model, plan


def as_linear_shape(module: nn.Module) -> nn.Module:
    """``module`` as torchao's size filters take it: an ``nn.Linear`` (on the meta device, for
    its shape alone) where it is a ``Conv1D``."""
    if not is_conv1d(module):
        return module
    return nn.Linear(*linear_features(module), device="meta")


@functools.cache
def float8_conv1d_class() -> type[nn.Module]:
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    class Float8Conv1D(Float8Linear):
        """``Float8Linear`` holding a ``Conv1D``'s weight as stored, [in, out]: the operand
        ``Float8Linear.forward`` makes of its own [out, in] weight by transposing it."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            # As Float8Linear.forward (torchao 0.18), with the weight untransposed.
            if torch.is_autocast_enabled():
                input = input.to(torch.get_autocast_gpu_dtype())
            output = matmul_with_hp_or_float8_args.apply(
                input, self.weight, self.linear_mm_config, self.config
            )
            return output if self.bias is None else output + self.bias.to(output.dtype)

    return Float8Conv1D


def float8_conv1d(conv: nn.Module, config) -> nn.Module:
    """A ``Float8Conv1D`` holding ``conv``'s own parameters, built on the meta device so nothing
    is initialised twice."""
    with torch.device("meta"):
        layer = float8_conv1d_class()(*linear_features(conv), bias=False, config=config)
    layer.weight, layer.bias = conv.weight, conv.bias
    return layer


def _cast_to_cpu_autocast(module: nn.Module, args: tuple) -> tuple:
    """Float8Linear casts its input to the autocast dtype under CUDA's autocast only; emulated
    on the CPU it would take a first layer's fp32 input as it comes. Cast it as on a GPU."""
    if not torch.is_autocast_enabled("cpu"):
        return args
    return cast_floats(args, torch.get_autocast_dtype("cpu"))
