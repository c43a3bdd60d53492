"""The precision section's rules: the GradScaler's knobs, fp8's needs, FSDP2's reduce dtype and
parameter cast, and the strategies each precision runs under (from the precision table). Imports
no torch."""

from __future__ import annotations

from importlib.util import find_spec

from amp_exp.config.precisions import AUTO, spec_of, specs
from amp_exp.config.schema import (
    DeviceChoice,
    Fp8Recipe,
    Precision,
    PrecisionConfig,
    ReduceDtype,
    Strategy,
    TrainerConfig,
)
from amp_exp.errors import require


def validate_precision(precision: PrecisionConfig, trainer: TrainerConfig) -> None:
    """Raise ``ConfigError`` on the first precision value that cannot run with ``trainer``."""
    _validate_scaler(precision)
    blank = [pattern for pattern in precision.keep_fp32 if not pattern.strip()]
    require(not blank, "precision.keep_fp32 holds an empty pattern; give module names or globs")
    _validate_fp8(precision, trainer)
    _validate_reduce_dtype(precision, trainer)
    _validate_cast_params(precision, trainer)
    _validate_strategy(precision.name, trainer.strategy)


def _validate_scaler(precision: PrecisionConfig) -> None:
    require(precision.init_scale > 0, "precision.init_scale must be positive")
    require(precision.growth_factor > 1, "precision.growth_factor must be greater than 1")
    require(precision.max_consecutive_skips > 0, "precision.max_consecutive_skips must be positive")
    require(precision.min_scale > 0, "precision.min_scale must be positive")
    require(
        0 < precision.backoff_factor < 1,
        "precision.backoff_factor must lie strictly between 0 and 1",
    )


def _validate_fp8(precision: PrecisionConfig, trainer: TrainerConfig) -> None:
    """What fp8 needs that the config alone shows; the GPU's capability is checked at build."""
    if precision.name is not Precision.fp8:
        return
    require(
        find_spec("torchao") is not None,
        "precision=fp8 needs torchao, which is not installed: pip install 'amp_exp[fp8]'",
    )
    require(
        trainer.device is not DeviceChoice.cpu or precision.fp8_emulate,
        "precision=fp8 needs a CUDA GPU with compute capability 8.9+ (trainer.device=cpu); "
        "add precision.fp8_emulate=true to emulate it (slow, not timed)",
    )
    # torchao measured no size thresholds for this recipe (its _auto_filter_for_recipe).
    require(
        not precision.fp8_skip_small or precision.fp8_recipe is not Fp8Recipe.rowwise_with_gw_hp,
        "precision.fp8_skip_small=true has no size thresholds for "
        "precision.fp8_recipe=rowwise_with_gw_hp; valid recipes: tensorwise, rowwise",
    )


def _validate_strategy(precision: str, strategy: Strategy) -> None:
    """The strategies a precision runs under, from the precision table."""
    if precision == AUTO:
        return
    runs_under = spec_of(precision).strategies
    require(
        strategy in runs_under,
        f"precision={precision} does not run with trainer.strategy={strategy.value} yet; "
        f"valid choices: {', '.join(sorted(s.value for s in runs_under))}",
    )


def _validate_cast_params(precision: PrecisionConfig, trainer: TrainerConfig) -> None:
    if not precision.fsdp_cast_params:
        return
    require(
        trainer.strategy is Strategy.fsdp2,
        "precision.fsdp_cast_params=true needs trainer.strategy=fsdp2; DDP and one process "
        "compute under autocast from fp32 weights",
    )
    casting = [spec.name for spec in specs() if spec.fsdp_param_dtype is not None]
    require(
        precision.name == AUTO or spec_of(precision.name).fsdp_param_dtype is not None,
        f"precision.fsdp_cast_params=true: precision={precision.name} has no dtype to cast "
        f"the parameters to; valid choices: {', '.join(casting)}",
    )


def _validate_reduce_dtype(precision: PrecisionConfig, trainer: TrainerConfig) -> None:
    reduce = precision.reduce_dtype
    if reduce is None:
        return
    require(
        trainer.strategy is Strategy.fsdp2,
        f"precision.reduce_dtype={reduce.value} needs trainer.strategy=fsdp2; DDP reduces "
        "gradients in their own dtype (fp32)",
    )
    # Only a GradScaler notices a gradient that overflowed fp16 in the reduction, and backs off.
    require(
        reduce is not ReduceDtype.fp16 or precision.name is Precision.fp16,
        "precision.reduce_dtype=fp16 needs precision=fp16, whose GradScaler catches gradients "
        "that overflow fp16; valid choices here: fp32, bf16",
    )
