"""Finding runs on disk and reading what each one left: summary.json and metrics.jsonl.

It reads files alone, so a report works on runs copied from another machine and on runs logged
without W&B. A job that never wrote summary.json (SIGKILL, the OOM killer) is found by the config
Hydra saved before it ran, and listed as killed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amp_exp.errors import ConfigError
from amp_exp.results.files import JOB_CONFIG, METRICS_FILE, SUMMARY_FILE
from amp_exp.results.loggers import read_rows
from amp_exp.results.summary import Status, make_summary

log = logging.getLogger("amp_exp")


class ReportError(Exception):
    """Nothing to report; the message is one line that says why."""


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    # What sets this run apart from the other runs of its model besides precision, as overrides.
    setting: str = ""

    @property
    def model(self) -> str:
        return str(self.summary.get("model") or "?")

    @property
    def precision(self) -> str:
        return str(self.summary.get("precision") or "?")

    @property
    def completed(self) -> bool:
        return self.summary.get("status") == Status.completed.value


def _natural_key(path: Path) -> list[tuple[int, int | str]]:
    # Sweep jobs are numbered directories: job 10 belongs after job 9, not after job 1.
    return [(0, int(part)) if part.isdigit() else (1, part) for part in path.parts]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl; a line cut short by a killed run is left out."""
    rows, unreadable = read_rows(path)
    if unreadable:
        log.warning("%s: skipping %d unreadable line(s)", path, unreadable)
    return rows


def job_config(path: Path) -> dict[str, Any]:
    """The config a job saved before it ran, as a completed job's summary records it: typed,
    validated (which infers the task) and resolved. One that no longer validates (its data gone,
    a schema changed since) is read as saved, its interpolations resolved where they resolve."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from amp_exp.config.plain import plain_run_config, typed_config
    from amp_exp.config.validate import validate

    saved = OmegaConf.load(path / JOB_CONFIG)
    try:
        return plain_run_config(validate(typed_config(saved)))
    except (ConfigError, OmegaConfBaseException) as error:
        log.warning("%s: its config does not validate (%s); read as saved", path, error)
    try:
        return OmegaConf.to_container(saved, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException:
        return OmegaConf.to_container(saved, resolve=False)  # type: ignore[return-value]


def killed_summary(path: Path) -> dict[str, Any]:
    """What a job that never wrote summary.json (SIGKILL, the OOM killer) shows in a report."""
    config = job_config(path)
    return make_summary(
        Status.killed,
        config,
        error=f"no {SUMMARY_FILE}: the process was killed (SIGKILL, out of memory) or is "
        "still running",
    )


def load_run(path: Path) -> Run:
    try:
        summary = json.loads((path / SUMMARY_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        summary = killed_summary(path)
    except (OSError, json.JSONDecodeError) as error:
        summary = make_summary(Status.failed, {}, error=f"unreadable {SUMMARY_FILE}: {error}")
    return Run(path, summary, read_metrics(path / METRICS_FILE))


def find_runs(dirs: list[Path]) -> list[Run]:
    for directory in dirs:
        if not directory.is_dir():
            raise ReportError(f"{directory} is not a directory")
    paths = {
        found.parents[len(marker.parts) - 1]
        for directory in dirs
        for marker in (Path(SUMMARY_FILE), JOB_CONFIG)
        for found in directory.rglob(str(marker))
    }
    if not paths:
        raise ReportError(
            f"no runs under {', '.join(map(str, dirs))}: found no {SUMMARY_FILE}; give a sweep "
            "directory or run directories written by python -m amp_exp"
        )
    return [load_run(path) for path in sorted(paths, key=_natural_key)]
