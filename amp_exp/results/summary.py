"""summary.json: one schema for every way a run can end, and how a failure is recorded.

A completed, stopped, failed or killed run has the same keys; what a run never measured is null.
A report can then read any run without guessing which keys exist.
"""

from __future__ import annotations

import logging
import platform
from enum import Enum
from pathlib import Path
from typing import Any

from amp_exp.errors import first_line
from amp_exp.results.files import (
    FAILED_ATTEMPT_FILE,
    SUMMARY_FILE,
    UntrustedFile,
    read_json,
    write_json,
)
from amp_exp.results.format import FORMAT_VERSION, SUMMARY_SCHEMA, VERSION_KEY, schema
from amp_exp.results.provenance import git_sha

log = logging.getLogger("amp_exp")


class Status(str, Enum):
    completed = "completed"
    # A preemption signal ended the run early, after a checkpoint.
    stopped = "stopped"
    failed = "failed"
    # No summary was written (SIGKILL, the OOM killer); the report fills this one in.
    killed = "killed"
    # The summary says completed, and metrics.jsonl is missing or cut short: the report fills
    # this one in, and judges no such run as if its record were whole.
    damaged = "damaged"


# Every key of summary.json, in the order written: the shipped schema's (results/schema/
# summary.v1.json), which types and describes each.
FIELDS = tuple(schema(SUMMARY_SCHEMA)["required"])
# What places a run (a failed or killed one too), read from its config alone: the section's name.
IDENTITY = ("precision", "model", "dataset", "optimizer", "seed", "task")


def make_summary(
    status: Status,
    config: dict[str, Any],
    task_metrics: dict[str, Any] | None = None,
    eval_metrics: dict[str, Any] | None = None,
    **values: Any,
) -> dict[str, Any]:
    """A summary with every key of ``FIELDS``: those given, the run's identity from ``config``,
    and null for the rest. A key outside the schema is a programming error.

    ``task_metrics`` is the task's declaration; each metric it names gets a key right after it,
    holding its value from ``eval_metrics`` (null if the run never evaluated).
    """
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise KeyError(f"not summary.json fields: {', '.join(unknown)}")
    declared = [metric["name"] for metric in (task_metrics or {}).get("metrics", [])]
    undeclared = sorted(set(eval_metrics or {}) - set(declared))
    if undeclared:
        raise KeyError(f"eval metrics the task did not declare: {', '.join(undeclared)}")
    summary: dict[str, Any] = {}
    for key in FIELDS:
        summary[key] = None
        if key == "task_metrics":
            summary.update(dict.fromkeys(declared))
    summary["task_metrics"] = task_metrics
    summary.update(eval_metrics or {})
    for key in IDENTITY:
        section = config.get(key)
        summary[key] = section.get("name") if isinstance(section, dict) else section
    if status is not Status.killed:  # a killed run's code version is not the reader's
        import torch  # only runs import it; a report reading killed runs stays light

        summary.update(
            torch_version=str(torch.__version__),
            python_version=platform.python_version(),
            git_sha=git_sha(),
        )
    summary.update(values)
    summary.update(status=Status(status).value, config=config, **{VERSION_KEY: FORMAT_VERSION})
    return summary


def record_failure(
    output_dir: Path,
    config: dict[str, Any],
    error: Exception,
    task_metrics: dict[str, Any] | None = None,
) -> Path:
    """Write the failure summary; beside, never over, a completed run's summary.json."""
    path = output_dir / SUMMARY_FILE
    if completed_summary(output_dir) is not None:
        path = output_dir / FAILED_ATTEMPT_FILE
        log.error(
            "this run completed before; its summary.json is kept, this failure is in %s", path
        )
    # task_metrics, where the task is known, gives it a completed run's metric keys (null).
    error_line = f"{type(error).__name__}: {first_line(str(error))}"
    write_json(path, make_summary(Status.failed, config, task_metrics, error=error_line))
    return path


def completed_summary(output_dir: Path) -> dict[str, Any] | None:
    """The run directory's summary.json, if it records a completed run; ``UntrustedFile`` for one
    amp_exp cannot have written (a link, a FIFO), which no command may take for absent."""
    try:
        summary = read_json(output_dir / SUMMARY_FILE)
    except UntrustedFile:
        raise
    except (OSError, ValueError):
        return None
    completed = isinstance(summary, dict) and summary.get("status") == Status.completed.value
    return summary if completed else None
