"""Checkpoint files: atomic saves, safe loads, and when a save is due.

A checkpoint is what ``Engine.state_dict()`` returns, plus where it came from (step, world size,
config, torch version). It is a plain dict of tensors and Python primitives, so ``torch.load``
reads it with ``weights_only=True``: a file that smuggles a pickled code payload is refused, never
executed.

Under FSDP2 a checkpoint is a directory, ``step_<N>/``: the model's and optimizer's shards in
DCP's format (torch.distributed.checkpoint: ``.metadata`` and a ``.distcp`` file per rank), which
loads on any number of ranks, and the rest of the state in ``engine.pt``, written by rank 0. DCP's
own reader would unpickle its files with Python's full unpickler; they are read through
``results.dcp_reader`` instead, which runs no code from them either. DCP and that reader are
imported only where a sharded checkpoint is saved or read: about 0.2 s of every start-up otherwise.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from amp_exp.config.precisions import get
from amp_exp.errors import RuntimeFault, first_line
from amp_exp.results.files import (
    CHECKPOINT_DIR,
    LAST_CHECKPOINT,
    TMP_SUFFIX,
    UntrustedFile,
    open_data,
    stale_temporaries,
    write_atomically,
)
from amp_exp.runtime.atomic import install_directory
from amp_exp.training.loop import Progress

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException

log = logging.getLogger("amp_exp")

# 3: every rank's random generators, and the skipped steps not yet read (training.skips).
FORMAT = 3
# step_<N>.pt, or a sharded checkpoint's step_<N>/ directory.
STEP_FILE = re.compile(r"step_(\d+)(\.pt)?$")
# In a sharded checkpoint: rank 0's part, and the file DCP writes once every shard is written.
ENGINE_STATE = "engine.pt"


def atomic_save(payload: dict[str, Any], path: Path) -> None:
    """A crash at any moment leaves either the old file or the new one, never a partial file."""

    def save_to(file: IO[bytes]) -> None:
        # torch's zip writer turns a write the file system refused into a RuntimeError
        # ("unexpected pos 15104 vs 15000"), the OSError (a full disk's ENOSPC) only its
        # context: raised as itself, write_atomically knows it.
        try:
            torch.save(payload, file)
        except RuntimeError as error:
            if isinstance(error.__context__, OSError):
                raise error.__context__ from None
            raise

    write_atomically(path, save_to)


def check_plugin_state(precision: str, plugin_state: Any) -> None:
    """Raise ``RuntimeFault`` (exit 4) naming the plugin when its ``state_dict()`` would not
    come back from a checkpoint: a value pickle cannot save (a lambda, a lock), or one a safe
    load refuses (any class but tensors, numbers, strings and containers). Checked at the first
    save, in memory, not found out only when a resume cannot load the run's checkpoints."""
    buffer = io.BytesIO()
    try:
        # torch.serialization's functions, not torch.save and torch.load: those stand for the
        # checkpoint's own writes and reads (save_to, read_checkpoint), and this is neither.
        torch.serialization.save(plugin_state, buffer)
        buffer.seek(0)
        torch.serialization.load(buffer, map_location="cpu", weights_only=True)
    except Exception as error:
        plugin = get(precision)
        refused = UNSAFE_GLOBAL.search(str(error))
        reason = f"it holds a {refused.group(1)}" if refused else first_line(str(error))
        raise RuntimeFault(
            f"the state_dict() of precision plugin {plugin.__qualname__} ({plugin.__module__}) "
            f"cannot be checkpointed so that it loads back ({reason}); return tensors, numbers, "
            "strings, lists and dicts from it"
        ) from None


# What torch's safe unpickler names when it refuses a class.
UNSAFE_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")


