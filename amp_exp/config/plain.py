"""A config as plain Python values: nested dicts for files and W&B, dotted keys for comparing;
and a saved plain config typed by the schemas again."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from amp_exp.config.schema import SCHEMAS, RunConfig
from amp_exp.config.sensitivity import SensitivityConfig


def to_plain_dict(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python types (enums become their values)."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def plain_run_config(cfg: Any) -> dict[str, Any]:
    """A validated config (the RunConfig dataclass) as plain Python types, as ``to_plain_dict``."""
    return to_plain_dict(OmegaConf.structured(cfg))


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A plain config as dotted keys: ``{"model": {"width": 8}}`` -> ``{"model.width": 8}``."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def typed_config(saved: DictConfig) -> DictConfig:
    """A job's saved config (Hydra's ``.hydra/config.yaml``, untyped) typed as composing had
    typed it: each group by the one schema whose fields it holds, so ``validate`` reads it."""
    typed = OmegaConf.structured(RunConfig)
    for group, schemas in SCHEMAS.items():
        keys = set(saved.get(group) or {})
        for schema in schemas.values():
            if {field.name for field in fields(schema)} == keys:
                typed[group] = OmegaConf.structured(schema)
    if "sensitivity" in saved:
        typed.sensitivity = OmegaConf.structured(SensitivityConfig)
    return OmegaConf.merge(typed, saved)
