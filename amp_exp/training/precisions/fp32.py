"""fp32: the reference every other precision is measured against; no autocast, no scaling."""

from __future__ import annotations

from amp_exp.config.precisions import BOTH_STRATEGIES, DType, Engagement, PrecisionSpec
from amp_exp.training.precisions.base import PrecisionPlugin


class Fp32(PrecisionPlugin):
    spec = PrecisionSpec(
        name="fp32",
        compute_dtype=DType.float32,
        autocast_dtype=None,
        weight_dtype=DType.float32,
        optimizer_state_dtype=DType.float32,
        grad_scaler=False,
        peak_math="fp32",
        probed_as="fp32",
        reduce_dtype=DType.float32,
        fsdp_param_dtype=None,
        strategies=BOTH_STRATEGIES,
        engaged=Engagement(1.0, (DType.float32,)),
        order=0,
        colour="#4c72b0",
        auto_candidate=True,
        autocast_family=True,
    )


PLUGIN = Fp32