@dataclass
class Checkpointer:
    """Saves every ``every_steps`` steps (0: only at the end) and when the run stops early.

    Keeps ``last.pt`` current and the ``keep`` newest numbered step checkpoints. Under torchrun
    every rank asks ``is_due`` at the same steps (the engine takes part in a collective before
    saving); the replicas are identical, so only the main rank writes.
    """

    directory: Path
    every_steps: int
    keep: int
    metadata: dict[str, Any]
    writes: bool = True
    plugin_state_checked: bool = field(default=False, init=False)

    def is_due(self, progress: Progress, last: bool) -> bool:
        if last:
            return True
        # Inside a run of skipped steps a collapse may be starting: keep the last good
        # checkpoint rather than replace it with one that carries the collapsing scale.
        healthy = progress.consecutive_skips == 0
        return healthy and self.every_steps > 0 and progress.step % self.every_steps == 0

    def payload(self, state: dict[str, Any]) -> dict[str, Any]:
        if not self.plugin_state_checked and "plugin" in state:
            check_plugin_state(state["precision"], state["plugin"])
            self.plugin_state_checked = True
        progress = state["progress"]
        return {
            "format": FORMAT,
            **state,
            "step": progress["step"],
            "epoch": progress["epoch"],
            "batch_in_epoch": progress["batch_in_epoch"],
            **self.metadata,
            # TorchVersion is a str subclass that weights_only refuses.
            "torch_version": str(torch.__version__),
        }

    def save(self, state: dict[str, Any]) -> None:
        if not self.writes:
            return
        payload = self.payload(state)
        if self.keep > 0:
            atomic_save(payload, self.directory / f"step_{payload['step']:08d}.pt")
            for old in step_checkpoints(self.directory)[self.keep :]:
                old.unlink(missing_ok=True)
        atomic_save(payload, self.directory / LAST_CHECKPOINT)


class ShardedCheckpointer(Checkpointer):
    """FSDP2's checkpoints: every rank saves its shards, rank 0 the rest (``writes``).

    Each is written into ``.step_<N>.tmp/`` and renamed to ``step_<N>/`` once complete, so a
    step directory is never half written; the newest one is the last checkpoint, and
    ``max(keep, 1)`` of them are kept.
    """

    def save(self, state: dict[str, Any]) -> None:
        # The optimizer has no state before its first step (see runtime.fsdp.sharded_state).
        shards = {key: state[key] for key in ("model", "optimizer") if state[key] is not None}
        payload = self.payload(
            {**state, "model": None, "optimizer": None, "sharded": sorted(shards)}
        )
        final = self.directory / f"step_{payload['step']:08d}"
        # The same name on every rank; a leftover of a killed save is written over, a link
        # planted there never (the shards would go wherever it points).
        partial = self.directory / f".{final.name}{TMP_SUFFIX}"
        if partial.is_symlink():
            raise UntrustedFile(
                f"{partial} is a symbolic link; amp_exp never writes one there, so it saves "
                "nothing through it: remove it"
            )
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.save(shards, checkpoint_id=partial)
        except CheckpointException as error:  # a full disk on some rank, say
            raise RuntimeFault(
                f"could not write {partial} ({dcp_cause(error)}); the previous checkpoints are "
                "intact"
            ) from None
        if not self.writes:
            return
        atomic_save(payload, partial / ENGINE_STATE)
        install_directory(partial, final)
        for old in step_checkpoints(self.directory)[max(self.keep, 1) :]:
            shutil.rmtree(old)


def step_checkpoints(directory: Path) -> list[Path]:
    """Numbered checkpoints (files, or directories of shards), newest first."""
    found = [
        (int(m.group(1)), p) for p in directory.glob("step_*") if (m := STEP_FILE.fullmatch(p.name))
    ]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_dir(target: Path) -> Path:
    """The checkpoints/ folder of ``target`` (a run directory or that folder itself)."""
    return target if target.name == CHECKPOINT_DIR else target / CHECKPOINT_DIR


def candidates(target: Path) -> list[Path]:
    """Checkpoints to try for ``target`` (a checkpoint, a run directory or its checkpoints/)."""
    if target.is_file() or (target / ENGINE_STATE).is_file():
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
        if path.is_dir() and not path.is_symlink():  # a link goes, never what it points at
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return stale


