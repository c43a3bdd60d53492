"""Where metric rows go: the console and metrics.jsonl (the source of truth for reports).

A logger has ``log(row)`` and ``close()``. Rows hold plain Python numbers only; loggers never
touch tensors.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("amp_exp")

METRICS_FILE = "metrics.jsonl"


class Logger(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


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


class JsonlLogger:
    """One JSON object per line, flushed per row so a killed run keeps everything logged."""

    def __init__(self, path: Path, append: bool = False) -> None:
        """``append`` continues the rows a resumed run carried over; otherwise start afresh."""
        self.path = path
        self._file = path.open("a" if append else "w", encoding="utf-8")

    def log(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def keep_metrics_until(source: Path, destination: Path, last_step: int) -> None:
    """Carry ``source``'s rows up to ``last_step`` into ``destination``, which a resumed run
    then appends to; rows logged after the checkpoint would otherwise appear twice."""
    if not source.is_file():
        return
    rows = [
        line
        for line in source.read_text(encoding="utf-8").splitlines()
        if line.strip() and json.loads(line)["step"] <= last_step
    ]
    tmp = destination.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in rows), encoding="utf-8")
    tmp.replace(destination)


def progress_bar(done: int, total: int, width: int = 20) -> str:
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class ConsoleLogger:
    """A progress line per log interval, through ``logging`` so Hydra also files it in train.log."""

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps

    def log(self, row: dict[str, Any]) -> None:
        if "eval_acc" in row:
            log.info(
                "eval @ step %d: loss %s, accuracy %s",
                row["step"],
                _fmt(row["eval_loss"], ".4f"),
                _fmt(row["eval_acc"], ".2%"),
            )
            return
        if "grad_underflow_frac" in row:
            log.info(
                "fp16 gradient range @ step %d: %s would flush to zero unscaled, %s at the "
                "current scale, %s would overflow",
                row["step"],
                _fmt(row["grad_underflow_frac"], ".3%"),
                _fmt(row["grad_underflow_frac_scaled"], ".3%"),
                _fmt(row["grad_overflow_frac_scaled"], ".3%"),
            )
            return
        scale = "" if row["scale"] is None else f" | scale {row['scale']:g}"
        skipped = f" | skipped {row['skipped_steps']}" if row["skipped_steps"] else ""
        log.info(
            "%s | loss %s | lr %s%s%s | %s samples/s",
            progress_bar(row["step"], self.total_steps),
            _fmt(row["loss"], ".4f"),
            _fmt(row["lr"], ".3g"),
            scale,
            skipped,
            _fmt(row["samples_per_s"], ".0f"),
        )

    def close(self) -> None:
        pass
