"""What a job directory records of the job that ran there, read as data.

Hydra saves a job's config (``.hydra/config.yaml``) before the job runs, so a job killed before
it wrote summary.json is still known by it. It is read as a completed job's summary records its
config: typed by the schemas, with the task its data implies, resolved. It is never validated:
validating imports the modules a config names (``model._target_``, ``precision._target_``), and a
file in an output directory is data, never a name to import (docs/faults.md, "What is trusted").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from amp_exp.config.cross_checks import dataset_task
from amp_exp.config.plain import plain_run_config, typed_config
from amp_exp.results.files import JOB_CONFIG, read_data

log = logging.getLogger("amp_exp")


def as_recorded(saved: DictConfig) -> dict[str, Any]:
    """A composed or saved job config (without its ``hydra`` node) as a summary records one:
    typed, its task inferred, resolved. Raises OmegaConfBaseException where the schemas do not
    type it."""
    run = OmegaConf.to_object(typed_config(saved))
    run.task = run.task or dataset_task(run)
    return plain_run_config(run)


def job_config(path: Path) -> dict[str, Any]:
    """The config Hydra saved in job directory ``path``, ``as_recorded``. One the schemas no
    longer type is read as saved, its interpolations resolved where they resolve; a missing or
    broken file gives {}."""
    try:
        # Read as data: no link, no FIFO, no file larger than a config can be.
        saved = OmegaConf.create(read_data(path / JOB_CONFIG).decode("utf-8"))
    except Exception:  # a missing or broken file of any kind
        return {}
    if not isinstance(saved, DictConfig):
        return {}
    try:
        return as_recorded(saved)
    except OmegaConfBaseException as error:
        log.warning("%s: its config does not fit the schemas (%s); read as saved", path, error)
    except Exception:  # a saved file that parses but holds what no config can be
        return {}
    try:
        return OmegaConf.to_container(saved, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException:
        return OmegaConf.to_container(saved, resolve=False)  # type: ignore[return-value]
