"""Which config values a resumed run may change; every other value is what is trained.

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
"""

from __future__ import annotations

import json
from typing import Any

from amp_exp.config.plain import flatten_config
from amp_exp.config.precisions import AUTO, get
from amp_exp.training.capability import ResolvedPrecision

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
HORIZON_KEYS = ("trainer.max_steps", "trainer.epochs")


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


def kept_horizon(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What to say of a changed step count under a schedule that spans the run (it keeps its
    horizon, from the checkpoint); None where there is nothing to say."""
    old, new = flatten_config(saved), flatten_config(current)
    if str(new.get("scheduler.name")) not in SPANNING_SCHEDULES:
        return None
    changed = [
        f"{k}: {old.get(k)} -> {new.get(k)}" for k in HORIZON_KEYS if old.get(k) != new.get(k)
    ]
    if not changed:
        return None
    return (
        f"{'; '.join(changed)}: the {new['scheduler.name']} schedule keeps the horizon the run "
        "started with, so what was trained stays as planned; steps past its end run at its final "
        "learning rate"
    )


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


def kept_precision(
    requested: str, found: tuple[Any, dict[str, Any]] | None
) -> ResolvedPrecision | None:
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
