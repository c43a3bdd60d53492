"""Checkpoint files: atomic saves, safe loads, and when a save is due.

A checkpoint is what ``Engine.state_dict()`` returns, plus where it came from (step, world size,
config, torch version). It is a plain dict of tensors and Python primitives, so ``torch.load``
reads it with ``weights_only=True``: a file that smuggles a pickled code payload is refused, never
executed.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from amp_exp.errors import first_line
from amp_exp.results.files import (
    CHECKPOINT_DIR,
    LAST_CHECKPOINT,
    stale_temporaries,
    write_atomically,
)
from amp_exp.training.loop import Progress

log = logging.getLogger("amp_exp")

FORMAT = 2
STEP_FILE = re.compile(r"step_(\d+)\.pt$")


def atomic_save(payload: dict[str, Any], path: Path) -> None:
    """A crash at any moment leaves either the old file or the new one, never a partial file."""
    write_atomically(path, lambda file: torch.save(payload, file))


class Checkpointer:
    """Saves every ``every_steps`` steps (0: only at the end) and when the run stops early.

    Keeps ``last.pt`` current and the ``keep`` newest numbered step checkpoints. Under torchrun
    every rank asks ``is_due`` at the same steps (the engine takes part in a collective before
    saving); the replicas are identical, so only the main rank writes.
    """

    def __init__(
        self,
        directory: Path,
        every_steps: int,
        keep: int,
        metadata: dict[str, Any],
        writes: bool = True,
    ) -> None:
        self.directory, self.every_steps, self.keep = directory, every_steps, keep
        self.metadata, self.writes = metadata, writes

    def is_due(self, progress: Progress, last: bool) -> bool:
        if last:
            return True
        # Inside a run of skipped steps a collapse may be starting: keep the last good
        # checkpoint rather than replace it with one that carries the collapsing scale.
        healthy = progress.consecutive_skips == 0
        return healthy and self.every_steps > 0 and progress.step % self.every_steps == 0

    def save(self, state: dict[str, Any]) -> None:
        if not self.writes:
            return
        progress = state["progress"]
        payload = {
            "format": FORMAT,
            **state,
            "step": progress["step"],
            "epoch": progress["epoch"],
            "batch_in_epoch": progress["batch_in_epoch"],
            **self.metadata,
            # TorchVersion is a str subclass that weights_only refuses.
            "torch_version": str(torch.__version__),
        }
        if self.keep > 0:
            atomic_save(payload, self.directory / f"step_{payload['step']:08d}.pt")
            for old in step_checkpoints(self.directory)[self.keep :]:
                old.unlink(missing_ok=True)
        atomic_save(payload, self.directory / LAST_CHECKPOINT)


def step_checkpoints(directory: Path) -> list[Path]:
    """Numbered checkpoints, newest first."""
    found = [
        (int(m.group(1)), p) for p in directory.glob("step_*.pt") if (m := STEP_FILE.search(p.name))
    ]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_dir(target: Path) -> Path:
    """The checkpoints/ folder of ``target`` (a run directory or that folder itself)."""
    return target if target.name == CHECKPOINT_DIR else target / CHECKPOINT_DIR


def candidates(target: Path) -> list[Path]:
    """Checkpoint files to try for ``target`` (a file, a run directory or its checkpoints/)."""
    if target.is_file():
        return [target]
    directory = checkpoint_dir(target)
    if not directory.is_dir():
        return []
    last = [directory / LAST_CHECKPOINT] if (directory / LAST_CHECKPOINT).is_file() else []
    return last + step_checkpoints(directory)


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Delete the temporary files saves killed mid-write left in ``target``'s checkpoints/."""
    stale = stale_temporaries(checkpoint_dir(target))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


class UnusableCheckpoints(Exception):
    """Checkpoint files exist, and none of them loads; ``reasons`` says why for each."""

    def __init__(self, reasons: dict[Path, str]) -> None:
        super().__init__("; ".join(f"{path.name}: {reason}" for path, reason in reasons.items()))
        self.reasons = reasons


def load_newest_valid(target: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads, or None when there is none at all.

    A corrupt or unsafe one is reported and passed over for an older one; when every one is
    unusable, ``UnusableCheckpoints`` is raised: a run must not take that for "no checkpoint yet"
    and start over on top of its history.
    """
    reasons: dict[Path, str] = {}
    for path in candidates(target):
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(payload, dict) or "progress" not in payload:
                raise ValueError("not an amp_exp checkpoint")
            if payload.get("format") != FORMAT:
                raise ValueError(
                    f"checkpoint format {payload.get('format')}, this amp_exp reads {FORMAT}"
                )
        except Exception as error:  # a truncated, foreign or malicious file: try an older one
            reasons[path] = first_line(str(error)) or repr(error)
            log.warning(
                "checkpoint %s is unusable (%s); trying the one before it", path, reasons[path]
            )
            continue
        return path, payload
    if reasons:
        raise UnusableCheckpoints(reasons)
    return None
