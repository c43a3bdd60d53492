"""Model preparation for the precisions beyond autocast: pure bf16 (bf16_true) and fp8.

``to_bf16_true`` stores the model in bf16, apart from normalization layers (and modules that set
``keep_in_fp32 = True``), which keep fp32 parameters, buffers and arithmetic. Why the norms:
BatchNorm's running statistics are moving averages whose small increments round away in bf16,
as weight updates do, and reductions over a whole batch or feature dimension lose digits in
bf16; their parameters are a tiny share of any model, so bf16 would save almost nothing.
PyTorch does run BatchNorm in bf16; keeping it fp32 is the safer of two working choices.

The model takes float inputs in bf16 and hands back fp32 outputs, so the loss is computed from
fp32 logits (cross-entropy's log-sum-exp over many classes loses digits in bf16).

``convert_to_fp8`` swaps the eligible ``nn.Linear`` layers for torchao's ``Float8Linear``; the
rest of the model runs under bf16 autocast, as in ``precision=bf16``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from amp_exp.config.schema import PrecisionConfig

NORM_LAYERS = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)
# Float8 matmuls need both dimensions of the weight to be multiples of 16.
FP8_DIM_MULTIPLE = 16


def _cast_floats(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(item, dtype) for item in value)
    return value


def _cast_inputs(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return _cast_floats(args, dtype)

    return hook


def _cast_output(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple, output):
        return _cast_floats(output, dtype)

    return hook


def _to_bf16(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor


def keeps_fp32(module: nn.Module) -> bool:
    return isinstance(module, NORM_LAYERS) or getattr(module, "keep_in_fp32", False)


def to_bf16_true(model: nn.Module) -> nn.Module:
    """The model in bf16, its norm layers in fp32, taking bf16 inputs and giving fp32 outputs."""
    kept = [m for m in model.modules() if keeps_fp32(m) and m is not model]
    inside_kept = {id(sub) for module in kept for sub in module.modules()}
    for module in model.modules():
        if id(module) not in inside_kept:
            # Only the module's own tensors: a kept module is never rounded through bf16, which
            # would lose digits of loaded weights and of buffers such as rotary frequencies.
            module._apply(_to_bf16, recurse=False)
    for module in kept:
        module.register_forward_pre_hook(_cast_inputs(torch.float32))
        # Back to bf16 for the layer after it, whose weights are bf16.
        module.register_forward_hook(_cast_output(torch.bfloat16))
    model.register_forward_pre_hook(_cast_inputs(torch.bfloat16))
    model.register_forward_hook(_cast_output(torch.float32))
    return model


@dataclass
class Fp8Conversion:
    """Which linear layers run their matmuls in fp8, and why the others do not."""

    emulated: bool
    converted: list[str] = field(default_factory=list)
    # Layer name -> why it stays in bf16.
    skipped: dict[str, str] = field(default_factory=dict)


def plan_fp8(model: nn.Module, skip_first_last: bool) -> Fp8Conversion:
    """Choose the linear layers to convert, as torchtitan does: every linear whose dimensions
    are multiples of 16, except (by default) the first and the last, whose precision matters
    most for the loss and whose shapes rarely pay for the casts."""
    plan = Fp8Conversion(emulated=False)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for index, name in enumerate(linears):
        out_features, in_features = model.get_submodule(name).weight.shape
        if in_features % FP8_DIM_MULTIPLE or out_features % FP8_DIM_MULTIPLE:
            plan.skipped[name] = f"{in_features}x{out_features} not multiples of {FP8_DIM_MULTIPLE}"
        elif skip_first_last and index == 0:
            plan.skipped[name] = "first layer"
        elif skip_first_last and index == len(linears) - 1:
            plan.skipped[name] = "last layer"
        else:
            plan.converted.append(name)
    return plan


def convert_to_fp8(model: nn.Module, cfg: PrecisionConfig) -> tuple[nn.Module, Fp8Conversion]:
    """Swap the planned linears for torchao ``Float8Linear`` (in place, weights kept)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    plan = plan_fp8(model, cfg.fp8_skip_first_last)
    plan.emulated = cfg.fp8_emulate
    config = Float8LinearConfig.from_recipe_name(cfg.fp8_recipe.value)
    config = dataclasses.replace(config, emulate=cfg.fp8_emulate)
    chosen = set(plan.converted)
    model = convert_to_float8_training(
        model, module_filter_fn=lambda _, name: name in chosen, config=config
    )
    return model, plan
