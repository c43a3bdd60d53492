"""Checkpoints: atomic saves, safe loads, and exact restore of a run's full state.

A checkpoint is a plain dict of tensors and Python primitives, so ``torch.load`` reads it with
``weights_only=True``: a file that smuggles a pickled code payload is refused, never executed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy
import torch

from amp_exp.config import ConfigError
from amp_exp.engine import Engine, Progress

log = logging.getLogger("amp_exp")

CHECKPOINT_DIR = "checkpoints"
LAST = "last.pt"
STEP_FILE = re.compile(r"step_(\d+)\.pt$")


def atomic_save(payload: dict[str, Any], path: Path) -> None:
    """Write to a temporary file beside ``path``, fsync it, then rename it into place.

    A crash at any moment leaves either the old file or the new one, never a partial file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as tmp:
            torch.save(payload, tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def rng_state() -> dict[str, Any]:
    algorithm, keys, position, has_gauss, cached_gauss = numpy.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        # NumPy's key array is not a type weights_only accepts; a tensor of it is.
        "numpy": {
            "algorithm": algorithm,
            "keys": torch.from_numpy(keys.astype(numpy.int64)),
            "position": position,
            "has_gauss": has_gauss,
            "cached_gauss": cached_gauss,
        },
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    numpy.random.set_state(
        (
            np_state["algorithm"],
            np_state["keys"].numpy().astype(numpy.uint32),
            np_state["position"],
            np_state["has_gauss"],
            np_state["cached_gauss"],
        )
    )


def checkpoint_payload(
    engine: Engine, model: torch.nn.Module, progress: Progress, config: dict[str, Any]
) -> dict[str, Any]:
    scaler = engine.policy.scaler
    return {
        "format": 1,
        "model": model.state_dict(),
        "optimizer": engine.optimizer.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "scheduler": None if engine.scheduler is None else engine.scheduler.state_dict(),
        "progress": dataclasses.asdict(progress),
        "step": progress.step,
        "epoch": progress.epoch,
        "batch_in_epoch": progress.batch_in_epoch,
        "rng": rng_state(),
        "precision": engine.policy.precision.value,
        # Each rank's place in the epoch is counted in batches of its own shard.
        "world_size": engine.world_size,
        "config": config,
        # TorchVersion is a str subclass that weights_only refuses.
        "torch_version": str(torch.__version__),
    }


class CheckpointWriter:
    """Keeps ``last.pt`` current and the ``keep`` newest numbered step checkpoints."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory, self.keep = directory, keep

    def save(self, payload: dict[str, Any]) -> Path:
        if self.keep > 0:
            atomic_save(payload, self.directory / f"step_{payload['step']:08d}.pt")
            for old in step_checkpoints(self.directory)[self.keep :]:
                old.unlink(missing_ok=True)
        last = self.directory / LAST
        atomic_save(payload, last)
        return last


def step_checkpoints(directory: Path) -> list[Path]:
    """Numbered checkpoints, newest first."""
    found = [
        (int(m.group(1)), p) for p in directory.glob("step_*.pt") if (m := STEP_FILE.search(p.name))
    ]
    return [p for _, p in sorted(found, reverse=True)]


def candidates(target: Path) -> list[Path]:
    """Checkpoint files to try for ``target`` (a file, a run directory or its checkpoints/)."""
    if target.is_file():
        return [target]
    directory = target if target.name == CHECKPOINT_DIR else target / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    last = [directory / LAST] if (directory / LAST).is_file() else []
    return last + step_checkpoints(directory)


def load_newest_valid(target: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; a corrupt or unsafe one is reported and passed over."""
    for path in candidates(target):
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(payload, dict) or "progress" not in payload:
                raise ValueError("not an amp_exp checkpoint")
        except Exception as error:  # a truncated, foreign or malicious file: try an older one
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            log.warning("checkpoint %s is unusable (%s); trying the one before it", path, reason)
            continue
        return path, payload
    return None


def restore(engine: Engine, model: torch.nn.Module, payload: dict[str, Any]) -> None:
    """Put a built run back in the state the checkpoint recorded."""
    saved_world_size = payload.get("world_size", 1)
    if saved_world_size != engine.world_size:
        raise ConfigError(
            f"the checkpoint was written by {saved_world_size} data-parallel ranks and this run "
            f"has {engine.world_size}; resume with the same number of processes "
            "(torchrun --nnodes x --nproc_per_node)"
        )
    model.load_state_dict(payload["model"])
    engine.optimizer.load_state_dict(payload["optimizer"])
    if engine.scheduler is not None and payload["scheduler"] is not None:
        engine.scheduler.load_state_dict(payload["scheduler"])
    precision = engine.policy.precision.value
    scaler = engine.policy.scaler
    if payload["precision"] != precision:
        reset = (
            "a fresh GradScaler starts at precision.init_scale"
            if scaler is not None
            else "its GradScaler state is dropped"
            if payload["scaler"] is not None
            else "model, optimizer and schedule carry over unchanged"
        )
        log.warning("resuming a %s checkpoint in %s: %s", payload["precision"], precision, reset)
    elif scaler is not None:
        scaler.load_state_dict(payload["scaler"])
    engine.progress = Progress(**payload["progress"])
    restore_rng_state(payload["rng"])
