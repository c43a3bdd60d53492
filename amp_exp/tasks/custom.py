"""The user's own model and data, built by Hydra's instantiate from a ``_target_``.

The callable gets its ``kwargs`` from the config, plus whichever of the offered facts its
signature names (all of them if it takes ``**kwargs``); a value in ``kwargs`` wins over a fact.
Anything wrong with what it is or returns is a one-line ``ConfigError`` before training.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from amp_exp.config.datasets import CustomDatasetConfig
from amp_exp.config.models import CustomModelConfig
from amp_exp.config.schema import TaskName
from amp_exp.errors import ConfigError, first_line
from amp_exp.tasks.base import DataBundle
from amp_exp.tasks.inputs import primary, split
from amp_exp.tasks.sampling import Placement, dataset_loaders


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {first_line(str(error))}"


def accepted(factory: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The offered facts that ``factory``'s signature can take."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: offer nothing
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(offered)
    names = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    return {key: value for key, value in offered.items() if key in names}


def call_target(section: str, target: str, kwargs: dict[str, Any], offered: dict[str, Any]):
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    where = f"{section}._target_={target}"
    try:
        # _partial_: the facts are passed as Python values below, not through OmegaConf (which
        # would turn a shape tuple into a list); _convert_: the user gets plain dicts and lists.
        factory = instantiate({"_target_": target, "_partial_": True, "_convert_": "all", **kwargs})
    except InstantiationException as error:
        raise ConfigError(f"{where}: {first_line(str(error))}") from None
    facts = {key: value for key, value in accepted(factory, offered).items() if key not in kwargs}
    try:
        return factory(**facts)
    except Exception as error:
        given = ", ".join(f"{k}={v!r}" for k, v in {**kwargs, **facts}.items()) or "nothing"
        raise ConfigError(f"{where} failed on its arguments ({given}): {describe(error)}") from None


def build_custom_model(cfg: CustomModelConfig, facts: dict[str, Any]) -> nn.Module:
    model = call_target("model", cfg._target_, cfg.kwargs, facts)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model._target_={cfg._target_} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def build_custom_data(cfg: CustomDatasetConfig, task: TaskName, placement: Placement) -> DataBundle:
    """Loaders over the user's (train, eval) datasets, and the facts a model is built from."""
    where = f"dataset._target_={cfg._target_}"
    splits = call_target("dataset", cfg._target_, cfg.kwargs, {"seed": placement.seed})
    if not (isinstance(splits, (tuple, list)) and len(splits) == 2):
        raise ConfigError(f"{where} returned {type(splits).__name__}, not (train, eval) datasets")
    train, held_out = splits
    try:
        inputs, _ = split(train[0])
        shape = tuple(torch.as_tensor(primary(inputs)).shape)
    except Exception as error:
        raise ConfigError(
            f"{where}: its first training sample is not an (inputs, target) pair or a dict with "
            f"its target under 'labels': {describe(error)}"
        ) from None
    if task is TaskName.classification:
        facts = {"input_shape": shape, "num_classes": cfg.num_classes}
    elif len(shape) == 1:
        facts = {"vocab_size": cfg.vocab_size, "seq_len": shape[0]}
    else:
        raise ConfigError(f"{where}: task=lm needs 1-D token sequences, got inputs of {shape}")
    loaders = dataset_loaders(
        train, held_out, cfg.batch_size, cfg.eval_batch_size, cfg.num_workers, placement
    )
    return DataBundle(*loaders, facts)
