"""Each value on its own, and the typed ``RunConfig``.

``validate`` turns a composed config into a ``RunConfig`` or raises ``ConfigError`` with one line
that names the key and the valid choices. Here a value is refused that is wrong whatever the
others say, the commands' sections (speed.*, sensitivity.*, predict.*, evidence.*) included: an
unknown key, a number out of its range, a name no library knows. Then the values that must agree
with each other, the model and the data are checked (config/cross_checks.py).
Nothing here imports torch: a bad value is rejected before anything heavy loads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass
from operator import attrgetter
from typing import Any

from omegaconf import DictConfig, OmegaConf

from amp_exp.config.adaptive import COMPILE_AUTO, SPEED_WARMUP_WINDOW
from amp_exp.config.cross_checks import check_agreement
from amp_exp.config.datasets import (
    CustomDatasetConfig,
    DatasetConfig,
    SyntheticTokensConfig,
)
from amp_exp.config.models import (
    CustomModelConfig,
    GPTConfig,
    ModelConfig,
    TimmModelConfig,
    TorchvisionModelConfig,
)
from amp_exp.config.precisions import AUTO, get, names
from amp_exp.config.schema import (
    FAMILYWISE,
    SCHEMAS,
    WANDB_TAG_MAX_CHARS,
    AdamWConfig,
    RunConfig,
    SpeedConfig,
    WandbConfig,
)
from amp_exp.devices import PREDICTABLE
from amp_exp.errors import ConfigError, first_line, require, require_choice

# NumPy seeds its generator with an unsigned 32-bit integer.
SEED_RANGE = range(2**32)
# What W&B refuses in a project name at init, which would cost the run its dashboard entry.
WANDB_PROJECT_MAX_CHARS = 128
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"
# The bounds a schema's field declares (``field(metadata={"bound": RULE})``): the message a
# value that breaks one gets (``{key}``: its dotted key), and what a value that keeps it satisfies.
BOUNDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "positive": ("{key}={value} must be positive", lambda value: value > 0),
    "positive_or_null": (
        "{key}={value} must be positive or null",
        lambda value: value is None or value > 0,
    ),
    "at_least_1": ("{key}={value} must be 1 or more", lambda value: value >= 1),
    "positive_number": ("{key} must be positive", lambda value: value > 0),
    "positive_integer": ("{key} must be a positive integer", lambda value: value > 0),
    "at_least_0": ("{key} must be 0 or more", lambda value: value >= 0),
    "open_unit": ("{key} must lie strictly between 0 and 1", lambda value: 0 < value < 1),
    "half_open_unit": ("{key} must lie in [0, 1)", lambda value: 0 <= value < 1),
    "unit": ("{key} must lie in [0, 1]", lambda value: 0 <= value <= 1),
}
# The fewest rounds for the speedup's interval to be of any use (its critical value, calibrated
# for autocorrelated rounds in capability/ratio.py, is 11 at 6 rounds and 23 at 4).
MIN_SPEED_ROUNDS = 6


@functools.cache
def torchvision_model_names() -> tuple[str, ...]:
    """The classification models torchvision can build (imports torchvision: about 1.5 s)."""
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def validate(cfg: DictConfig) -> RunConfig:
    """Turn a composed config into a typed ``RunConfig``, or raise ``ConfigError``."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    require(
        not missing, f"{', '.join(missing)} must be set, e.g. {missing[0] if missing else ''}=..."
    )
    _reject_unknown_keys(cfg)
    run: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    check_values(run)
    run.task = check_agreement(run)
    return run


