"""The files of a run directory: their names, one atomic write, and strict JSON.

Every result file is written to a temporary file beside it, flushed to disk and renamed into
place, so a crash at any moment leaves the old file or the new one, never a torn one. Every result
file, checkpoints included, gets the mode any file the user creates gets (0666 less the umask:
0644 usually): they hold weights and metrics, not secrets, and a shared project reads them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

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
REPORT_MD = "report.md"
REPORT_JSON = "report.json"
# Temporary files are named ".<target>.<random>.tmp"; a save killed mid-write leaves one behind.
TMP_SUFFIX = ".tmp"


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


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write`` on a temporary file beside ``path``, fsync it, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        # mkstemp creates 0600; give the file the mode open() would have.
        os.fchmod(handle, default_file_mode())
        with os.fdopen(handle, "wb") as tmp:
            write(tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)  # make the rename itself durable


def fsync_directory(path: Path) -> None:
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def install_directory(complete: Path, path: Path) -> None:
    """Rename the directory ``complete`` (written in full under a temporary name) to ``path``.

    A directory cannot replace another in one rename: one already at ``path`` is first renamed
    to a temporary name, so a crash between the renames leaves it there to be cleaned away, and
    ``path`` at any moment is absent, the old directory or the new one, never a mix.
    """
    fsync_directory(complete)  # the names of the files written into it
    aside = path.with_name(f".{path.name}.old{TMP_SUFFIX}")
    if path.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
    os.replace(complete, path)
    fsync_directory(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def default_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda file: file.write(text.encode("utf-8")))


def write_json(path: Path, payload: dict[str, Any]) -> None:
    write_text(path, json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n")


def stale_temporaries(directory: Path) -> list[Path]:
    """Temporary files, and directories of sharded checkpoints, a killed save left there."""
    if not directory.is_dir():
        return []
    return sorted(directory.glob(f".*{TMP_SUFFIX}"))
