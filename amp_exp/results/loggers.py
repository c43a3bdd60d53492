"""Where metric rows go: the console and metrics.jsonl (the source of truth for reports).

A logger has ``log(row)`` and ``close()``. Rows hold plain Python numbers only; loggers never
touch tensors. Every row names its kind (``train``, ``eval``, ``diagnostics``, ``signals``) in
``row["kind"]``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from amp_exp.results.files import (
    METRICS_LIMIT,
    UntrustedFile,
    json_line,
    open_data,
    parse_json,
    read_data,
    write_fault,
    write_text,
)
from amp_exp.tasks.metrics import TaskMetrics

log = logging.getLogger("amp_exp")

TRAIN, EVAL, DIAGNOSTICS, SIGNALS = "train", "eval", "diagnostics", "signals"


class Logger(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """One JSON object per line, flushed per row so a killed run keeps everything logged.

    A row the file system refuses (a full disk, a quota) stops the run with one line
    (``RuntimeFault``); the rows before it stay, and a resume skips a line it tore.
    """

    def __init__(self, path: Path, append: bool = False) -> None:
        """``append`` continues the rows a resumed run carried over; otherwise start afresh.
        A link planted at ``path`` is refused (``open_data``): the rows never go where it points."""
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        try:
            self._file = os.fdopen(open_data(path, flags), "a", encoding="utf-8")
        except OSError as error:
            raise write_fault(path, error) from None

    def log(self, row: dict[str, Any]) -> None:
        try:
            self._file.write(json_line(row) + "\n")
            self._file.flush()
        except OSError as error:
            raise write_fault(self.path, error, "the rows before this one are kept") from None

    def close(self) -> None:
        # A row the disk refused is still in the buffer, and closing tries it once more; that
        # failure was raised when it happened, so it must not replace the run's own error now.
        with contextlib.suppress(OSError):
            self._file.close()


def read_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of a metrics.jsonl (``parse_rows``), read as data; none if it is missing."""
    try:
        data = read_data(path, METRICS_LIMIT)
    except FileNotFoundError:
        return [], 0
    return parse_rows(data, path)


def parse_rows(data: bytes, path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows in ``data`` (the bytes of ``path``, a metrics.jsonl), and how many lines could not
    be read: a line torn by a process killed mid-write, bytes that are not UTF-8, or JSON that is
    not a row (an object with its ``kind`` and ``step``)."""
    rows, unreadable = [], 0
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            row = parse_json(line, path)
        except UntrustedFile:
            raise
        except ValueError:  # UnicodeDecodeError and json.JSONDecodeError both are
            unreadable += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("kind"), str) and is_step(row.get("step")):
            rows.append(row)
        else:
            unreadable += 1
    return rows, unreadable


def is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def keep_metrics_until(source: Path, destination: Path, last_step: int) -> None:
    """Carry ``source``'s rows up to ``last_step`` into ``destination``, which a resumed run
    then appends to; rows logged after the checkpoint would otherwise appear twice."""
    rows, unreadable = read_rows(source)
    if unreadable:
        log.warning("%s: skipped %d unreadable line(s), torn by a killed run", source, unreadable)
    kept = [json_line(row) for row in rows if row["step"] <= last_step]
    write_text(destination, "".join(f"{line}\n" for line in kept))


def progress_bar(done: int, total: int, width: int = 20) -> str:
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def describe_eval(row: dict[str, Any], metrics: TaskMetrics) -> str:
    """The eval row's metrics as the task declares them (label and format)."""
    return ", ".join(
        f"{metric.label} {_fmt(row[metric.name], metric.fmt)}"
        for metric in metrics.metrics
        if metric.name in row
    )


def describe_rate(row: dict[str, Any]) -> str:
    """samples/s; for language models tokens/s, and MFU where the device's peak is known."""
    if "tokens_per_s" not in row:
        return f"{_fmt(row['samples_per_s'], '.0f')} samples/s"
    mfu = "" if row.get("mfu") is None else f" | MFU {row['mfu']:.1%}"
    return f"{_fmt(row['tokens_per_s'], ',.0f')} tokens/s{mfu}"


class ConsoleLogger:
    """A progress line per log interval, through ``logging`` so Hydra also files it in train.log."""

    def __init__(self, total_steps: int, metrics: TaskMetrics, fp16: bool = True) -> None:
        """``fp16``: whether the run computes in fp16; another precision's diagnostics rows
        say what fp16 would do, labelled as such."""
        self.total_steps = total_steps
        self.metrics = metrics
        self.fp16 = fp16

    def log(self, row: dict[str, Any]) -> None:
        if row["kind"] == EVAL:
            log.info("eval @ step %d: %s", row["step"], describe_eval(row, self.metrics))
            return
        if row["kind"] == SIGNALS:
            return  # dozens of figures per row: metrics.jsonl and `amp_exp.forecast` read them
        if row["kind"] == DIAGNOSTICS:
            # An fp16 run has a scale to report against; another precision's row is hypothetical.
            head, scaled = "gradient range @ step %d, if this run were fp16: ", ""
            if self.fp16:
                head = "fp16 gradient range @ step %d: "
                scaled = f"{_fmt(row['grad_underflow_frac_scaled'], '.3%')} at the current scale, "
            log.info(
                head + "%s would flush to zero unscaled, %s%s would overflow; "
                "%s of weights unchanged over %s steps",
                row["step"],
                _fmt(row["grad_underflow_frac"], ".3%"),
                scaled,
                _fmt(row["grad_overflow_frac_scaled"], ".3%"),
                _fmt(row.get("stale_weight_frac"), ".1%"),
                row.get("stale_window_steps", "-"),
            )
            return
        scale = "" if row["scale"] is None else f" | scale {row['scale']:g}"
        skipped = f" | skipped {row['skipped_steps']}" if row["skipped_steps"] else ""
        log.info(
            "%s | loss %s | lr %s%s%s | %s",
            progress_bar(row["step"], self.total_steps),
            _fmt(row["loss"], ".4f"),
            _fmt(row["lr"], ".3g"),
            scale,
            skipped,
            describe_rate(row),
        )

    def close(self) -> None:
        pass
