"""Linear layers whose three matmuls run on block-scaled operands, emulated: each operand is
quantized and dequantized by torchao's casts (microscaling.formats), then multiplied in fp32, as
the hardware accumulates.

The three matmuls follow torchao's MX training recipe (``torchao.prototype.moe_training.
mxfp8_linear.mx_mm``), each operand blocked along the dimension its matmul sums over:

1. forward:  out = x @ Wᵀ, x and W in blocks along in_features;
2. backward: grad_x = grad_out @ W, grad_out and W in blocks along out_features;
3. backward: grad_W = grad_outᵀ @ x, both in blocks along the tokens; with
   ``wgrad_high_precision`` it runs on the unquantized operands, in their own dtype.

NVFP4's training recipe (NVIDIA 2025) adds, each on its own switch: a random Hadamard transform
of matmul 3's operands along the tokens (spreading outliers across a block; the product is
unchanged, as the rotation is orthogonal), 16x16 weight tiles (matmuls 1 and 2 then see the same
quantized weight) and stochastic rounding of the gradients (grad_out, in matmuls 2 and 3).

Each matmul runs under ``computed_as`` with its format, so the precision audit counts its
FLOPs as, say, ``mxfp8_e4m3`` rather than as the fp32 of the emulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchao.prototype.mx_formats.config import ScaleCalculationMode

from amp_exp.config.precisions import DType
from amp_exp.training.audit.matmuls import computed_as
from amp_exp.training.microscaling.formats import hadamard_rotation, quantized, rotate_rows


@dataclass(frozen=True)
class Recipe:
    """How a microscaling linear quantizes its operands."""

    # The format of activations and weights.
    elements: DType
    # The format of gradients (mxfp8: E4M3 as torchao's recipe, or E5M2 for their range).
    gradients: DType
    scale_mode: ScaleCalculationMode = ScaleCalculationMode.RCEIL
    wgrad_high_precision: bool = False
    # NVFP4 only.
    hadamard_wgrad: bool = False
    weight_tiles: bool = False
    stochastic_gradients: bool = False

    def __post_init__(self) -> None:
        nvfp4_only = self.hadamard_wgrad or self.weight_tiles or self.stochastic_gradients
        if nvfp4_only and self.elements is not DType.nvfp4:
            raise ValueError(
                "the Hadamard transform, 16x16 tiles and stochastic rounding are NVFP4's"
            )

    def weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as matmul 1 multiplies it (blocks along in_features, or tiles)."""
        return quantized(weight, self.elements, self.scale_mode, tiles=self.weight_tiles)

    def weight_for_grad_input(self, weight: torch.Tensor, forward: torch.Tensor) -> torch.Tensor:
        """The weight as matmul 2 multiplies it: blocks along out_features, or the forward's
        own tiles."""
        if self.weight_tiles:
            return forward
        return quantized(weight.t(), self.elements, self.scale_mode).t()

    def gradient(self, grad: torch.Tensor) -> torch.Tensor:
        return quantized(
            grad, self.gradients, self.scale_mode, stochastic=self.stochastic_gradients
        )


class _BlockScaledMatmuls(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            weight_q = recipe.weight(weight)
            with computed_as(recipe.elements.value):
                out = torch.mm(quantized(rows, recipe.elements, recipe.scale_mode), weight_q.t())
        ctx.save_for_backward(x, weight, weight_q if recipe.weight_tiles else None)
        ctx.recipe = recipe
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, weight_q = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        rows = x.reshape(-1, x.shape[-1])
        grads = grad_out.reshape(-1, grad_out.shape[-1])
        with torch.autocast(grad_out.device.type, enabled=False):
            with computed_as(recipe.gradients.value):
                grad_x = torch.mm(
                    recipe.gradient(grads), recipe.weight_for_grad_input(weight, weight_q)
                )
            grad_w = _grad_weight(recipe, grads, rows)
        return grad_x.reshape(x.shape).to(x.dtype), grad_w.to(weight.dtype), None


def _grad_weight(recipe: Recipe, grads: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """grad_outᵀ @ x, both blocked along the tokens (rows of each)."""
    if recipe.wgrad_high_precision:
        return torch.mm(grads.t(), rows.to(grads.dtype))
    grads, rows = grads.float(), rows.float()
    if recipe.hadamard_wgrad:
        rotation = hadamard_rotation(grads.device)
        grads, rows = rotate_rows(grads, rotation), rotate_rows(rows, rotation)
    with computed_as(recipe.gradients.value):
        return torch.mm(
            recipe.gradient(grads.t()), quantized(rows.t(), recipe.elements, recipe.scale_mode).t()
        )


class MicroscalingLinear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in a block-scaled format (emulated)."""

    def __init__(self, *args, recipe: Recipe, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recipe = recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As a GPU kernel would take it under autocast: in the autocast dtype.
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        out = _BlockScaledMatmuls.apply(x, self.weight, self.recipe)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, elements={self.recipe.elements.value}"
