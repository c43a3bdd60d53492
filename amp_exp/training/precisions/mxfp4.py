"""mxfp4: OCP MX's 4-bit format in the linears fp8 converts (E2M1 elements in 32-element blocks,
E8M0 power-of-two scales) in all three matmuls; the rest under bf16 autocast, over fp32 master
weights. torchao trains in it on no device, so it runs emulated (precision.emulate=true)."""

from __future__ import annotations

from dataclasses import dataclass

from amp_exp.config.precisions import DType
from amp_exp.training.microscaling.plugin import MicroscalingPlugin, ScaleMode, microscaling_spec
from amp_exp.training.precisions.base import LinearOptions


@dataclass
class Mxfp4Options(LinearOptions):
    scale_mode: ScaleMode = ScaleMode.rceil
    # The weight gradient's matmul on the unquantized operands, in bf16.
    wgrad_high_precision: bool = False


class Mxfp4(MicroscalingPlugin):
    elements = DType.mxfp4
    Options = Mxfp4Options
    spec = microscaling_spec("mxfp4", (DType.mxfp4,), peak_math="fp4", order=6, colour="#da8bc3")


PLUGIN = Mxfp4
