"""Resuming a run: which config values it may change, the checkpoint it continues from, and
restoring the built engine from it.

A checkpoint continues one experiment. ``MAY_CHANGE`` is the one list of what may differ on
resume: how long and how visibly the run goes on (the step count, logging, checkpoints,
diagnostics, W&B), where its data is read from and how it is loaded, the sections other commands
read, and the precision itself within its family. Every other value (task, model, data, batch,
optimizer, schedule, seed, the precision's options, the trainer's numerics) is what is trained:
a change to it is refused with its old and new value, before anything is loaded. The same list
keys an evidence sweep's jobs (``trained_values``): a job is what it trains, never the flags it
was launched with. A run resumed with ``precision=auto`` keeps the precision it trained in;
``auto`` is not decided afresh.

A longer (or shorter) ``trainer.max_steps`` or ``trainer.epochs`` under a schedule that spans the
run keeps the schedule's horizon: the scheduler's state in the checkpoint carries it
(training/optim.py), so the steps trained so far and those to come follow the schedule the run
started with, and steps past its end run at its final learning rate.

``find_checkpoint`` runs before the run is built (the checkpoint may decide its precision);
``resume`` after. Every rank reads the checkpoint itself, and the ranks agree on it first. The
directory's claim (results/ownership.py) looks at the checkpoint with the same rules before
anything is written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from amp_exp.config.plain import flatten_config, plain_run_config
from amp_exp.config.precisions import AUTO, ResolvedPrecision, get
from amp_exp.config.schema import RunConfig
from amp_exp.errors import ConfigError, NoCheckpointLoads, RunRefused, RuntimeFault
from amp_exp.results.checkpoint import (
    UnusableCheckpoints,
    checkpoint_dir,
    load_newest_valid,
    load_shards,
    remove_stale_temporaries,
)
from amp_exp.results.files import METRICS_FILE
from amp_exp.results.loggers import keep_metrics_until
from amp_exp.results.summary import completed_summary

if TYPE_CHECKING:
    from amp_exp.runtime.distributed import Distributed
    from amp_exp.training.engine import Engine

log = logging.getLogger("amp_exp")

# The precision's name, which may change within its family (``_family``); a sweep's cells
# differ in it, so it is part of what a sweep's job trains.
PRECISION_NAME = "precision.name"
# What a resume may change: keys, or whole sections, of the config. docs/faults.md lists it.
MAY_CHANGE = frozenset(
    {
        # How this attempt was asked to start.
        "resume",
        # The step count (the schedule keeps its horizon).
        "trainer.max_steps",
        "trainer.epochs",
        # Logging and measuring: what is read from the run, never what it trains.
        "trainer.log_every",
        "trainer.eval_every",
        "trainer.eval_batches",
        "trainer.timing_warmup_steps",
        "checkpoint",
        "diagnostics",
        "wandb",
        # Where the data lives and how it is loaded.
        "dataset.root",
        "dataset.path",
        "dataset.download",
        "dataset.num_workers",
        "dataset.eval_batch_size",
        "dataset.cache_dir",
        # The other commands' sections, which a run carries and ignores.
        "report",
        "speed",
        "sensitivity",
        "predict",
        "evidence",
        # The precision itself, within its family.
        PRECISION_NAME,
    }
)
# The schedules that span the run: their horizon is the run's step count.
SPANNING_SCHEDULES = frozenset({"cosine", "onecycle"})
# A changed step count reads "trainer.max_steps: 10 -> 20" (config_changes).
HORIZON_KEYS = ("trainer.max_steps:", "trainer.epochs:")

# A checkpoint found to resume from: its path, and what it holds.
Found = tuple[Path, dict[str, Any]]


class Resumed(NamedTuple):
    # The checkpoint the engine was restored from; None when it starts fresh.
    path: str | None
    # Whether the run had already completed there (then nothing was restored).
    complete: bool = False


def may_change(key: str) -> bool:
    """Whether the dotted config ``key`` may change on resume."""
    return any(key == allowed or key.startswith(allowed + ".") for allowed in MAY_CHANGE)


def trained_values(config: dict[str, Any]) -> dict[str, Any]:
    """What a plain config trains, as dotted keys: every value outside ``MAY_CHANGE``, the
    precision's name and the seed included. Two jobs with equal ones train the same thing."""
    return {
        key: value
        for key, value in flatten_config(config).items()
        if key == PRECISION_NAME or not may_change(key)
    }


