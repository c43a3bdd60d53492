"""The files of a run directory: their names, one atomic write, strict JSON, and reading as data.

Every result file is written through ``runtime.atomic``: a crash at any moment leaves the old
file or the new one, never a torn one, and the file gets the mode any file the user creates gets.

Every file amp_exp reads back from an output directory is read through ``read_data`` or
``read_json``: the directory may be one someone shared, or an artifact downloaded from W&B, so
its files are data that may be anything (docs/faults.md, "Files in an output directory").
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from amp_exp.errors import RunRefused, RuntimeFault, first_line
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


# Far above what amp_exp writes (a summary is some kB, a metrics row some hundred bytes, nesting
# about 6 deep), so only a file amp_exp did not write reaches them.
JSON_LIMIT = 64 * 2**20
# A run logging every step for a million steps writes about 500 MB.
METRICS_LIMIT = 2**30
MAX_DEPTH = 64


class UntrustedFile(RunRefused):
    """A file amp_exp reads back from an output directory is not one it can have written: a
    symbolic link, a FIFO, a device, larger or nested deeper than anything it writes, or content
    it does not write. Refused in one line (exit 2) before the command has changed anything."""


def damaged(path: Path, why: str) -> UntrustedFile:
    return UntrustedFile(f"{path} is damaged ({why}); nothing was changed: restore it or remove it")


def file_kind(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "an unknown kind of file")


def open_data(path: Path, flags: int = os.O_RDONLY) -> int:
    """A descriptor of ``path`` opened with ``flags``, if it is a regular file; ``UntrustedFile``
    for anything else. A missing file raises ``FileNotFoundError`` (unless ``flags`` create it).

    ``O_NOFOLLOW`` refuses a link in the last component (a directory given by a link, as a
    user's ``outputs/`` may be, is followed): nothing is read or written through one.
    ``O_NONBLOCK`` makes opening a FIFO return at once instead of waiting for a writer, so its
    type can be refused; on a regular file it changes nothing.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UntrustedFile(
                f"{path} is a symbolic link; amp_exp never writes one there, so it reads and "
                "writes nothing through it: replace it with the file itself"
            ) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UntrustedFile(f"{path} is {file_kind(mode)}, not a file amp_exp wrote; remove it")
    return fd


def read_data(path: Path, limit: int = JSON_LIMIT) -> bytes:
    """``path``'s bytes (``open_data``), if it holds at most ``limit``; ``UntrustedFile``
    otherwise: refused by its size before a byte is read, and, should it grow while it is read,
    once ``limit`` is passed."""
    too_large = UntrustedFile(
        f"{path} holds over {limit / 2**20:g} MiB, more than amp_exp writes there; remove it or "
        "move it elsewhere"
    )
    with os.fdopen(open_data(path), "rb") as file:
        if os.fstat(file.fileno()).st_size > limit or len(data := file.read(limit + 1)) > limit:
            raise too_large
    return data


def depth(value: Any) -> int:
    """How deep ``value``'s lists and dicts nest (a scalar: 0)."""
    if isinstance(value, dict):
        value = list(value.values())
    return 1 + max(map(depth, value), default=0) if isinstance(value, list) else 0


def parse_json(data: bytes, path: Path) -> Any:
    """``data`` (read from ``path``) parsed as JSON; ``UntrustedFile`` when it nests deeper
    than ``MAX_DEPTH``, ``ValueError`` when it is no JSON (``UnicodeDecodeError`` and
    ``json.JSONDecodeError`` both are). A file nested deeper than Python's recursion limit makes
    the parser raise ``RecursionError``: that too is too deep."""
    try:
        parsed = json.loads(data.decode("utf-8"))
        too_deep = depth(parsed) > MAX_DEPTH
    except RecursionError:
        too_deep = True
    if too_deep:
        raise UntrustedFile(
            f"{path} nests deeper than {MAX_DEPTH} levels, deeper than anything amp_exp writes; "
            "remove it"
        )
    return parsed


def read_json(path: Path, limit: int = JSON_LIMIT) -> Any:
    """``path`` read as data (``read_data``) and parsed as JSON (``parse_json``)."""
    return parse_json(read_data(path, limit), path)
