"""The sections of the commands other than training, and their rules: ``speed.*``
(``python -m amp_exp.speed`` and a sweep's trial), ``sensitivity.*`` and ``predict.*``. Their
schemas live in config/schema.py with every other section's; conf/<section>/default.yaml selects
each, and a training run carries them and ignores them. A new command's values are checked here.
Imports no torch.
"""

from __future__ import annotations

import dataclasses

from amp_exp.config.adaptive import EvidenceConfig
from amp_exp.config.precisions import AUTO, get, names, register, validate_precision
from amp_exp.config.schema import (
    PrecisionConfig,
    PredictConfig,
    SensitivityConfig,
    SpeedConfig,
    TrainerConfig,
)
from amp_exp.devices import PREDICTABLE
from amp_exp.errors import ConfigError, require

# The speed trial's warm-up ends when the step times of two consecutive windows of this many
# steps show no trend (training/timing.py).
SPEED_WARMUP_WINDOW = 5
# The fewest rounds for the speedup's interval to be of any use (its critical value, calibrated
# for autocorrelated rounds in capability/ratio.py, is 11 at 6 rounds and 23 at 4).
MIN_SPEED_ROUNDS = 6
# The fewest seeds whose paired differences give the verdict rule an interval.
MIN_VERIFY_SEEDS = 2


def rankable() -> list[str]:
    """The precisions whose per-module error against fp32 the command measures (their facts)."""
    return [name for name in names() if get(name).spec.rankable]


def default_precisions() -> list[str]:
    """When neither sensitivity.precisions nor a rankable precision= says which: the rankable
    ones precision=auto may choose, those with a GradScaler (the narrowest range, where most
    layers fail) first, so repair targets them."""
    chosen = [name for name in rankable() if get(name).spec.auto_candidate]
    return sorted(chosen, key=lambda name: not get(name).spec.grad_scaler)


def target_precisions(sensitivity: SensitivityConfig, precision: str) -> list[str]:
    """The precisions to rank, in order: the first is the one repair targets."""
    if sensitivity.precisions:
        return list(dict.fromkeys(sensitivity.precisions))
    return [precision] if precision in rankable() else default_precisions()


def validate_sensitivity(
    sensitivity: SensitivityConfig, precision: PrecisionConfig, trainer: TrainerConfig
) -> None:
    """Raise ``ConfigError`` on the first sensitivity value that cannot run."""
    for name in ("batches", "show", "max_trials", "verify_steps", "verify_growth_interval"):
        value = getattr(sensitivity, name)
        require(value > 0, f"sensitivity.{name}={value} must be positive")
    # One seed measures no noise: the verdict rule gives single_seed, never matches.
    require(
        sensitivity.verify_seeds >= MIN_VERIFY_SEEDS,
        f"sensitivity.verify_seeds={sensitivity.verify_seeds} must be {MIN_VERIFY_SEEDS} or more: "
        "one seed measures no noise, so no verdict can verify a repair",
    )
    require(
        sensitivity.max_verify_seeds >= sensitivity.verify_seeds,
        f"sensitivity.max_verify_seeds={sensitivity.max_verify_seeds} must be at least "
        f"sensitivity.verify_seeds={sensitivity.verify_seeds}",
    )
    require(
        sensitivity.verify_steps >= 2 * sensitivity.verify_growth_interval,
        f"sensitivity.verify_steps={sensitivity.verify_steps} must be at least twice "
        f"sensitivity.verify_growth_interval={sensitivity.verify_growth_interval}, so that fp16's "
        "loss scale grows within a verification run",
    )
    require(
        sensitivity.tolerance is None or sensitivity.tolerance > 0,
        f"sensitivity.tolerance={sensitivity.tolerance} must be positive (or null: the task's)",
    )
    if precision._target_ is not None:
        register(precision._target_)
    for chosen in target_precisions(sensitivity, precision.name):
        require(
            chosen in rankable(),
            f"sensitivity.precisions: {chosen} is not ranked against fp32; valid choices: "
            f"{', '.join(rankable())}",
        )
        # fp8 needs what a run in fp8 needs: torchao, and a GPU or emulation. The run's options
        # are its own precision's; another ranked precision takes its defaults.
        options = precision.options if chosen == precision.name else {}
        validate_precision(dataclasses.replace(precision, name=chosen, options=options), trainer)


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


def check_resumed_plan(evidence: EvidenceConfig, recorded: object) -> None:
    """Raise ``ConfigError`` unless an evidence sweep resumed with ``evidence`` keeps the plan it
    recorded (evidence.json's ``plan``): the same min_seeds, and max_seeds no higher. The looks
    planned set every look's level; more seeds would add looks the level did not pay for."""
    plan = recorded if isinstance(recorded, dict) else {}
    before = (plan.get("min_seeds"), plan.get("max_seeds"))
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in before):
        raise ConfigError(
            f"evidence.json holds no plan this sweep can read ({plan!r}); resume only a sweep "
            "amp_exp wrote there, or start a new sweep"
        )
    if evidence.max_seeds > before[1] or evidence.min_seeds != before[0]:
        raise ConfigError(
            f"evidence.min_seeds={evidence.min_seeds} evidence.max_seeds={evidence.max_seeds}: "
            f"this sweep was planned with min_seeds={before[0]} and max_seeds={before[1]}, and "
            "its looks' level holds only for those; resume it with them, or start a new sweep"
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
        bool(speed.precisions) and AUTO not in speed.precisions,
        "speed.precisions must list precisions to time, e.g. speed.precisions=[fp32,bf16]; "
        f"valid choices: {', '.join(names())}",
    )
    for precision in speed.precisions:
        get(precision)


def validate_devices(key: str, devices: list[str]) -> None:
    """Every device of ``key`` (predict.devices, report.predict) is in the device table."""
    for device in devices:
        require(
            device in PREDICTABLE,
            f"{key}: {device} is not in the device table; valid choices: {', '.join(PREDICTABLE)}",
        )


def validate_predict(predict: PredictConfig) -> None:
    """Raise ``ConfigError`` on the first predict value that cannot run."""
    require(bool(predict.devices), "predict.devices must name a device, e.g. [h100]")
    validate_devices("predict.devices", predict.devices)
    # Every resolved precision has facts to predict from; auto is decided on hardware at hand.
    for precision in predict.precisions:
        require(
            precision != AUTO,
            f"predict.precisions: {precision} is chosen on the hardware at hand, not "
            f"predicted; valid choices: {', '.join(names())}",
        )
        get(precision)
    require(predict.world_size >= 1, f"predict.world_size={predict.world_size} must be 1 or more")
    require(
        predict.interconnect_gb_per_s > 0,
        f"predict.interconnect_gb_per_s={predict.interconnect_gb_per_s} must be positive",
    )
