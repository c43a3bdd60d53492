"""Fixtures every test gets: registered schemas, W&B and measurement caches kept local, and
the real config composed from conf/ and shrunk. Shared helpers live in tests/helpers/."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME
from amp_exp.config.schema import RunConfig
from amp_exp.config.store import register_configs
from amp_exp.config.validate import validate
from helpers.probes import inject_probe
from helpers.runs import FAST


@pytest.fixture(scope="session", autouse=True)
def _registered_schemas() -> None:
    register_configs()


@pytest.fixture(autouse=True)
def _wandb_kept_local(monkeypatch, tmp_path_factory) -> None:
    """No test, nor any subprocess it starts, reaches W&B or the user's W&B files by accident.

    Tests that want W&B set wandb.mode explicitly, which wins over WANDB_MODE.
    """
    monkeypatch.setenv("WANDB_MODE", "disabled")
    wandb_home = tmp_path_factory.getbasetemp() / "wandb_home"
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(wandb_home))


@pytest.fixture(autouse=True)
def _measurements_kept_local(monkeypatch, tmp_path_factory) -> None:
    """No test, nor any subprocess it starts, reads or writes the user's ~/.cache/amp_exp.

    The session's cache holds a probe result in which bf16 and fp16 run far slower than fp32, so
    precision=auto picks fp32 without timing anything, whatever this machine's speed. Tests of the
    probe and of the trial point XDG_CACHE_HOME at their own tmp_path.
    """
    cache_home = tmp_path_factory.getbasetemp() / "xdg_cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    if not cache_home.exists():
        inject_probe({"fp32": 1.0, "bf16": 0.05, "fp16": 0.02})


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """Compose the real config from conf/, shrunk to CPU and a few steps, plus ``overrides``."""

    def _compose(*overrides: str, fast: bool = True) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(CONFIG_NAME, overrides=[*(FAST if fast else []), *overrides])

    return _compose


@pytest.fixture
def run_cfg(compose_cfg) -> Callable[..., RunConfig]:
    def _run_cfg(*overrides: str) -> RunConfig:
        return validate(compose_cfg(*overrides))

    return _run_cfg
