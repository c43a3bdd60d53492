"""The rules of the predict section (``python -m amp_exp.predict``'s settings, whose schema,
``PredictConfig``, lives in config/schema.py with every other section's). Imports no torch."""

from __future__ import annotations

from amp_exp.config.devices import PREDICTABLE
from amp_exp.config.schema import Precision, PredictConfig
from amp_exp.errors import require

# Every resolved precision has a row in the precision table; auto is decided on hardware at hand.
PREDICTABLE_PRECISIONS = tuple(p for p in Precision if p is not Precision.auto)


def validate_predict(predict: PredictConfig) -> None:
    """Raise ``ConfigError`` on the first predict value that cannot run."""
    require(bool(predict.devices), "predict.devices must name a device, e.g. [h100]")
    for device in predict.devices:
        require(
            device in PREDICTABLE,
            f"predict.devices: {device} is not in the device table; valid choices: "
            f"{', '.join(PREDICTABLE)}",
        )
    for precision in predict.precisions:
        require(
            precision in PREDICTABLE_PRECISIONS,
            f"predict.precisions: {precision.value} is chosen on the hardware at hand, not "
            f"predicted; valid choices: {', '.join(p.value for p in PREDICTABLE_PRECISIONS)}",
        )
    require(predict.world_size >= 1, f"predict.world_size={predict.world_size} must be 1 or more")
    require(
        predict.interconnect_gb_per_s > 0,
        f"predict.interconnect_gb_per_s={predict.interconnect_gb_per_s} must be positive",
    )
