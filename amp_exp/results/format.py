"""The results format, written down: summary.json and metrics.jsonl as versioned JSON Schemas
shipped in the package (``results/schema/*.v1.json``; docs/results_format.md explains every
field).

Every writer (the engine, ``amp_exp.record`` and the trainer callbacks of amp_exp/integrations/)
writes this format, and the tests hold each writer's files against the schemas. A reader checks
the version first: a summary of another version is refused in one line (exit 2), never half read.
A summary written before the version field existed is of version 1, the format it was written in.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from amp_exp.errors import ConfigError
from amp_exp.results.files import METRICS_FILE, SUMMARY_FILE

FORMAT_VERSION = 1
VERSION_KEY = "format_version"
SCHEMA_DIR = Path(__file__).resolve().parent / "schema"
SUMMARY_SCHEMA, METRICS_SCHEMA = "summary", "metrics"
# The problems a refusal names before "and N more": one line stays readable.
NAMED = 3


class OtherFormatVersion(ConfigError):
    """A summary of a results format this amp_exp does not read (exit 2)."""


@functools.cache
def schema(name: str) -> dict[str, Any]:
    """The shipped JSON Schema ``name`` (summary or metrics) of this format version."""
    return json.loads((SCHEMA_DIR / f"{name}.v{FORMAT_VERSION}.json").read_text(encoding="utf-8"))


def check_version(summary: dict[str, Any], where: Path | str) -> None:
    """Refuse, in one line, a summary of another format version."""
    version = summary.get(VERSION_KEY, FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise OtherFormatVersion(
            f"{where}: results format version {version!r}; this amp_exp reads version "
            f"{FORMAT_VERSION} (amp_exp/results/schema/); read it with the amp_exp that wrote it"
        )


def problems(instance: Any, name: str) -> list[str]:
    """Where ``instance`` breaks the schema ``name``, one phrase each; empty when it conforms."""
    from jsonschema import Draft202012Validator  # only validating needs it

    validator = Draft202012Validator(schema(name))
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
        for error in sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
    ]


def run_problems(run_dir: Path) -> list[str]:
    """Where a run directory's summary.json and metrics.jsonl break this format; refuses a
    summary of another version (``OtherFormatVersion``)."""
    summary = json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
    if isinstance(summary, dict):
        check_version(summary, run_dir / SUMMARY_FILE)
    found = [f"{SUMMARY_FILE} {problem}" for problem in problems(summary, SUMMARY_SCHEMA)]
    metrics = run_dir / METRICS_FILE
    lines = metrics.read_text(encoding="utf-8").splitlines() if metrics.is_file() else []
    for number, line in enumerate(lines, start=1):
        found += [
            f"{METRICS_FILE} line {number} {problem}"
            for problem in problems(json.loads(line), METRICS_SCHEMA)
        ]
    return found


def validate_run(run_dir: Path) -> None:
    """Raise ``ConfigError`` (one line) unless ``run_dir`` holds results of this format."""
    found = run_problems(run_dir)
    if found:
        more = f" and {len(found) - NAMED} more" if len(found) > NAMED else ""
        raise ConfigError(
            f"{run_dir} does not hold amp_exp results format {FORMAT_VERSION}: "
            f"{'; '.join(found[:NAMED])}{more}"
        )
