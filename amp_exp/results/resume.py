"""Resuming a run: the checkpoint it continues from, whether that checkpoint fits this run, and
restoring the built engine from it.

``find_checkpoint`` runs before the run is built (the checkpoint may decide its precision);
``resume`` after. Every rank reads the checkpoint itself, and the ranks agree on it first.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

from amp_exp.config.plain import plain_run_config
from amp_exp.config.schema import RunConfig
from amp_exp.errors import RunRefused, RuntimeFault
from amp_exp.results.checkpoint import load_shards, remove_stale_temporaries
from amp_exp.results.claim import check_same_experiment, nothing_to_do, resume_target
from amp_exp.results.claim import find_checkpoint as checkpoint_to_resume
from amp_exp.results.files import METRICS_FILE
from amp_exp.results.loggers import keep_metrics_until
from amp_exp.results.resume_rules import data_position, kept_horizon
from amp_exp.results.summary import completed_summary
from amp_exp.runtime.distributed import Distributed
from amp_exp.runtime.fsdp import state_template
from amp_exp.training.engine import Engine

log = logging.getLogger("amp_exp")

# A checkpoint found to resume from: its path, and what it holds.
Found = tuple[Path, dict[str, Any]]


class Resumed(NamedTuple):
    # The checkpoint the engine was restored from; None when it starts fresh.
    path: str | None
    # Whether the run had already completed there (then nothing was restored).
    complete: bool = False


def find_checkpoint(
    cfg: RunConfig, output_dir: Path, distributed: Distributed | None
) -> Found | None:
    """The checkpoint ``cfg.resume`` points at and what it holds, or None (no resume, or nothing
    saved yet); one of another experiment is refused (results.claim). Every rank reads it, and
    the ranks agree on it before anything is built."""
    target = resume_target(cfg, output_dir)
    if target is None:
        return None
    if (distributed is None or distributed.is_main) and target.is_dir():
        for stale in remove_stale_temporaries(target):
            log.info("removed %s, left by a save that was killed mid-write", stale)
    found = checkpoint_to_resume(cfg, target)
    # precision=auto (kept from the checkpoint, or decided by rank 0) and loading shards are
    # collectives: the ranks agree on the checkpoint (or none) first.
    check_ranks_resumed_alike(distributed, -1 if found is None else found[1]["step"])
    if found is None:
        log.info("resume=auto: no checkpoint in %s yet, starting fresh", output_dir)
    return found


def resume(
    cfg: RunConfig, engine: Engine, output_dir: Path, found: Found | None, writes: bool
) -> Resumed:
    """Restore ``engine`` from ``found`` (``find_checkpoint``'s), if there is one; ``writes``:
    whether this process keeps the run's files (rank 0), which carry the metrics over.

    Resuming a run that completed there restores nothing and says so.
    """
    if found is None:
        return Resumed(None)
    path, payload = found
    check_resumable(cfg, engine, payload)
    total_steps = engine.total_steps
    if payload["step"] >= total_steps and completed_summary(output_dir):
        log.info("%s", nothing_to_do(cfg, payload["step"]))
        return Resumed(None, complete=True)
    if payload["step"] > total_steps:
        # Its steps past the end cannot be undone: completing it would report more steps than
        # it was to train, with no evaluation at its end.
        raise RunRefused(
            f"resume={cfg.resume}: the checkpoint is at step {payload['step']}, past the "
            f"{total_steps} steps this run now trains; nothing was changed. Resume with "
            f"trainer.max_steps={payload['step']} or more, or start a new run directory"
        )
    if "sharded" in payload:
        with_optimizer = "optimizer" in payload["sharded"]
        template = state_template(engine.model, engine.optimizer, with_optimizer)
        payload = {**payload, **load_shards(path, template)}
    payload["progress"] = data_position(
        payload["progress"], payload["world_size"], engine.world_size
    )
    engine.load_state_dict(payload)
    if writes:
        # The run directory holds checkpoints/<file>; its history up to the checkpoint carries
        # over.
        keep_metrics_until(
            path.parent.parent / METRICS_FILE, output_dir / METRICS_FILE, payload["step"]
        )
    log.info("resumed from %s at step %d", path, payload["step"])
    return Resumed(str(path))


def check_resumable(cfg: RunConfig, engine: Engine, payload: dict[str, Any]) -> None:
    """Say what the resume changes, and refuse a checkpoint of another world size unless it is
    sharded (DCP reshards it; the data position is carried over, see
    resume_rules.data_position). find_checkpoint refused another experiment already."""
    allowed = check_same_experiment(cfg, payload.get("config"), "the checkpoint")
    if allowed:
        log.info("resuming with changed settings: %s", "; ".join(allowed))
    horizon = kept_horizon(payload.get("config") or {}, plain_run_config(cfg))
    if horizon is not None:
        log.warning("%s", horizon)
    saved_world_size = payload["world_size"]
    if saved_world_size != engine.world_size and "sharded" in payload:
        log.info(
            "resharding a checkpoint of %d ranks onto %d; the epoch goes on from the samples "
            "trained on so far, in global batches of the new size",
            saved_world_size,
            engine.world_size,
        )
    elif saved_world_size != engine.world_size:
        raise RuntimeFault(
            f"the checkpoint was written by {saved_world_size} data-parallel ranks and this run "
            f"has {engine.world_size}; resume with the same number of processes "
            "(torchrun --nnodes x --nproc_per_node)"
        )


def check_ranks_resumed_alike(distributed: Distributed | None, step: int) -> None:
    """Every rank reads the checkpoint itself; one that saw another file (or none) would train a
    diverging replica and, a step out of line, hang the others in a collective. ``step``: the
    checkpoint's (-1: none), before loading it."""
    if distributed is None:
        return
    lowest, highest = -distributed.max(-step), distributed.max(step)
    if lowest != highest:
        raise RuntimeFault(
            f"the ranks resumed at different steps ({lowest:.0f} to {highest:.0f}): every node "
            "must see the same run directory, on a file system they share"
        )
