"""fp16: autocast in fp16 over fp32 master weights, with dynamic loss scaling (GradScaler),
since fp16's narrow exponent range lets small gradients underflow."""

from __future__ import annotations

from amp_exp.config.precisions import BOTH_STRATEGIES, DType, Engagement, PrecisionSpec
from amp_exp.training.precisions.base import PrecisionPlugin


class Fp16(PrecisionPlugin):
    spec = PrecisionSpec(
        name="fp16",
        compute_dtype=DType.float16,
        autocast_dtype=DType.float16,
        weight_dtype=DType.float32,
        optimizer_state_dtype=DType.float32,
        grad_scaler=True,
        peak_math="fp16",
        probed_as="fp16",
        reduce_dtype=DType.float32,
        fsdp_param_dtype=DType.float16,
        strategies=BOTH_STRATEGIES,
        engaged=Engagement(0.5, (DType.float16,)),
        order=2,
        colour="#dd8452",
        auto_candidate=True,
        autocast_family=True,
        rankable=True,
        repair_to="bf16",
    )


PLUGIN = Fp16
