"""bf16: autocast in bf16 over fp32 master weights; fp32's exponent range, so no loss scaling."""

from __future__ import annotations

from amp_exp.config.precisions import BOTH_STRATEGIES, DType, Engagement, PrecisionSpec
from amp_exp.training.precisions.base import PrecisionPlugin


class Bf16(PrecisionPlugin):
    spec = PrecisionSpec(
        name="bf16",
        compute_dtype=DType.bfloat16,
        autocast_dtype=DType.bfloat16,
        weight_dtype=DType.float32,
        optimizer_state_dtype=DType.float32,
        grad_scaler=False,
        peak_math="bf16",
        probed_as="bf16",
        # A sum of many low-precision gradients loses their small parts.
        reduce_dtype=DType.float32,
        fsdp_param_dtype=DType.bfloat16,
        strategies=BOTH_STRATEGIES,
        engaged=Engagement(0.5, (DType.bfloat16,)),
        order=1,
        colour="#55a868",
        auto_candidate=True,
        autocast_family=True,
        rankable=True,
        needs_native_bf16=True,
    )


PLUGIN = Bf16
