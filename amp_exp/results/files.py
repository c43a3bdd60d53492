"""The files of a run directory: their names, one atomic write, and strict JSON.

Every result file is written through ``runtime.atomic``: a crash at any moment leaves the old
file or the new one, never a torn one, and the file gets the mode any file the user creates gets.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from amp_exp.errors import RuntimeFault, first_line
from amp_exp.runtime.atomic import TMP_SUFFIX, atomic_write

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
# A failed attempt in the directory of a completed run: the completed summary.json stays.
FAILED_ATTEMPT_FILE = "summary.failed.json"
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.pt"
# Where a run directory keeps its W&B run id, for a resumed run to continue that run.
WANDB_RUN_ID_FILE = "wandb_run_id"
# Hydra writes a job's config here before the job runs, so it marks a run that left no summary.
JOB_CONFIG = Path(".hydra") / "config.yaml"
# Hydra writes the sweep's spec here, in the sweep directory, before the first job.
MULTIRUN_SPEC = "multirun.yaml"
REPORT_MD = "report.md"
REPORT_JSON = "report.json"
RUNS_CSV = "runs.csv"
# The interleaved speed trial (amp_exp/speed/): in its run directory, or a sweep's beside report.*
SPEED_JSON = "speed.json"
SPEED_MD = "speed.md"
# An evidence sweep's plan, looks and seeds (report/sequential.py).
EVIDENCE_JSON = "evidence.json"
SENSITIVITY_JSON = "sensitivity.json"
PREDICT_JSON = "predict.json"
PREDICT_MD = "predict.md"
# A sweep's roofline predictions (report.predict), beside its report: no command's finished mark.
PREDICTED_JSON = "predicted.json"


def json_safe(value: Any) -> Any:
    """``value`` with every inf and NaN, however deeply nested, replaced by None.

    JSON has no inf or NaN (Python writes bare ``NaN``, which strict readers such as jq or a
    browser refuse), and a diverged run is exactly when those values appear.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def json_line(row: dict[str, Any]) -> str:
    return json.dumps(json_safe(row), allow_nan=False)


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """``runtime.atomic.atomic_write``, with a write the file system refuses (a full disk, a
    quota, a read-only mount) raised as ``RuntimeFault`` in one line: ``path`` is left as it was."""
    try:
        atomic_write(path, write)
    except OSError as error:
        raise write_fault(path, error) from None


def write_fault(path: Path, error: OSError, state: str | None = None) -> RuntimeFault:
    """One line: what could not be written, why, and what is on disk (by default: the previous
    file, untouched)."""
    if state is None:
        state = f"the previous {path.name} is intact" if path.exists() else "nothing was written"
    reason = error.strerror or first_line(str(error))
    return RuntimeFault(f"could not write {path} ({reason}); {state}")


def write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda file: file.write(text.encode("utf-8")))


def write_json(path: Path, payload: dict[str, Any]) -> None:
    write_text(path, json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n")


def stale_temporaries(directory: Path) -> list[Path]:
    """Temporary files, and directories of sharded checkpoints, a killed save left there."""
    if not directory.is_dir():
        return []
    return sorted(directory.glob(f".*{TMP_SUFFIX}"))
