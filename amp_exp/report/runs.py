"""Finding runs on disk and reading what each one left: summary.json and metrics.jsonl.

It reads files alone, so a report works on runs copied from another machine and on runs logged
without W&B. A job that never wrote summary.json (SIGKILL, the OOM killer) is found by the config
Hydra saved before it ran, and listed as killed. What cannot be read is named in one line and
passed over: a summary.json that is no summary (the run is listed as failed), a field of the
wrong kind, a line of metrics.jsonl that is no row.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amp_exp.config.precisions import register
from amp_exp.errors import ConfigError, first_line
from amp_exp.results.files import JOB_CONFIG, METRICS_FILE, SUMMARY_FILE
from amp_exp.results.format import OtherFormatVersion, check_version
from amp_exp.results.loggers import read_rows
from amp_exp.results.summary import Status, make_summary

log = logging.getLogger("amp_exp")


class ReportError(ConfigError):
    """Nothing to report (bad input, exit 2); the message is one line that says why."""


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
    """The config Hydra saved before the job ran, to place a run that left no usable summary:
    typed, validated (which infers the task) and resolved, as a completed job's summary records
    it. One that no longer validates (its data gone, a schema changed since) is read as saved,
    its interpolations resolved where they resolve; a missing or broken file gives {}, and the
    run is listed all the same."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from amp_exp.config.plain import plain_run_config, typed_config
    from amp_exp.config.validate import validate

    try:
        saved = OmegaConf.load(path / JOB_CONFIG)
    except Exception:  # a missing or broken file of any kind
        return {}
    if not isinstance(saved, DictConfig):
        return {}
    try:
        return plain_run_config(validate(typed_config(saved)))
    except (ConfigError, OmegaConfBaseException) as error:
        log.warning("%s: its config does not validate (%s); read as saved", path, error)
    except Exception:  # a saved file that parses but holds what no config can be
        return {}
    try:
        return OmegaConf.to_container(saved, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException:
        return OmegaConf.to_container(saved, resolve=False)  # type: ignore[return-value]


# What the report computes with, by summary.json field, and the kind of value amp_exp writes
# there. A summary edited by hand or written by another program may hold anything; a field of
# another kind is left out (as if never measured), and said so, rather than failing the report
# of every run.
NUMBER = (int, float)


class Nullable:
    """A key that may be missing or null; ``inner`` otherwise."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner


FIELD_KINDS: dict[str, Any] = {
    **dict.fromkeys(
        ("model", "precision", "error", "strategy", "param_dtype", "reduce_dtype"), str
    ),
    **dict.fromkeys(("device_name", "peak_mem_kind", "stop_signal"), str),
    **dict.fromkeys(("world_size", "skipped_steps", "steps"), int),
    **dict.fromkeys(
        (
            "samples_per_s",
            "tokens_per_s",
            "mfu",
            "peak_mem_bytes",
            "state_bytes",
            "final_loss",
            "loss_floor",
        ),
        NUMBER,
    ),
    **dict.fromkeys(
        ("eval_acc", "eval_perplexity", "loss_scale", "stale_weight_frac", "suggested_init_scale"),
        NUMBER,
    ),
    "config": {"precision": Nullable(dict), "wandb": Nullable(dict)},
    "checks": {str: {"passed": Nullable(bool), "offenders": Nullable([str])}},
    "underflow": {"underflow_frac_scaled": Nullable(NUMBER)},
    "first_overflow": {"step": int, "loss_finite": bool, "parameters": [str]},
    "hardware": {"advice": Nullable([str])},
    # A plugin records what it likes there; the report reads these, where present.
    "precision_details": {
        "emulated": Nullable(bool),
        "converted_linears": Nullable([str]),
        "skipped_linears": Nullable({str: str}),
    },
}


def conforms(value: Any, kind: Any) -> bool:
    """Whether ``value`` (read from JSON) is of ``kind``: a type, NUMBER, [kind] (a list),
    {str: kind} (a mapping), or {key: kind} (an object with those keys; others may be there)."""
    if isinstance(kind, Nullable):
        return value is None or conforms(value, kind.inner)
    if isinstance(value, bool) and kind is not bool:
        return False  # JSON's true is no count or measure
    if isinstance(kind, list):
        return isinstance(value, list) and all(conforms(item, kind[0]) for item in value)
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            return False
        if str in kind:
            return all(conforms(item, kind[str]) for item in value.values())
        return all(
            conforms(value.get(key), inner) for key, inner in kind.items() if key in value
        ) and all(key in value for key, inner in kind.items() if not isinstance(inner, Nullable))
    return isinstance(value, kind)


def read_summary(path: Path) -> dict[str, Any]:
    """A run's summary.json, its fields of the wrong kind left out (and named); raises
    ValueError (or OSError) for a file that is no summary at all."""
    summary = json.loads((path / SUMMARY_FILE).read_bytes().decode("utf-8"))
    if not isinstance(summary, dict):
        raise ValueError(f"it holds a JSON {type(summary).__name__}, not an object")
    check_version(summary, path / SUMMARY_FILE)
    statuses = [status.value for status in Status]
    if summary.get("status") not in statuses:
        raise ValueError(
            f"its status is {summary.get('status')!r}, not one of {', '.join(statuses)}"
        )
    wrong = [
        key
        for key, kind in FIELD_KINDS.items()
        if summary.get(key) is not None and not conforms(summary[key], kind)
    ]
    if wrong:
        log.warning(
            "%s: left out %s, not of the kind amp_exp writes there",
            path / SUMMARY_FILE,
            ", ".join(wrong),
        )
    return {key: value for key, value in summary.items() if key not in wrong}


def killed_summary(path: Path) -> dict[str, Any]:
    """What a job that never wrote summary.json (SIGKILL, the OOM killer) shows in a report."""
    return make_summary(
        Status.killed,
        job_config(path),
        error=f"no {SUMMARY_FILE}: the process was killed (SIGKILL, out of memory) or is "
        "still running",
    )


def load_run(path: Path) -> Run:
    try:
        summary = read_summary(path)
    except FileNotFoundError:
        summary = killed_summary(path)
    except OtherFormatVersion:
        raise  # not a broken run: a format this report cannot judge, refused in one line
    except (OSError, ValueError) as error:
        # UnicodeDecodeError and json.JSONDecodeError are ValueErrors too.
        reason = first_line(str(error)) or type(error).__name__
        log.warning("%s: unreadable (%s); listed as failed", path / SUMMARY_FILE, reason)
        summary = make_summary(
            Status.failed, job_config(path), error=f"unreadable {SUMMARY_FILE}: {reason}"
        )
    register_own_plugin(path, summary)
    return Run(path, summary, read_metrics(path / METRICS_FILE))


def register_own_plugin(path: Path, summary: dict[str, Any]) -> None:
    """A run in a user's own precision (``precision._target_``) brings its plugin, so the report
    orders, labels and colours it by its facts; one that cannot be imported here is reported
    under its name alone."""
    target = ((summary.get("config") or {}).get("precision") or {}).get("_target_")
    if target:
        try:
            register(target)
        except ConfigError as error:
            log.warning("%s: %s; reported by its name alone", path, error)


def find_runs(dirs: list[Path]) -> list[Run]:
    return [load_run(path) for path in run_paths(dirs)]


def run_paths(dirs: list[Path]) -> list[Path]:
    """Every run directory under ``dirs`` (one with a summary.json or a job config), in order."""
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
    return sorted(paths, key=_natural_key)
