"""fp16: autocast in fp16 over fp32 master weights, with dynamic loss scaling (GradScaler),
since fp16's narrow exponent range lets small gradients underflow."""

from __future__ import annotations

from amp_exp.config.precisions import DType
from amp_exp.training.precisions.base import PrecisionPlugin, autocast_spec


class Fp16(PrecisionPlugin):
    spec = autocast_spec("fp16", DType.float16, 2, "#dd8452", grad_scaler=True, repair_to="bf16")


PLUGIN = Fp16