class UnusableCheckpoints(Exception):
    """Checkpoint files exist, and none of them loads; ``reasons`` says why for each."""

    def __init__(self, reasons: dict[Path, str]) -> None:
        super().__init__("; ".join(f"{path.name}: {reason}" for path, reason in reasons.items()))
        self.reasons = reasons


def numbered_step(path: Path) -> int | None:
    """The step in a numbered checkpoint's name; None for last.pt or a file given by name."""
    match = STEP_FILE.fullmatch(path.name)
    return int(match.group(1)) if match else None


def load_newest_valid(target: Path, look: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint at the highest step that loads, or None when there is none at all.

    last.pt usually holds the newest step, but not always: a save that filled the disk may have
    written step_<N>.pt and failed on last.pt. So last.pt is read first, then each numbered
    checkpoint newer than what was found, newest first; last.pt wins a tie. A corrupt or unsafe
    one is reported and passed over for an older one; when every one is unusable,
    ``UnusableCheckpoints`` is raised: a run must not take that for "no checkpoint yet" and start
    over on top of its history. ``look`` only looks at what the checkpoints hold: their
    tensors are mapped instead of read, and what is passed over is not logged (the load that
    follows says so).
    """
    reasons: dict[Path, str] = {}
    best: tuple[Path, dict[str, Any]] | None = None
    for path in candidates(target):
        step = numbered_step(path)
        if best is not None and step is not None and step <= best[1]["step"]:
            break  # numbered checkpoints come newest first: none of the rest is newer
        try:
            if path != target and (path.is_symlink() or not path.is_dir()):
                # Found, not named by the user: a planted link or FIFO is no checkpoint (a FIFO
                # would block the load for ever).
                os.close(open_data(path))
            payload = read_checkpoint(path, mmap=look)
            if not (
                isinstance(payload, dict)
                and "progress" in payload
                and isinstance(payload.get("step"), int)
            ):
                raise ValueError("not an amp_exp checkpoint")
            if payload.get("format") != FORMAT:
                raise ValueError(
                    f"checkpoint format {payload.get('format')}, this amp_exp reads {FORMAT}"
                )
        except Exception as error:  # a truncated, foreign or malicious file: try an older one
            reasons[path] = first_line(str(error)) or repr(error)
            if not look:
                log.warning(
                    "checkpoint %s is unusable (%s); trying the one before it", path, reasons[path]
                )
            continue
        if best is None or payload["step"] > best[1]["step"]:
            best = path, payload
    if best is None and reasons:
        raise UnusableCheckpoints(reasons)
    return best


def read_checkpoint(path: Path, mmap: bool = False) -> Any:
    """A checkpoint file, or of a sharded checkpoint what rank 0 wrote, once its DCP files are
    known to hold only data (its shards load later, into this run's shapes: ``load_shards``)."""
    if not path.is_dir():
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    from amp_exp.results.dcp_reader import DCP_METADATA, check_checkpoint

    missing = [name for name in (DCP_METADATA, ENGINE_STATE) if not (path / name).is_file()]
    if missing:
        raise ValueError(f"incomplete sharded checkpoint: no {' or '.join(missing)}")
    check_checkpoint(path)
    return torch.load(path / ENGINE_STATE, map_location="cpu", weights_only=True, mmap=mmap)


def load_shards(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """Fill ``template`` (this run's sharded state dicts) from the checkpoint's shards, on any
    number of ranks: DCP reshards. Every rank calls this."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from amp_exp.results.dcp_reader import SafeFileSystemReader, SafeLoadPlanner

    try:
        dcp.load(
            template,
            checkpoint_id=path,
            storage_reader=SafeFileSystemReader(path),
            planner=SafeLoadPlanner(),
        )
    except CheckpointException as error:
        raise RuntimeFault(f"the shards of {path} do not load: {dcp_cause(error)}") from None
    return template


def dcp_cause(error: CheckpointException) -> str:
    """What went wrong, from DCP's error: every failed rank's traceback in one message (and a
    BaseException, which no ``except Exception`` would catch), whose last line says it."""
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__
