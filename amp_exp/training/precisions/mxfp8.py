"""mxfp8: OCP MX's 8-bit format in the linears fp8 converts (E4M3 elements in 32-element blocks,
E8M0 power-of-two scales), torchao's MX training recipe in all three matmuls; the rest under bf16
autocast, over fp32 master weights. Real on compute capability 10.0+ (torchao's kernels), else
emulated with precision.emulate=true."""

from __future__ import annotations

from dataclasses import dataclass

from amp_exp.config.precisions import DType
from amp_exp.training.microscaling.plugin import MicroscalingPlugin, ScaleMode, microscaling_spec
from amp_exp.training.precisions.base import LinearOptions


@dataclass
class Mxfp8Options(LinearOptions):
    scale_mode: ScaleMode = ScaleMode.rceil
    # Gradients in E5M2 (more range, less precision) rather than torchao's E4M3.
    e5m2_gradients: bool = False
    # The weight gradient's matmul on the unquantized operands, in bf16.
    wgrad_high_precision: bool = False


class Mxfp8(MicroscalingPlugin):
    elements = DType.mxfp8_e4m3
    Options = Mxfp8Options
    spec = microscaling_spec(
        "mxfp8", (DType.mxfp8_e4m3, DType.mxfp8_e5m2), peak_math="fp8", order=5, colour="#937860"
    )

    def gradients(self) -> DType:
        return DType.mxfp8_e5m2 if self.options.e5m2_gradients else DType.mxfp8_e4m3


PLUGIN = Mxfp8
