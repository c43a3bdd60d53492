"""nvfp4: NVIDIA's 4-bit format in the linears fp8 converts (E2M1 elements in 16-element blocks,
E4M3 scales under an fp32 scale per tensor) in all three matmuls, with the parts of NVIDIA's
pretraining recipe (2025) each on its own switch; the rest under bf16 autocast, over fp32 master
weights. torchao trains in it on no device, so it runs emulated (precision.emulate=true)."""

from __future__ import annotations

from dataclasses import dataclass

from amp_exp.config.precisions import DType
from amp_exp.training.microscaling.plugin import MicroscalingPlugin, microscaling_spec
from amp_exp.training.precisions.base import LinearOptions


@dataclass
class Nvfp4Options(LinearOptions):
    # A random 16x16 Hadamard transform of the weight gradient's operands along the tokens.
    hadamard_wgrad: bool = True
    # One scale per 16x16 weight tile, so the forward and the backward see the same weight.
    weight_tiles: bool = True
    # Gradients rounded stochastically (unbiased), not to nearest.
    stochastic_gradients: bool = True
    # The linears of the model's last N blocks (model.blocks) kept in bf16.
    bf16_last_blocks: int = 0
    # The weight gradient's matmul on the unquantized operands, in bf16.
    wgrad_high_precision: bool = False


class Nvfp4(MicroscalingPlugin):
    elements = DType.nvfp4
    Options = Nvfp4Options
    spec = microscaling_spec("nvfp4", (DType.nvfp4,), peak_math="fp4", order=7, colour="#ccb974")


PLUGIN = Nvfp4
