"""Which directory each job of a resumed sweep goes to: the one whose recorded config trains what
the job trains.

Hydra numbers a sweep's jobs in the order it expands them, so a sweep resumed with its values in
another order (``precision=bf16,fp32`` after ``precision=fp32,bf16``) would send each job into
another job's directory. A resumed sweep instead places each job by what it trains
(``resume.trained_values``: every value a resume may not change, the precision and the seed
included), never by its number or by launcher flags such as ``resume``: a job whose experiment a
directory holds goes there, a new one to the next free number. A job whose directory already
holds its completed run, asked for the same steps, is not launched again, so its files (Hydra's
``.hydra/`` among them) stay as they are. What a directory holds is read as data
(results/recorded.py); the job's own config is composed from the sweep's command line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from amp_exp.config.preflight import without_hydra
from amp_exp.results.recorded import as_recorded, job_config
from amp_exp.results.resume import trained_values
from amp_exp.results.summary import completed_summary

log = logging.getLogger("amp_exp")

# Hydra's job subdirectory, and amp_exp's (conf/config.yaml): the job's number. Placement
# overrides it per job; a sweep that names its jobs otherwise is left to that name.
SUBDIR_KEY = "hydra.sweep.subdir"
NUMBERED = "${hydra.job.num}"
# What a job that trains as long as its completed run did has nothing to do for.
STEP_COUNT = ("max_steps", "epochs")


def identity(config: dict[str, Any]) -> str:
    """What a plain config trains, as one comparable string."""
    return json.dumps(trained_values(config), sort_keys=True, default=str)


def numbered(master: DictConfig) -> bool:
    """Whether the sweep's jobs are named by their number (Hydra's default, and amp_exp's)."""
    return OmegaConf.to_container(master.hydra.sweep, resolve=False).get("subdir") == NUMBERED


class Placement:
    """The directories of a sweep resumed in ``sweep_dir``; ``compose(overrides)`` composes a
    job's config as its launcher will (Hydra's ``load_sweep_config``)."""

    def __init__(self, sweep_dir: Path, compose: Callable[[list[str]], DictConfig]) -> None:
        self.sweep_dir = sweep_dir
        self.compose = compose
        jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir()) if sweep_dir.is_dir() else []
        self.used = {job.name for job in jobs}
        self.held: dict[str, str] = {}
        for job in jobs:
            recorded = job_config(job)
            if recorded:
                self.held.setdefault(identity(recorded), job.name)

    def directory(self, overrides: list[str]) -> tuple[str, dict[str, Any]]:
        """The job's directory name (its own, or the next free number) and its config, as a
        summary records it, composed from the sweep's command line."""
        config = as_recorded(without_hydra(self.compose(list(overrides))))
        name = self.held.get(identity(config))
        if name is None:
            name = str(next(n for n in range(len(self.used) + 1) if str(n) not in self.used))
            self.used.add(name)
            self.held[identity(config)] = name
        return name, config

    def done(self, name: str, config: dict[str, Any]) -> bool:
        """Whether directory ``name`` holds this job's completed run, of the steps it asks for."""
        completed = completed_summary(self.sweep_dir / name)
        if completed is None:
            return False
        trainer = (completed.get("config") or {}).get("trainer") or {}
        if any(trainer.get(key) != config["trainer"].get(key) for key in STEP_COUNT):
            return False
        log.info(
            "%s: this run completed at step %s; nothing to do, its results stay as they are",
            self.sweep_dir / name,
            completed.get("steps"),
        )
        return True

    def place(self, overrides: list[str]) -> tuple[str, list[str] | None]:
        """The job's directory name, and its overrides sending it there (None when it has
        nothing to do there)."""
        name, config = self.directory(overrides)
        if self.done(name, config):
            return name, None
        return name, [*overrides, f"{SUBDIR_KEY}={name}"]
