"""A config as plain Python values: nested dicts for files and W&B, dotted keys for comparing."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf


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