def check_values(run: RunConfig) -> None:
    """``ConfigError`` on the first value that is wrong on its own."""
    values = list(_leaves(run))
    # inf and NaN pass every range check below (or fail it with a misleading message), and an
    # infinite learning rate or loss scale makes every step non-finite: the run would skip them
    # all and report success.
    for key, value, _ in values:
        if isinstance(value, float):
            require(math.isfinite(value), f"{key}={value} must be a finite number")
    for key, value, bound in values:
        if bound is not None:
            message, keeps = BOUNDS[bound]
            require(keeps(value), message.format(key=key, value=value))
    precision = run.precision
    require(precision.growth_factor > 1, "precision.growth_factor must be greater than 1")
    blank = [pattern for pattern in precision.keep_fp32 if not pattern.strip()]
    require(not blank, "precision.keep_fp32 holds an empty pattern; give module names or globs")
    require(
        run.seed in SEED_RANGE, f"seed={run.seed} must lie in [0, 2**32 - 1] (NumPy's seed range)"
    )
    require(
        run.resume is None or bool(run.resume.strip()),
        f"resume={run.resume!r} is empty; use resume=null (start fresh), resume=auto, or the path "
        "of a run directory or checkpoint",
    )
    _check_dataset(run.dataset)
    require(
        run.trainer.eval_every is None or run.trainer.eval_every >= 0,
        "trainer.eval_every must be 0 (only at the end), a positive step interval, or null (never)",
    )
    every = run.checkpoint.every_steps
    require(every is None or every >= 0, "checkpoint.every_steps must be 0 (at the end), N or null")
    require(
        run.diagnostics.underflow_every >= 0, "diagnostics.underflow_every must be 0 (off) or more"
    )
    require(
        isinstance(run.trainer.compile, bool) or run.trainer.compile == COMPILE_AUTO,
        f"trainer.compile={run.trainer.compile} must be true, false or {COMPILE_AUTO} (compile "
        "where the precision needs it to be fast: fp8 on CUDA)",
    )
    audit_step = run.diagnostics.audit_step
    require(
        audit_step is None or audit_step >= 1,
        "diagnostics.audit_step must be 1 or more, or null (the first timed step)",
    )
    require(
        run.report.tolerance is None or run.report.tolerance >= 0,
        "report.tolerance must be 0 or more, or null (the task's default)",
    )
    require(
        run.report.familywise in FAMILYWISE,
        f"report.familywise={run.report.familywise}: one of {', '.join(FAMILYWISE)}",
    )
    require(
        run.sensitivity.tolerance is None or run.sensitivity.tolerance > 0,
        f"sensitivity.tolerance={run.sensitivity.tolerance} must be positive (or null: the task's)",
    )
    # One seed measures no noise: the verdict rule gives single_seed, never matches.
    require(
        run.sensitivity.verify_seeds >= 2,
        f"sensitivity.verify_seeds={run.sensitivity.verify_seeds} must be 2 or more: one seed "
        "measures no noise, so no verdict can verify a repair",
    )
    require(
        run.evidence.min_seeds >= 2,
        f"evidence.min_seeds={run.evidence.min_seeds} must be 2 or more: one seed measures no "
        "noise",
    )
    _check_speed(run.speed)
    require(bool(run.predict.devices), "predict.devices must name a device, e.g. [h100]")
    for key in ("predict.devices", "report.predict"):
        for device in attrgetter(key)(run):
            require_choice(device, PREDICTABLE, f"{key}: {device} is not in the device table")
    # Every resolved precision has facts to predict from; auto is decided on hardware at hand.
    for precision in run.predict.precisions:
        require(
            precision != AUTO,
            f"predict.precisions: {precision} is chosen on the hardware at hand, not "
            f"predicted; valid choices: {', '.join(names())}",
        )
        get(precision)
    optimizer = run.optimizer
    if isinstance(optimizer, AdamWConfig):
        require(
            len(optimizer.betas) == 2 and all(0 <= b < 1 for b in optimizer.betas),
            "optimizer.betas must be two numbers in [0, 1)",
        )
    _check_model(run.model)
    _check_wandb(run.wandb)


