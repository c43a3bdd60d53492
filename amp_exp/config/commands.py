"""The sections of the commands other than training, and their rules: ``speed.*``
(``python -m amp_exp.speed`` and a sweep's trial), ``sensitivity.*`` and ``predict.*``. Their
schemas live in config/schema.py with every other section's; conf/<section>/default.yaml selects
each, and a training run carries them and ignores them. A new command's values are checked here.
Imports no torch.
"""

from __future__ import annotations

import dataclasses

from amp_exp.config.adaptive import EvidenceConfig
from amp_exp.config.devices import PREDICTABLE
from amp_exp.config.precision_checks import validate_precision
from amp_exp.config.schema import (
    Precision,
    PrecisionConfig,
    PredictConfig,
    SensitivityConfig,
    SpeedConfig,
    TrainerConfig,
)
from amp_exp.errors import require

# The speed trial's warm-up ends when the median steps of two consecutive windows of this many
# steps agree within 5% (training/timing.py).
SPEED_WARMUP_WINDOW = 5
# The fewest rounds for the speedup's t interval to be of any use (t(0.975, 5) = 2.57; at 4
# rounds it is 3.18).
MIN_SPEED_ROUNDS = 6
# The precisions whose per-module error against fp32 the command measures.
RANKABLE = (Precision.fp16, Precision.bf16, Precision.fp8)
# When neither sensitivity.precisions nor a rankable precision= says which.
DEFAULT_PRECISIONS = (Precision.fp16, Precision.bf16)


def target_precisions(sensitivity: SensitivityConfig, precision: Precision) -> list[Precision]:
    """The precisions to rank, in order: the first is the one repair targets."""
    if sensitivity.precisions:
        return list(dict.fromkeys(sensitivity.precisions))
    return [precision] if precision in RANKABLE else list(DEFAULT_PRECISIONS)


def validate_sensitivity(
    sensitivity: SensitivityConfig, precision: PrecisionConfig, trainer: TrainerConfig
) -> None:
    """Raise ``ConfigError`` on the first sensitivity value that cannot run."""
    for name in ("batches", "show", "max_trials", "verify_steps"):
        value = getattr(sensitivity, name)
        require(value > 0, f"sensitivity.{name}={value} must be positive")
    require(sensitivity.max_skipped_steps >= 0, "sensitivity.max_skipped_steps must be 0 or more")
    require(sensitivity.loss_tolerance > 0, "sensitivity.loss_tolerance must be positive")
    for chosen in target_precisions(sensitivity, precision.name):
        require(
            chosen in RANKABLE,
            f"sensitivity.precisions: {chosen.value} is not ranked against fp32; valid choices: "
            f"{', '.join(p.value for p in RANKABLE)}",
        )
        # fp8 needs what a run in fp8 needs: torchao, and a GPU or emulation.
        validate_precision(dataclasses.replace(precision, name=chosen), trainer)


def validate_evidence(evidence: EvidenceConfig) -> None:
    """Raise ``ConfigError`` on an evidence sweeper's plan that cannot look."""
    require(
        evidence.min_seeds >= 2,
        f"evidence.min_seeds={evidence.min_seeds} must be 2 or more: one seed measures no noise",
    )
    require(
        evidence.max_seeds >= evidence.min_seeds,
        f"evidence.max_seeds={evidence.max_seeds} must be at least evidence.min_seeds="
        f"{evidence.min_seeds}",
    )


def validate_speed(speed: SpeedConfig) -> None:
    """Raise ``ConfigError`` on the first speed value that cannot run."""
    require(
        speed.max_warmup_steps >= 2 * SPEED_WARMUP_WINDOW,
        f"speed.max_warmup_steps={speed.max_warmup_steps} must be {2 * SPEED_WARMUP_WINDOW} or "
        f"more: warm-up compares two windows of {SPEED_WARMUP_WINDOW} steps",
    )
    require(speed.steps > 0, f"speed.steps={speed.steps} must be positive")
    require(
        speed.rounds >= MIN_SPEED_ROUNDS and speed.rounds % 2 == 0,
        f"speed.rounds={speed.rounds} must be even and {MIN_SPEED_ROUNDS} or more: each side "
        "runs first in half the rounds",
    )
    require(
        speed.max_rounds >= speed.rounds and speed.max_rounds % 2 == 0,
        f"speed.max_rounds={speed.max_rounds} must be even and at least speed.rounds="
        f"{speed.rounds}: the trial stops at the first look that knows, or there",
    )
    require(
        speed.target_halfwidth > 0,
        f"speed.target_halfwidth={speed.target_halfwidth} must be positive (ln 1.05 = 0.0488: "
        "the speedup within 5%)",
    )
    require(
        speed.compile is None or bool(speed.compile),
        "speed.compile must list [false], [true] or [false,true], or be null",
    )
    require(
        bool(speed.precisions) and Precision.auto not in speed.precisions,
        "speed.precisions must list precisions to time, e.g. speed.precisions=[fp32,bf16]; "
        f"valid choices: {', '.join(p.value for p in Precision if p is not Precision.auto)}",
    )


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
