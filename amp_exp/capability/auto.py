"""precision=auto: time the run's own model in each plausible precision by the speed trial's
method, and train in a lower precision only where the trial establishes it faster than fp32.

Before training, the built model's forward+backward pass on one real batch runs under each
candidate's autocast: fp32, and each low precision that the probe's kernels of the model's kind
do not rule out (``Capability.trial_candidates``, ``device.kernels_of``). The passes are timed by
the speed trial's method (AB/BA rounds and their interval, ``rounds.pass_trials``), which the
composition root hands in as ``measure`` (amp_exp/build.py), so tests can time otherwise. What
the timings establish is the trial's one rule (``device.recommend``: faster only where the
interval lies wholly above 1 and the rounds do not trend). The trial leaves no trace: gradients
come from ``torch.autograd.grad``, so no ``.grad`` is written and no optimizer steps, and the
model's buffers (BatchNorm statistics) and every random number generator are restored
(``runtime.no_trace``). The run is then bit-identical to the same run with the chosen precision
requested.

The trial's speedups are cached per model config, batch shape, device and torch version, so a
second run (a sweep's other jobs) times nothing. Under torchrun, rank 0 decides and the other ranks
take its choice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from amp_exp.capability.cache import cache_dir, read_entries, write_entries
from amp_exp.capability.device import THE_MODEL, Capability, Found, kernels_of, recommend
from amp_exp.config.precisions import AUTO, REFERENCE, ResolvedPrecision, auto_candidates, get
from amp_exp.config.schema import PrecisionConfig, RunConfig
from amp_exp.report.words import show_speedup
from amp_exp.runtime.distributed import Distributed
from amp_exp.runtime.no_trace import leaves_no_trace
from amp_exp.tasks.base import Batch, Task
from amp_exp.tasks.workload import Workload
from amp_exp.training.precisions.base import PrecisionPlugin, create

log = logging.getLogger("amp_exp")

CACHE_FILE = "auto_precision.json"

# The speed trial's method: each low precision's speedup over fp32 from the candidates' passes
# (fp32's included), each a callable that runs one forward+backward, timed in the trial's rounds.
Measure = Callable[[Mapping[str, Callable[[], object]], torch.device], dict[str, Found]]


def resolve_precision(
    cfg: RunConfig,
    capability: Capability,
    workload: Workload,
    measure: Measure,
    distributed: Distributed | None = None,
) -> ResolvedPrecision:
    """The precision the run trains in, and why; precision=auto is decided here."""
    requested = cfg.precision.name
    if requested != AUTO:
        # The precision as conf/precision/ names it, however it was asked for (its plugin's).
        named = get(requested).variant_name(cfg.precision)
        return ResolvedPrecision(requested, f"requested: precision={named}")
    if distributed is None:
        return choose(cfg, capability, workload, measure)
    resolved = choose(cfg, capability, workload, measure) if distributed.is_main else None
    # The largest of rank 0's choice and the others' -1 is rank 0's choice.
    index = int(
        distributed.max(-1 if resolved is None else auto_candidates().index(resolved.precision))
    )
    return resolved or ResolvedPrecision(auto_candidates()[index], "auto: as rank 0 chose", True)


def choose(
    cfg: RunConfig, capability: Capability, workload: Workload, measure: Measure
) -> ResolvedPrecision:
    """Time the candidates by the speed trial (or reuse its cached speedups), pick by its rule."""
    kernels = kernels_of(workload.model)
    candidates = capability.trial_candidates(kernels)
    left_out = capability.left_out(kernels)
    if candidates == [REFERENCE]:
        return ResolvedPrecision(REFERENCE, f"auto: fp32, nothing else to try ({left_out})")
    # The batch too: a DataLoader seeds its workers from torch's generator.
    with leaves_no_trace(workload.model):
        batch = workload.task.to_device(next(iter(workload.data.train)))
        key = choice_key(cfg, capability, workload.channels_last, candidates, batch)
        found = cached_speedups(key, candidates)
        cached = found is not None
        if found is None:
            found = time_candidates(workload.model, workload.task, batch, candidates, measure)
            write_entries(CACHE_FILE, {key: found})
    chosen, why = pick(found)
    source = f"the speed trial on {THE_MODEL}"
    if cached:
        source += ", cached from an earlier run"
    reason = f"auto: {chosen} by {source}: {why}"
    return ResolvedPrecision(chosen, reason + (f"; {left_out}" if left_out else ""), True, found)


def pick(found: dict[str, Found]) -> tuple[str, str]:
    """precision=auto's choice from its trial: the doctor's recommendation (``recommend``),
    each trial's figure and interval quoted, or why it was not measured."""
    chosen, why = recommend(found)
    shown = [
        f"{p} {show_speedup(f)}" if "ratio" in f else f"{p} not measured ({f['not_measured']})"
        for p, f in found.items()
    ]
    return chosen, f"{'; '.join(shown)}; {why}"


def cached_speedups(key: str, candidates: Sequence[str]) -> dict[str, Found] | None:
    """The low candidates' speedups cached under ``key`` by an earlier run; None when there are
    none, or when one cannot be a measurement (then with a warning): they are timed again."""
    entry = read_entries(CACHE_FILE).get(key)
    if not isinstance(entry, dict):
        return None
    try:
        found = {p: entry[p] for p in candidates if p != REFERENCE}
    except KeyError:
        # An entry of an amp_exp that timed by fastest passes: no trial's figure to reuse.
        return None
    if why := implausible_speedup(found):
        log.warning(
            "%s holds speedups for this model that are no measurement (%s); timing again",
            cache_dir() / CACHE_FILE,
            why,
        )
        return None
    return found


def implausible_speedup(found: Mapping[str, Any]) -> str | None:
    """Why cached speedups cannot be the trial's, or None: each is why it was not measured, or a
    ratio inside an interval of positive finite numbers at a level between 0 and 1."""
    for precision, speedup in found.items():
        if isinstance(speedup, dict) and isinstance(speedup.get("not_measured"), str):
            continue
        try:
            low, high = (float(x) for x in speedup["ci"])
            ratio, level = float(speedup["ratio"]), float(speedup["confidence"])
            trend = speedup["trend"]["flag"]
        except (KeyError, TypeError, ValueError):
            return f"{precision}'s entry is no speed trial's"
        positive = all(math.isfinite(x) and x > 0 for x in (low, ratio, high))
        if not (positive and low <= ratio <= high and 0 < level < 1 and isinstance(trend, bool)):
            return f"{precision} {ratio!r}x [{low!r}, {high!r}] at {level!r}, trend {trend!r}"
    return None


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
            "candidates": list(candidates),
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
    model: nn.Module, task: Task, batch: Batch, candidates: Sequence[str], measure: Measure
) -> dict[str, Found]:
    """Each low candidate's speedup over fp32 on ``model``'s forward+backward on ``batch``, each
    pass under its candidate's autocast, as ``measure`` (the speed trial's rounds) finds it.

    Leaves no trace: no ``.grad`` written, and generators, buffers and modes restored.
    """
    device = next(model.parameters()).device
    plugins = {p: create(p, PrecisionConfig(name=p), device) for p in candidates}
    parameters = [p for p in model.parameters() if p.requires_grad]

    def pass_of(plugin: PrecisionPlugin) -> Callable[[], object]:
        def forward_backward() -> object:
            with plugin.forward_context():
                loss = task.loss(model, batch)
            return torch.autograd.grad(loss, parameters, allow_unused=True)

        return forward_backward

    with leaves_no_trace(model):
        model.train()
        return measure({p: pass_of(plugin) for p, plugin in plugins.items()}, device)
