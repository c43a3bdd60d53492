"""A config as plain Python values: nested dicts for files and W&B, dotted keys for comparing;
and back, from the plain config a run's summary.json keeps to a validated ``RunConfig``."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from amp_exp.config.schema import SCHEMAS, RunConfig
from amp_exp.config.validate import validate
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


def run_config_from_plain(plain: dict[str, Any]) -> RunConfig:
    """The validated ``RunConfig`` of a plain config (``plain_run_config``'s output).

    A group's schema is the one whose fields are exactly the group's keys: every schema of a group
    has a set of fields of its own (the architecture tests keep it so)."""
    cfg = OmegaConf.structured(RunConfig)
    for group, schemas in SCHEMAS.items():
        values = plain.get(group) or {}
        found = [s for s in schemas.values() if {f.name for f in fields(s)} == set(values)]
        if len(found) != 1:
            raise ConfigError(f"{group}: {sorted(values)} match no {group} schema of this version")
        cfg[group] = OmegaConf.merge(OmegaConf.structured(found[0]), values)
    return validate(OmegaConf.merge(cfg, {k: v for k, v in plain.items() if k not in SCHEMAS}))
