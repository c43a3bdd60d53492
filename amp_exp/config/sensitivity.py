"""The sensitivity section: ``python -m amp_exp.sensitivity``'s schema and its rules.

Its own module beside the schema, which imports no amp_exp module but the dataset schemas, so
the schema stays a leaf; conf/sensitivity/default.yaml selects it, as any config group does.
A training run carries the section and ignores it. Imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from amp_exp.config.precision_checks import validate_precision
from amp_exp.config.schema import Precision, PrecisionConfig, TrainerConfig
from amp_exp.errors import require

# The precisions whose per-module error against fp32 the command measures.
RANKABLE = (Precision.fp16, Precision.bf16, Precision.fp8)
# When neither sensitivity.precisions nor a rankable precision= says which.
DEFAULT_PRECISIONS = (Precision.fp16, Precision.bf16)


@dataclass
class SensitivityConfig:
    # The precisions to rank modules for (fp16, bf16, fp8); null = precision= when it is one
    # of those, else fp16 and bf16. Repair targets the first.
    precisions: list[Precision] | None = None
    # Training batches the errors are measured on, each against its own fp32 reference.
    batches: int = 2
    # The most sensitive modules the console and sensitivity.md list, per precision.
    show: int = 10
    # Search for modules to keep in fp32 until a short run in the first precision trains.
    repair: bool = False
    # Verification runs in the target precision, at most (the fp32 reference not counted).
    max_trials: int = 6
    # Optimizer steps of every verification run and of its fp32 reference.
    verify_steps: int = 40
    # A verification run passes with at most this many skipped steps, no loss-scale collapse,
    # and a final loss within loss_tolerance (relative) of fp32's at the same step.
    max_skipped_steps: int = 2
    loss_tolerance: float = 0.05


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
