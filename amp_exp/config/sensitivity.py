"""The rules of the sensitivity section (``python -m amp_exp.sensitivity``'s settings, whose
schema, ``SensitivityConfig``, lives in config/schema.py with every other section's).

conf/sensitivity/default.yaml selects it, as any config group does. A training run carries the
section and ignores it. Imports no torch.
"""

from __future__ import annotations

import dataclasses

from amp_exp.config.precision_checks import validate_precision
from amp_exp.config.schema import Precision, PrecisionConfig, SensitivityConfig, TrainerConfig
from amp_exp.errors import require

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
