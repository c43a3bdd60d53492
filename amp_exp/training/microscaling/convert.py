"""Which linear layers compute in a block-scaled format, and the swap that makes them.

The layers are those fp8 converts (``linears.plan_linears``: by name and shape, outside
``precision.keep_fp32``), less, for NVFP4's recipe, every linear inside the last N of the model's
blocks (NVIDIA keeps the last blocks in bf16), and less transformers' ``Conv1D`` layers, which fp8
converts but the block-scaled layers here (built on ``nn.Linear``'s [out, in] weight) do not.
Emulated, each becomes a ``MicroscalingLinear``.
With torchao's kernels (MXFP8 on compute capability 10.0+), each becomes torchao's own
``MXFP8Linear``, which casts and multiplies on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from amp_exp.tasks.blocks import model_blocks
from amp_exp.training.keep_fp32 import is_within
from amp_exp.training.linears import LinearConversion, is_conv1d, plan_linears, swap_linears
from amp_exp.training.microscaling.linear import Recipe


def plan(
    model: nn.Module, skip: Sequence[str], keep_fp32: Sequence[str], bf16_last_blocks: int
) -> LinearConversion:
    """fp8's choice of linears, less those inside the last ``bf16_last_blocks`` blocks."""
    fp8 = plan_linears(model, skip, keep_fp32=keep_fp32)
    chosen = LinearConversion(True, [], dict(fp8.skipped))
    last: list[str] = []
    if bf16_last_blocks:
        blocks = model_blocks(model)
        if blocks is not None:
            names = {id(module): name for name, module in model.named_modules()}
            last = [names[id(block)] for block in list(blocks)[-bf16_last_blocks:]]
    for name in fp8.converted:
        if is_conv1d(model.get_submodule(name)):
            chosen.skipped[name] = "a transformers Conv1D, which block-scaled formats leave alone"
        elif is_within(name, last):
            chosen.skipped[name] = f"in one of the last {bf16_last_blocks} blocks"
        else:
            chosen.converted.append(name)
    return chosen


def with_kernels(model: nn.Module, names: list[str], recipe: Recipe) -> nn.Module:
    """torchao's ``MXFP8Linear`` (its CUDA and Triton casts, cuBLAS's block-scaled matmuls) in
    place of each named linear. Only reached on compute capability 10.0+ (Blackwell); no
    machine here has one, so this path is untested here."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    return swap_linears(
        model,
        names,
        MXFP8Linear,
        kernel_preference=KernelPreference.AUTO,
        scale_calculation_mode=recipe.scale_mode,
        wgrad_with_hp=recipe.wgrad_high_precision,
    )