def _check_speed(speed: SpeedConfig) -> None:
    require(
        speed.max_warmup_steps >= 2 * SPEED_WARMUP_WINDOW,
        f"speed.max_warmup_steps={speed.max_warmup_steps} must be {2 * SPEED_WARMUP_WINDOW} or "
        f"more: warm-up compares two windows of {SPEED_WARMUP_WINDOW} steps",
    )
    require(
        speed.rounds >= MIN_SPEED_ROUNDS and speed.rounds % 2 == 0,
        f"speed.rounds={speed.rounds} must be even and {MIN_SPEED_ROUNDS} or more: each side "
        "runs first in half the rounds",
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


def _leaves(node: Any, key: str = "", bound: Any = None) -> Iterator[tuple[str, Any, Any]]:
    """Every value in a typed config that is no section or list, with its dotted key and the
    bound its schema's field declares (a key of ``BOUNDS``), or None."""
    if is_dataclass(node):
        for f in fields(node):
            name = f"{key}.{f.name}" if key else f.name
            yield from _leaves(getattr(node, f.name), name, f.metadata.get("bound"))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _leaves(item, f"{key}[{i}]")
    else:
        yield key, node, bound


def _reject_unknown_keys(cfg: DictConfig) -> None:
    """``+key=value`` and ``+group.key=value`` open a typed node; a key its schema lacks would be
    silently lost."""
    known = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(cfg.keys()) - known)
    require(
        not unknown,
        f"{unknown[0] if unknown else ''} is not a known key or config group; "
        f"valid top-level keys: {', '.join(sorted(known))}",
    )
    for section in [*SCHEMAS, "checkpoint", "diagnostics", "sensitivity", "speed", "predict"]:
        node = cfg[section]
        known = {f.name for f in fields(OmegaConf.get_type(node))}
        unknown = sorted(set(node.keys()) - known)
        require(
            not unknown,
            f"{section}.{unknown[0] if unknown else ''} is not a known key; "
            f"valid keys: {', '.join(sorted(known))}",
        )


def _check_dataset(dataset: DatasetConfig) -> None:
    if isinstance(dataset, SyntheticTokensConfig):
        require(dataset.vocab_size >= 2, "dataset.vocab_size must be 2 or more")
        require(
            0 < dataset.branching <= dataset.vocab_size,
            f"dataset.branching={dataset.branching} must lie in [1, dataset.vocab_size]",
        )
    if isinstance(dataset, CustomDatasetConfig):
        require(
            dataset.vocab_size is None or dataset.vocab_size >= 2,
            f"dataset.vocab_size={dataset.vocab_size} must be 2 or more, or null",
        )
        _check_target("dataset", dataset._target_)


def _check_target(section: str, target: str) -> None:
    """The user's callable must import: checked here, before any job of a sweep starts."""
    # What instantiate itself uses; hydra.utils.get_object would also log a multi-line error.
    from hydra._internal.utils import _locate

    try:
        found = _locate(target)
    except Exception as error:
        cause = error.__cause__ or error
        raise ConfigError(
            f"{section}._target_={target} cannot be imported ({type(cause).__name__}: "
            f"{first_line(str(cause))}); is its package installed or its folder on PYTHONPATH?"
        ) from None
    require(callable(found), f"{section}._target_={target} is not callable")


def _check_model(model: ModelConfig) -> None:
    if isinstance(model, GPTConfig):
        require(
            model.d_model % model.n_head == 0,
            f"model.d_model={model.d_model} must be a multiple of model.n_head={model.n_head}",
        )
        require(
            model.vocab_size is None or model.vocab_size > 0,
            "model.vocab_size must be positive or null (the dataset's)",
        )
    elif isinstance(model, TimmModelConfig):
        try:
            import timm
        except ImportError:
            raise ConfigError("model=timm needs timm: pip install 'amp_exp[timm]'") from None
        require(
            timm.is_model(model.name),
            f"model.name={model.name!r} is not a timm model; timm.list_models() lists them",
        )
    elif isinstance(model, CustomModelConfig):
        _check_target("model", model._target_)
    elif isinstance(model, TorchvisionModelConfig):  # hf models: config/hf.py, from the pairing
        require_choice(
            model.name,
            torchvision_model_names(),
            f"model.name={model.name!r} is not a torchvision classification model",
        )


def _check_wandb(wandb: WandbConfig) -> None:
    require(bool(wandb.project.strip()), "wandb.project must not be empty")
    forbidden = sorted(set(WANDB_PROJECT_FORBIDDEN) & set(wandb.project))
    require(
        not forbidden and len(wandb.project) <= WANDB_PROJECT_MAX_CHARS,
        f"wandb.project={wandb.project!r}: W&B project names have at most "
        f"{WANDB_PROJECT_MAX_CHARS} characters and none of {' '.join(WANDB_PROJECT_FORBIDDEN)}",
    )
    require(wandb.finish_timeout >= 0, "wandb.finish_timeout must be 0 (wait for all) or more")
    long_tags = [tag for tag in wandb.tags if len(tag) > WANDB_TAG_MAX_CHARS]
    require(
        not long_tags,
        f"wandb.tags: {long_tags[0] if long_tags else ''!r} is longer than "
        f"{WANDB_TAG_MAX_CHARS} characters",
    )
