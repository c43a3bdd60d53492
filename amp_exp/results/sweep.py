"""Where a Hydra job sits in its multirun: which sweep it belongs to and what this job varies.

A job's own config only lists its values; which keys the sweep varies is in the sweep's
``multirun.yaml`` (its command line and, for presets, ``hydra.sweeper.params``), which Hydra
writes into the sweep directory before it launches any job.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from amp_exp.results.files import read_data


@dataclass(frozen=True)
class SweepJob:
    # The sweep's output directory: one per sweep, shared by all its jobs.
    dir: str
    # This job's (key, value) for each key the sweep varies, in command-line order.
    choices: tuple[tuple[str, str], ...]


def swept_keys(task_overrides: list[str]) -> set[str]:
    """Keys given more than one value, like ``optimizer.lr`` in ``optimizer.lr=0.1,0.01``."""
    parsed = OverridesParser.create().parse_overrides(task_overrides)
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


def sweep_overrides(spec: DictConfig) -> list[str]:
    """A sweep's overrides: a preset's ``hydra.sweeper.params``, then the command line's."""
    params = OmegaConf.select(spec, "hydra.sweeper.params") or {}
    task = OmegaConf.select(spec, "hydra.overrides.task") or []
    return [*(f"{key}={value}" for key, value in params.items()), *task]


def sweep_job(hydra_cfg: DictConfig) -> SweepJob | None:
    """The sweep of a multirun job (from ``HydraConfig.get()``); None for a single run."""
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    sweep_dir = hydra_cfg.sweep.dir
    # Relative to where the sweep was launched, even if the job changed its directory.
    spec = Path(hydra_cfg.runtime.cwd, sweep_dir, "multirun.yaml")
    # A launcher that writes no sweep spec leaves the job's name without sweep values.
    swept = (
        swept_keys(sweep_overrides(OmegaConf.create(read_data(spec).decode("utf-8"))))
        if spec.is_file()
        else set()
    )
    job = OverridesParser.create().parse_overrides(list(hydra_cfg.overrides.task))
    choices = tuple(
        (o.key_or_group, o.get_value_element_as_str()) for o in job if o.key_or_group in swept
    )
    return SweepJob(sweep_dir, choices)


# The config keys that name code to import: the user's own model, data and precision plugin.
CODE_KEYS = ("model._target_", "dataset._target_", "precision._target_")


def named_code(spec: DictConfig) -> frozenset[str]:
    """Every module path the sweep's own config and command line name as code (``CODE_KEYS``):
    what a sweep may import again for its jobs, never a name read from a job's files."""
    named = {OmegaConf.select(spec, key, default=None) for key in CODE_KEYS}
    for override in OverridesParser.create().parse_overrides(sweep_overrides(spec)):
        if override.key_or_group in CODE_KEYS:
            if override.is_sweep_override():
                named.update(override.sweep_string_iterator())
            else:
                named.add(override.get_value_element_as_str())
    return frozenset(str(name) for name in named if name)
