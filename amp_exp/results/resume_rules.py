"""Which config values a resumed run may change, and which would make it another experiment.

A checkpoint continues one experiment. Changing what is trained (task, model, data, batch,
optimizer, schedule, seed, precision family) would either run silently on different data or fail
deep inside ``load_state_dict``; so those are refused, before anything is loaded. How long and how
visibly the run goes on (``max_steps``, logging, W&B, checkpoints) may change. A run resumed
with ``precision=auto`` keeps the precision it trained in; ``auto`` is not decided afresh.
"""

from __future__ import annotations

import json
from typing import Any

from amp_exp.config.plain import flatten_config
from amp_exp.config.precisions import AUTO, spec_of
from amp_exp.training.capability import ResolvedPrecision

# Sections and keys whose change makes another experiment.
FIXED = (
    "task",
    "model",
    "dataset",
    "optimizer",
    "scheduler",
    "seed",
    "trainer.grad_accum_steps",
    # DDP checkpoints are whole files, FSDP2's are directories of shards.
    "trainer.strategy",
)
# Inside those: where the data lives and how it is loaded, which do not change what is trained.
MOVABLE = frozenset(
    {
        "dataset.root",
        "dataset.path",
        "dataset.download",
        "dataset.num_workers",
        "dataset.eval_batch_size",
        "dataset.cache_dir",
    }
)
# How this attempt was asked to start says nothing about the experiment.
IGNORED = frozenset({"resume"})


def _is_fixed(key: str) -> bool:
    if key in MOVABLE:
        return False
    return any(key == fixed or key.startswith(fixed + ".") for fixed in FIXED)


def _family(precision: Any) -> str:
    """The precisions a checkpoint moves between (their facts' ``autocast_family``: fp32 master
    weights and state, the model unconverted; the GradScaler state is dropped or started fresh,
    with a warning); any other is a family of its own."""
    if precision == AUTO or spec_of(str(precision)).autocast_family:
        return "autocast"
    return str(precision)


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refused, allowed): each a list of ``key: old -> new`` between two plain configs."""
    old, new = flatten_config(saved), flatten_config(current)
    refused, allowed = [], []
    for key in sorted((old.keys() | new.keys()) - IGNORED):
        before, after = old.get(key), new.get(key)
        if json.dumps(before) == json.dumps(after):
            continue
        change = f"{key}: {json.dumps(before)} -> {json.dumps(after)}"
        # Within the autocast family a precision change is a warning, not a new experiment.
        same_family = key == "precision.name" and _family(before) == _family(after)
        fixed = _is_fixed(key) or (key == "precision.name" and not same_family)
        (refused if fixed else allowed).append(change)
    return refused, allowed


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
