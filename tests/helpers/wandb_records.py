"""Read back what W&B wrote offline: the records of a ``run-<id>.wandb`` file.

Offline, W&B keeps history, config and summary only in this binary file: a 7-byte file header
(``:W&B``, a 2-byte magic number, a version byte), then 32 KiB blocks of records. Each record
has a 7-byte header (crc32 of type and payload, length, type) and a payload that is a
``wandb_internal_pb2.Record``. A record that does not fit in what is left of a block is split
into first, middle and last parts; a block tail too short for a header is padding.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto.wandb_internal_pb2 import Record

FILE_MAGIC = b":W&B"
HEADER_BYTES = 7
BLOCK_BYTES = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Record]:
    data = path.read_bytes()
    assert data.startswith(FILE_MAGIC), f"{path} is not a W&B run file"
    records: list[Record] = []
    pending = b""
    pos = HEADER_BYTES
    while pos + HEADER_BYTES <= len(data):
        room = BLOCK_BYTES - pos % BLOCK_BYTES
        if room < HEADER_BYTES:
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER_BYTES])
        payload = data[pos + HEADER_BYTES : pos + HEADER_BYTES + length]
        assert zlib.crc32(bytes([kind]) + payload) == crc, f"{path}: bad checksum at byte {pos}"
        pos += HEADER_BYTES + length
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            records.append(Record.FromString(pending))
    return records


def _key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def _values(items: Any) -> dict[str, Any]:
    return {_key(item): json.loads(item.value_json) for item in items}


@dataclass
class WandbRun:
    """One run as W&B recorded it."""

    id: str
    name: str
    group: str
    tags: list[str]
    job_type: str
    config: dict[str, Any]
    # One dict per history row, with W&B's "_step".
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    # define_metric calls, by metric name or glob.
    metrics: dict[str, Any] = field(default_factory=dict)
    # Record types in file order, e.g. to check that the run was finished ("exit").
    kinds: list[str] = field(default_factory=list)
    environments: list[Any] = field(default_factory=list)


def read_run(path: Path) -> WandbRun:
    records = read_records(path)
    runs = [r.run for r in records if r.HasField("run")]
    assert runs, f"{path} holds no run record"
    run = runs[-1]
    config = _values(run.config.update)
    summary: dict[str, Any] = {}
    history, metrics, environments = [], {}, []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update(_values(record.config.update))
        elif kind == "summary":
            summary.update(_values(record.summary.update))
            for item in record.summary.remove:
                summary.pop(_key(item), None)
        elif kind == "history":
            history.append(_values(record.history.item))
        elif kind == "metric":
            metrics[record.metric.name or record.metric.glob_name] = record.metric
        elif kind == "environment":
            environments.append(record.environment)
    config.pop("_wandb", None)
    return WandbRun(
        id=run.run_id,
        name=run.display_name,
        group=run.run_group,
        tags=list(run.tags),
        job_type=run.job_type,
        config=config,
        history=history,
        summary=summary,
        metrics=metrics,
        kinds=[r.WhichOneof("record_type") for r in records],
        environments=environments,
    )


def run_files(output_dir: Path) -> list[Path]:
    """The offline run files under a run's output directory, oldest first.

    An online attempt that failed leaves its own ``wandb/run-*`` directory; it is not read here.
    """
    return sorted(output_dir.glob("wandb/offline-run-*/run-*.wandb"))


def read_only_run(output_dir: Path) -> WandbRun:
    files = run_files(output_dir)
    assert len(files) == 1, f"expected one offline W&B run under {output_dir}, found {files}"
    return read_run(files[0])
