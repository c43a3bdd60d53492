"""precision=auto: time the run's own model in each plausible precision and train in the fastest.

Before training, a few forward+backward passes of the built model on one real batch run under
each candidate's autocast: fp32, and each low precision that the probe's kernels of the model's
kind do not rule out (``Capability.trial_candidates``, ``capability.kernels_of``). The
candidates take turns (training/timing.py) and each keeps its fastest pass;
``capability.pick_fastest`` names the winner. The trial leaves no trace: gradients come from
``torch.autograd.grad``, so no ``.grad`` is written and no optimizer steps, and the model's buffers
(BatchNorm statistics) and every random number generator are restored (``runtime.no_trace``).
The run is then bit-identical to the same run with the chosen precision requested.

The choice is cached per model config, batch shape, device and torch version, so a second run
costs nothing. Under torchrun, rank 0 decides and the other ranks take its choice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from amp_exp.config.precisions import AUTO, REFERENCE, auto_candidates, plugin_of
from amp_exp.config.schema import PrecisionConfig, RunConfig
from amp_exp.runtime.cache import (
    WIDE_SPREAD,
    cache_dir,
    implausible_times,
    ratio_spread,
    read_entries,
    write_entries,
)
from amp_exp.runtime.distributed import Distributed
from amp_exp.runtime.no_trace import leaves_no_trace
from amp_exp.tasks.base import Batch, Task
from amp_exp.tasks.workload import Workload
from amp_exp.training.capability import Capability, ResolvedPrecision, kernels_of, pick_fastest
from amp_exp.training.precision import PrecisionPolicy
from amp_exp.training.timing import interleave

log = logging.getLogger("amp_exp")

CACHE_FILE = "auto_precision.json"
# Timed passes per candidate, after one untimed warm-up pass each.
PASSES = 3


def resolve_precision(
    cfg: RunConfig,
    capability: Capability,
    workload: Workload,
    distributed: Distributed | None = None,
) -> ResolvedPrecision:
    """The precision the run trains in, and why; precision=auto is decided here."""
    requested = cfg.precision.name
    if requested != AUTO:
        return ResolvedPrecision(requested, f"requested: precision={variant_name(cfg.precision)}")
    if distributed is None:
        return choose(cfg, capability, workload)
    resolved = choose(cfg, capability, workload) if distributed.is_main else None
    # The largest of rank 0's choice and the others' -1 is rank 0's choice.
    index = int(
        distributed.max(-1 if resolved is None else auto_candidates().index(resolved.precision))
    )
    return resolved or ResolvedPrecision(auto_candidates()[index], "auto: as rank 0 chose", True)


def variant_name(precision: PrecisionConfig) -> str:
    """The precision as conf/precision/ names it, however it was asked for (its plugin's)."""
    return plugin_of(precision.name).variant_name(precision)


def choose(cfg: RunConfig, capability: Capability, workload: Workload) -> ResolvedPrecision:
    """Time the candidates (or reuse the cached times) and pick the fastest."""
    kernels = kernels_of(workload.model)
    candidates = capability.trial_candidates(kernels)
    left_out = capability.left_out(kernels)
    if candidates == [REFERENCE]:
        return ResolvedPrecision(REFERENCE, f"auto: fp32, nothing else to try ({left_out})")
    # The batch too: a DataLoader seeds its workers from torch's generator.
    with leaves_no_trace(workload.model):
        batch = workload.task.to_device(next(iter(workload.data.train)))
        key = choice_key(cfg, capability, workload.channels_last, candidates, batch)
        cached = cached_ms(key, candidates)
        if cached is not None:
            ms, spread = cached
            seconds = {p: ms[p] / 1e3 for p in candidates}
        else:
            seconds, spread = time_candidates(workload.model, workload.task, batch, candidates)
            ms = {p: s * 1e3 for p, s in seconds.items()}
            write_entries(CACHE_FILE, {key: {"ms": ms, "spread": spread}})
    chosen, why = pick_fastest(seconds)
    source = f"fastest of {PASSES} passes, spread {max(spread.values()):.0%}"
    if cached is not None:
        source += ", cached from an earlier run"
    listed = ", ".join(f"{p} {milliseconds(s)}" for p, s in seconds.items())
    reason = f"auto: {chosen}; this model's forward+backward ({source}): {listed}; {why}"
    return ResolvedPrecision(chosen, reason + (f"; {left_out}" if left_out else ""), True)


def cached_ms(
    key: str, candidates: Sequence[str]
) -> tuple[dict[str, float], dict[str, float]] | None:
    """The candidates' times cached under ``key`` by an earlier run and their spreads; None when
    there are none, when they cannot be measurements (then with a warning), or when a spread is
    wider than ``WIDE_SPREAD``: they are timed again."""
    try:
        entry = read_entries(CACHE_FILE)[key]
        ms = {p: entry["ms"][p] for p in candidates}
        spread = {p: float(entry["spread"][p]) for p in candidates}
    except (KeyError, TypeError, ValueError):
        return None
    why = implausible_times(ms)
    if why:
        log.warning(
            "%s holds times for this model that are no measurement (%s); timing again",
            cache_dir() / CACHE_FILE,
            why,
        )
        return None
    if max(spread.values()) > WIDE_SPREAD:
        log.info(
            "precision=auto: the cached speeds of this model lie %.0f%% from their typical "
            "pass, more than %.0f%%; timing again",
            100 * max(spread.values()),
            100 * WIDE_SPREAD,
        )
        return None
    return ms, spread


def milliseconds(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def choice_key(
    cfg: RunConfig,
    capability: Capability,
    channels_last: bool,
    candidates: Sequence[str],
    batch: Batch,
) -> str:
    """What a timing depends on: the model, the batch, the device and torch, the candidates."""
    return json.dumps(
        {
            "model": dataclasses.asdict(cfg.model),
            "batch": batch_shapes(batch),
            "channels_last": channels_last,
            "device": capability.key,
            "candidates": [p for p in candidates],
        },
        sort_keys=True,
        default=str,
    )


def batch_shapes(batch: Batch) -> Any:
    """The shapes and dtypes of a batch's tensors, nested as the batch is."""
    if isinstance(batch, torch.Tensor):
        return [*batch.shape, str(batch.dtype)]
    if isinstance(batch, Mapping):
        return {key: batch_shapes(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [batch_shapes(item) for item in batch]
    return repr(batch)


def time_candidates(
    model: nn.Module, task: Task, batch: Batch, candidates: Sequence[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """Each candidate's fastest forward+backward of ``model`` on ``batch``, in seconds, and the
    spread: how far its speed figure lies from its typical pass (``runtime.cache.ratio_spread``).

    Leaves no trace: no ``.grad`` written, and generators, buffers and modes restored.
    """
    device = next(model.parameters()).device
    policies = {p: PrecisionPolicy(p, PrecisionConfig(name=p), device) for p in candidates}
    parameters = [p for p in model.parameters() if p.requires_grad]

    def pass_of(policy: PrecisionPolicy) -> Callable[[], object]:
        def forward_backward() -> object:
            with policy.autocast():
                loss = task.loss(model, batch)
            return torch.autograd.grad(loss, parameters, allow_unused=True)

        return forward_backward

    with leaves_no_trace(model):
        model.train()
        # In turns, so that a load spike slows one pass of each candidate, not all of one.
        seconds = interleave(
            {p: pass_of(policy) for p, policy in policies.items()}, device, 1, PASSES
        )
    passes = {p: [steps[0] for steps in rounds] for p, rounds in seconds.items()}
    spread = {p: ratio_spread(passes[REFERENCE], times) for p, times in passes.items()}
    return {p: min(times) for p, times in passes.items()}, spread
