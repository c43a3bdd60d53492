"""fp16: autocast in fp16 over fp32 master weights, with dynamic loss scaling (GradScaler),
since fp16's narrow exponent range lets small gradients underflow."""

from __future__ import annotations

from amp_exp.config.precisions import DType, Engagement, PrecisionSpec
from amp_exp.training.precisions.base import PrecisionPlugin


class Fp16(PrecisionPlugin):
    spec = PrecisionSpec(
        name="fp16",
        order=2,
        colour="#dd8452",
        compute_dtype=DType.float16,
        autocast_dtype=DType.float16,
        grad_scaler=True,
        peak_math="fp16",
        probed_as="fp16",
        fsdp_param_dtype=DType.float16,
        engaged=Engagement(0.5, (DType.float16,)),
        auto_candidate=True,
        autocast_family=True,
        rankable=True,
        repair_to="bf16",
    )


PLUGIN = Fp16
