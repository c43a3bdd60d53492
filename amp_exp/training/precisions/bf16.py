"""bf16: autocast in bf16 over fp32 master weights; fp32's exponent range, so no loss scaling."""

from __future__ import annotations

from amp_exp.config.precisions import DType
from amp_exp.training.precisions.base import PrecisionPlugin, autocast_spec


class Bf16(PrecisionPlugin):
    spec = autocast_spec("bf16", DType.bfloat16, 1, "#55a868", needs_native_bf16=True)


PLUGIN = Bf16
