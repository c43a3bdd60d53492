"""fp32: the reference every other precision is measured against; no autocast, no scaling."""

from __future__ import annotations

from amp_exp.config.precisions import REFERENCE, PrecisionSpec
from amp_exp.training.precisions.base import PrecisionPlugin


class Fp32(PrecisionPlugin):
    # PrecisionSpec's defaults are this precision's facts.
    spec = PrecisionSpec(
        name=REFERENCE,
        order=0,
        colour="#4c72b0",
        probed_as=REFERENCE,
        auto_candidate=True,
        autocast_family=True,
    )


PLUGIN = Fp32
