"""A config as plain Python values: nested dicts for files and W&B, dotted keys for comparing;
and a saved plain config typed by the schemas again, and back to a validated ``RunConfig``."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from amp_exp.config.schema import SCHEMAS, RunConfig
from amp_exp.config.values import validate
from amp_exp.errors import ConfigError


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
    """A job's saved config (Hydra's ``.hydra/config.yaml``, or the plain config a summary.json
    keeps) typed as composing had typed it: each group by the one schema whose fields are exactly
    its keys (every schema of a group has fields of its own: the architecture tests keep it so),
    so ``validate`` reads it. A group no schema matches is left untyped."""
    typed = OmegaConf.structured(RunConfig)
    for group in SCHEMAS:
        schema = schema_of(group, set(saved.get(group) or {}))
        if schema is not None:
            typed[group] = OmegaConf.structured(schema)
    return OmegaConf.merge(typed, saved)


def schema_of(group: str, keys: set[str]) -> type | None:
    """The schema of ``group`` whose fields are exactly ``keys``, or None."""
    found = [s for s in SCHEMAS[group].values() if {f.name for f in fields(s)} == keys]
    return found[0] if len(found) == 1 else None


def run_config_from_plain(plain: dict[str, Any]) -> RunConfig:
    """The validated ``RunConfig`` of a plain config (``plain_run_config``'s output)."""
    for group in SCHEMAS:
        values = plain.get(group) or {}
        if schema_of(group, set(values)) is None:
            raise ConfigError(f"{group}: {sorted(values)} match no {group} schema of this version")
    return validate(typed_config(OmegaConf.create(plain)))