def _family(precision: Any) -> str:
    """The precisions a checkpoint moves between (their facts' ``autocast_family``: fp32 master
    weights and state, the model unconverted; the GradScaler state is dropped or started fresh,
    with a warning); any other is a family of its own."""
    if precision == AUTO or get(str(precision)).spec.autocast_family:
        return "autocast"
    return str(precision)


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refused, allowed): each a list of ``key: old -> new`` between two plain configs."""
    old, new = flatten_config(saved), flatten_config(current)
    refused, allowed = [], []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key), new.get(key)
        if key == "resume" or json.dumps(before) == json.dumps(after):
            continue
        change = f"{key}: {json.dumps(before)} -> {json.dumps(after)}"
        # Within the autocast family a precision change is a warning, not a new experiment.
        ok = _family(before) == _family(after) if key == PRECISION_NAME else may_change(key)
        (allowed if ok else refused).append(change)
    return refused, allowed


def check_same_experiment(cfg: RunConfig, saved: Any, source: str) -> list[str]:
    """Refuse ``cfg`` if it changes what ``saved`` (a plain config) trained; returns the changes
    it may make."""
    saved = saved if isinstance(saved, dict) else {}
    refused, allowed = config_changes(saved, plain_run_config(cfg))
    if refused:
        raise RunRefused(
            f"resume={cfg.resume}: {source} belongs to another experiment "
            f"({'; '.join(refused)}); these cannot change on resume, so resume with the "
            f"{source.removeprefix('the ')}'s values or start a new run directory"
        )
    return allowed


def data_position(
    progress: dict[str, Any], saved_world_size: int, world_size: int
) -> dict[str, Any]:
    """``progress`` with its place in the epoch moved to ``world_size`` ranks.

    ``batch_in_epoch`` counts batches of one rank's shard, and rank r takes every
    world_size-th sample of the epoch's shuffled order from the r-th on: after b batches of B
    samples on W ranks, the first b x B x W samples of that order are trained on, whatever W. On
    W' ranks the epoch goes on from there, rounded down to whole batches: less than one global
    batch is seen again, nothing is left out. Batches then hold other samples than an
    uninterrupted run's, and the global batch is B x W', so such a resume is not bit-exact.
    """
    if saved_world_size == world_size:
        return progress
    trained = progress["batch_in_epoch"] * saved_world_size
    return {**progress, "batch_in_epoch": trained // world_size}


def kept_precision(requested: str, found: Found | None) -> ResolvedPrecision | None:
    """What a resumed ``precision=auto`` trains in: the checkpoint's precision.

    Deciding again would let a changed timing cache turn a bf16 run into fp32 halfway, and the
    report would take it for an fp32 baseline. None for a fresh start or an explicit precision (a
    change within the autocast family is allowed, and the summary keeps the attempts apart).
    """
    if found is None or requested != AUTO:
        return None
    payload = found[1]
    saved = payload["precision"]
    chosen_by_auto = payload["config"]["precision"]["name"] == AUTO
    how = "as precision=auto chose it" if chosen_by_auto else "as requested then"
    return ResolvedPrecision(
        saved,
        f"auto: {saved}, kept from the checkpoint at step {payload['step']} ({how})",
        timed_on_model=chosen_by_auto,
    )


def resume_target(cfg: RunConfig, directory: Path) -> Path | None:
    """What ``resume=`` points at: the run directory (auto), a path, or None (a fresh start)."""
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        return directory.resolve()
    target = Path(cfg.resume).expanduser().resolve()
    if not target.exists():
        raise ConfigError(f"resume={cfg.resume}: no such file or directory")
    return target


def checkpoint_at(cfg: RunConfig, target: Path, look: bool = False) -> Found | None:
    """The checkpoint at ``target`` a resume starts from, of the same experiment; None when
    ``resume=auto`` finds none at all. ``look``: only a look at it (load_newest_valid)."""
    try:
        found = load_newest_valid(target, look)
    except UnusableCheckpoints as error:
        raise NoCheckpointLoads(
            f"resume={cfg.resume}: no checkpoint in {checkpoint_dir(target)} loads ({error}); "
            "nothing was changed. Move the files away to start over"
        ) from None
    if found is None:
        if cfg.resume != "auto":
            raise ConfigError(f"resume={cfg.resume}: no usable checkpoint there")
        return None
    check_same_experiment(cfg, found[1].get("config"), "the checkpoint")
    return found


def nothing_to_do(cfg: RunConfig, step: Any) -> str:
    return (
        f"resume={cfg.resume}: this run completed at step {step}; nothing to do, its results "
        "stay as they are"
    )


def find_checkpoint(
    cfg: RunConfig, output_dir: Path, distributed: Distributed | None
) -> Found | None:
    """The checkpoint ``cfg.resume`` points at and what it holds, or None (no resume, or nothing
    saved yet); one of another experiment is refused. Every rank reads it, and the ranks agree
    on it before anything is built."""
    target = resume_target(cfg, output_dir)
    if target is None:
        return None
    if (distributed is None or distributed.is_main) and target.is_dir():
        for stale in remove_stale_temporaries(target):
            log.info("removed %s, left by a save that was killed mid-write", stale)
    found = checkpoint_at(cfg, target)
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
        # Imported here: torch.distributed.fsdp would add about a second to every command's
        # pre-flight, which claims its directory by this module's rules.
        from amp_exp.runtime.fsdp import state_template

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
    sharded (DCP reshards it; the data position is carried over, see data_position).
    find_checkpoint refused another experiment already."""
    allowed = check_same_experiment(cfg, payload.get("config"), "the checkpoint")
    if allowed:
        log.info("resuming with changed settings: %s", "; ".join(allowed))
    # A changed step count under a schedule that spans the run: the scheduler's state in the
    # checkpoint keeps the horizon the run started with.
    horizon = [change for change in allowed if change.startswith(HORIZON_KEYS)]
    if horizon and cfg.scheduler.name.value in SPANNING_SCHEDULES:
        log.warning(
            "%s: the %s schedule keeps the horizon the run started with, so what was trained "
            "stays as planned; steps past its end run at its final learning rate",
            "; ".join(horizon),
            cfg.scheduler.name.value,
        )
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
