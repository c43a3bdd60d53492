from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from amp_exp.cli import CONF_DIR, CONFIG_NAME
from amp_exp.config import RunConfig, register_configs, validate

# Small enough for 2 CPU cores, large enough that every code path runs.
FAST = [
    "trainer.device=cpu",
    "trainer.max_steps=4",
    "trainer.log_every=2",
    "trainer.timing_warmup_steps=1",
    "dataset.train_size=256",
    "dataset.eval_size=64",
    "dataset.batch_size=32",
    "dataset.image_size=16",
    "dataset.num_workers=0",
]


@pytest.fixture(scope="session", autouse=True)
def _registered_schemas() -> None:
    register_configs()


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


def read_jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]
