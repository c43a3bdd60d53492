"""Finding runs on disk and reading what each one left: summary.json and metrics.jsonl.

It reads files alone, so a report works on runs copied from another machine and on runs logged
without W&B. Everything in them is data: a run in a precision no plugin installed here defines (a
user's own, named by ``precision._target_``) is shown by the facts its run recorded
(``precision_facts``: label, order, colour), or by its name; its module is never imported. A
job that never wrote summary.json (SIGKILL, the OOM killer) is found by the config Hydra saved
before it ran (results/recorded.py), and listed as killed. What cannot be read is named in one
line and passed over: a summary.json that is no summary (the run is listed as failed), a field of
the wrong kind, a line of metrics.jsonl that is no row; a completed run whose metrics.jsonl is
missing or cut short is listed as damaged, never judged. A file amp_exp cannot have written (a
link, a FIFO, one too large or nested too deep: results/files.py) stops the report in one line.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from amp_exp.config.precisions import get, names
from amp_exp.errors import ConfigError, first_line
from amp_exp.results.files import (
    JOB_CONFIG,
    METRICS_FILE,
    METRICS_LIMIT,
    SUMMARY_FILE,
    UntrustedFile,
    read_data,
    read_json,
)
from amp_exp.results.format import OtherFormatVersion, check_version
from amp_exp.results.loggers import TRAIN, parse_rows
from amp_exp.results.recorded import job_config
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


def read_metrics(path: Path, summary: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The rows of metrics.jsonl, a line cut short by a killed run left out; and why they cannot
    be the whole record of a run whose ``summary`` says it completed (None if they can, or if it
    did not complete): the file is missing, ends in a line cut short, or stops before the last
    step, which every run logs."""
    try:
        data = read_data(path, METRICS_LIMIT)
    except FileNotFoundError:
        data = None
    rows, unreadable = parse_rows(data or b"", path)
    if unreadable:
        log.warning("%s: skipping %d unreadable line(s)", path, unreadable)
    if summary.get("status") != Status.completed.value:
        return rows, None
    if data is None:
        return rows, f"its {METRICS_FILE} is missing"
    if data and not data.endswith(b"\n"):  # an empty file has no line to cut
        return rows, f"its {METRICS_FILE} ends in a line cut short"
    steps = summary.get("steps") or 0
    logged = max((row["step"] for row in rows if row["kind"] == TRAIN), default=0)
    if logged < steps:
        return rows, f"its {METRICS_FILE} logs training to step {logged} of {steps}"
    return rows, None


# What the report computes with, by summary.json field, and the kind of value amp_exp writes
# there. A summary edited by hand or written by another program may hold anything; a field of
# another kind is left out (as if never measured), and said so, rather than failing the report
# of every run.
NUMBER = (int, float)


@dataclass(frozen=True)
class Nullable:
    """A key that may be missing or null; ``inner`` otherwise."""

    inner: Any


FIELD_KINDS: dict[str, Any] = {
    **dict.fromkeys(("model", "precision", "error", "strategy", "param_dtype"), str),
    **dict.fromkeys(("reduce_dtype", "device_name", "peak_mem_kind", "stop_signal"), str),
    **dict.fromkeys(("world_size", "skipped_steps", "steps"), int),
    **dict.fromkeys(("samples_per_s", "tokens_per_s", "mfu", "peak_mem_bytes"), NUMBER),
    **dict.fromkeys(("state_bytes", "final_loss", "loss_floor", "eval_acc"), NUMBER),
    **dict.fromkeys(("eval_perplexity", "loss_scale", "stale_weight_frac"), NUMBER),
    "suggested_init_scale": NUMBER,
    "config": {"precision": Nullable(dict), "wandb": Nullable(dict)},
    "checks": {str: {"passed": Nullable(bool), "offenders": Nullable([str])}},
    "underflow": {"underflow_frac_scaled": Nullable(NUMBER)},
    "first_overflow": {"step": int, "loss_finite": bool, "parameters": [str]},
    "hardware": {"advice": Nullable([str])},
    # What the run's plugin said of itself: how a report shows a precision it has no plugin for.
    "precision_facts": {
        "label": str,
        "order": NUMBER,
        "colour": str,
        "grad_scaler": bool,
        "stall_advice": str,
    },
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
    ValueError (or OSError) for a file that is no summary at all, ``UntrustedFile`` for one
    amp_exp cannot have written (a link, a FIFO, nested too deep), which stops the report."""
    summary = read_json(path / SUMMARY_FILE)
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
    except (UntrustedFile, OtherFormatVersion):
        # Not a broken run: a file amp_exp cannot have written, or a format this report cannot
        # judge; either is refused in one line.
        raise
    except (OSError, ValueError) as error:
        # UnicodeDecodeError and json.JSONDecodeError are ValueErrors too.
        reason = first_line(str(error)) or type(error).__name__
        log.warning("%s: unreadable (%s); listed as failed", path / SUMMARY_FILE, reason)
        summary = make_summary(
            Status.failed, job_config(path), error=f"unreadable {SUMMARY_FILE}: {reason}"
        )
    remember_facts(summary)
    metrics, damage = read_metrics(path / METRICS_FILE, summary)
    if damage:
        # Listed with the runs that did not complete, and judged as none of them is.
        log.warning("%s: %s; listed as damaged", path, damage)
        summary = {**summary, "status": Status.damaged.value, "error": damage}
    return Run(path, summary, metrics)


class RecordedPlugin:
    """A precision plugin as its run recorded it (summary.json's ``precision_facts``): the
    facts and words a report reads of a plugin, as data, for a precision no plugin installed
    here defines."""

    variant_keys: tuple[str, ...] = ()

    def __init__(self, name: str, facts: dict[str, Any]) -> None:
        self.facts = facts
        spec = {key: facts[key] for key in ("order", "colour", "grad_scaler")}
        self.spec = SimpleNamespace(name=name, **spec)

    def variant_label(self, knobs: dict[str, Any]) -> str:
        return str(self.facts["label"])

    def stall_advice(self, knobs: dict[str, Any]) -> str:
        return str(self.facts["stall_advice"])


# Precision name -> what its runs recorded of a plugin this process does not have.
_recorded: dict[str, RecordedPlugin] = {}


def remember_facts(summary: dict[str, Any]) -> None:
    facts, name = summary.get("precision_facts"), summary.get("precision")
    if isinstance(facts, dict) and isinstance(name, str) and name not in names():
        _recorded.setdefault(name, RecordedPlugin(name, facts))


def report_plugin(name: str) -> Any:
    """What the report reads of precision ``name``'s plugin: the installed plugin's (built in,
    or an entry point), else the facts a run of it recorded, else None (shown by its name)."""
    return get(name) if name in names() else _recorded.get(name)


def report_order(name: str) -> float:
    """Where ``name`` comes in the report: its facts' order, unknown ones last."""
    plugin = report_plugin(name)
    return math.inf if plugin is None else plugin.spec.order


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
