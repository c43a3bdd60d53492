"""The precision section's rules: the name and the plugin's options (from the registry), the
GradScaler's knobs, fp8's needs, FSDP2's reduce dtype and parameter cast, and the strategies each
precision runs under (from its facts). Imports no torch."""

from __future__ import annotations

from amp_exp.config.precisions import AUTO, PluginHook, get, names, options_of, register
from amp_exp.config.schema import (
    PrecisionConfig,
    ReduceDtype,
    Strategy,
    TrainerConfig,
)
from amp_exp.errors import require


def validate_precision(precision: PrecisionConfig, trainer: TrainerConfig) -> None:
    """Raise ``ConfigError`` on the first precision value that cannot run with ``trainer``."""
    _validate_plugin(precision, trainer)
    _validate_scaler(precision)
    blank = [pattern for pattern in precision.keep_fp32 if not pattern.strip()]
    require(not blank, "precision.keep_fp32 holds an empty pattern; give module names or globs")
    _validate_reduce_dtype(precision, trainer)
    _validate_cast_params(precision, trainer)
    _validate_strategy(precision.name, trainer.strategy)


def _validate_plugin(precision: PrecisionConfig, trainer: TrainerConfig) -> None:
    """A user's plugin registers first; then the name must be a known precision (one line with
    the valid choices) and the options the plugin's own."""
    if precision._target_ is not None:
        register(precision._target_)
    if precision.name == AUTO:
        require(not precision.options, "precision=auto takes no precision.options")
        return
    plugin = get(precision.name)
    options_of(plugin, precision.options)
    with PluginHook(plugin, "check_config"):
        plugin.check_config(precision, trainer)


def _validate_scaler(precision: PrecisionConfig) -> None:
    require(precision.init_scale > 0, "precision.init_scale must be positive")
    require(precision.growth_factor > 1, "precision.growth_factor must be greater than 1")
    require(precision.max_consecutive_skips > 0, "precision.max_consecutive_skips must be positive")
    require(precision.min_scale > 0, "precision.min_scale must be positive")
    require(
        0 < precision.backoff_factor < 1,
        "precision.backoff_factor must lie strictly between 0 and 1",
    )


def _validate_strategy(precision: str, strategy: Strategy) -> None:
    """The strategies a precision runs under, from the precision table."""
    if precision == AUTO:
        return
    runs_under = get(precision).spec.strategies
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
    casting = [name for name in names() if get(name).spec.fsdp_param_dtype is not None]
    require(
        precision.name == AUTO or get(precision.name).spec.fsdp_param_dtype is not None,
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
    scaled = [name for name in names() if get(name).spec.grad_scaler]
    require(
        reduce is not ReduceDtype.fp16
        or (precision.name != AUTO and get(precision.name).spec.grad_scaler),
        f"precision.reduce_dtype=fp16 needs precision={' or '.join(scaled)}, whose GradScaler "
        "catches gradients that overflow fp16; valid choices here: fp32, bf16",
    )
