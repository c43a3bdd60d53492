"""bf16: autocast in bf16 over fp32 master weights; fp32's exponent range, so no loss scaling."""

from __future__ import annotations

from amp_exp.config.precisions import DType, Engagement, PrecisionSpec
from amp_exp.training.precisions.base import PrecisionPlugin


class Bf16(PrecisionPlugin):
    spec = PrecisionSpec(
        name="bf16",
        order=1,
        colour="#55a868",
        compute_dtype=DType.bfloat16,
        autocast_dtype=DType.bfloat16,
        peak_math="bf16",
        probed_as="bf16",
        fsdp_param_dtype=DType.bfloat16,
        engaged=Engagement(0.5, (DType.bfloat16,)),
        auto_candidate=True,
        autocast_family=True,
        rankable=True,
        needs_native_bf16=True,
    )


PLUGIN = Bf16
