"""The speed trial: how much faster than fp32 each precision trains a model, with a confidence
interval, timed until that interval is narrow enough.

Each precision is timed against fp32 in a pair of its own. The pair's two runs are built exactly
as training builds them (``amp_exp.build``: the same model init, data, optimizer, precision
policy and non-finite guard), each warmed up until its step time settles (training/timing.py's
``warm_up``), then trained ``speed.steps`` steps each in rounds whose order alternates, AB then
BA: each side runs first in exactly half the rounds, so a position effect (a cache the first
side warms for the second) cancels, and so does a linear drift of the machine's speed. The trial
runs ``speed.rounds`` rounds, then 10 more at a time until the speedup's 97.5% interval is
within ``speed.target_halfwidth``, or ``speed.max_rounds`` (capability/ratio.py's ``looks``). Then
both runs are freed before the next pair is built: no more than two runs are held at once, so a
model that fits twice fits the trial.

Round k's ratio is fp32's time per applied step over the precision's, both of round k: the
round's median step (a neighbour's burst during one step does not move it) times the steps over
the steps applied, so a skipped fp16 step, which is cheaper, costs its time without counting
as progress. The speedup is their geometric mean, order-adjusted, with an interval on the log
scale that holds under autocorrelated rounds (capability/ratio.py); beside it, the ratio of the
total times per applied step, which is what the wall clock sees. The trial's engines are its own: no
run's weights, files or random numbers are touched, and nothing is saved.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
from collections.abc import Callable, Mapping
from typing import Any

import torch

from amp_exp.build import Built, build, global_batch_size
from amp_exp.capability.ratio import LOOK_EVERY, MIN_ROUNDS, TRIAL_CONFIDENCE
from amp_exp.capability.rounds import Side, pair_speedup, play
from amp_exp.config.adaptive import SPEED_WARMUP_WINDOW
from amp_exp.config.schema import RunConfig, SpeedConfig
from amp_exp.report.compare import BASELINE, subject
from amp_exp.report.words import md_text, show_level, show_speedup
from amp_exp.results.contract import Stopped
from amp_exp.runtime.hardware import device_name, resolve_device
from amp_exp.training.timing import WARMUP_LEVEL


def training_step(built: Built) -> Callable[[], object]:
    """One optimizer step of the built run, as its engine trains it (gradient accumulation,
    scaler, clipping, skip guard and scheduler included)."""
    engine = built.engine
    batches = engine.train_batches()
    interval_loss = torch.zeros((), device=engine.device)
    engine.model.train()
    return lambda: engine.train_step(batches, interval_loss, want_grad_norm=False)


def engine_skips(built: Built) -> Callable[[], int]:
    """The run's skipped steps so far, read from the device (one host read, between rounds)."""
    engine = built.engine

    def skips() -> int:
        engine.read_skips()
        return engine.progress.skipped_steps

    return skips


def time_pair(baseline: RunConfig, label: str, cfg: RunConfig, speed: SpeedConfig) -> dict:
    """fp32 against one precision; the pair's record in speed.json (``"not_timed"`` alone for
    a precision whose policy is not timed). The caller frees the pair's runs."""
    built = build(cfg)
    if not built.engine.precision.timed:
        return {"not_timed": "emulated fp8 is not timed"}
    sides = {label: Side(training_step(built), engine_skips(built))}
    built = build(baseline)
    sides = {BASELINE: Side(training_step(built), engine_skips(built)), **sides}
    orders, reached, stopped = play(
        sides, label, built.device, speed, speed.steps, speed.max_warmup_steps
    )
    # The model of the rounds (a level, an order term, a spread) needs MIN_ROUNDS of them.
    if stopped is not None and len(orders) < MIN_ROUNDS:
        return {"not_timed": stopped_phrase(stopped, len(orders)), "stopped_by": stopped}
    found = {
        "order": [list(order) for order in orders],
        "warmup_steps": {key: side.warmup_steps for key, side in sides.items()},
        "steady": {key: side.steady for key, side in sides.items()},
        # Each round's median step time, and each side's skipped steps and wall time per
        # applied step over all its rounds.
        "ms_per_step": {
            key: [1e3 * statistics.median(steps) for steps in side.seconds]
            for key, side in sides.items()
        },
        "skipped_steps": {key: sum(side.skipped) for key, side in sides.items()},
        "ms_per_applied_step": {
            key: 1e3 * side.total_per_applied_step() for key, side in sides.items()
        },
        "speedup": {
            **pair_speedup(sides, label).as_dict(),
            # False: speed.max_rounds ended the trial before its interval was narrow enough.
            "target_reached": reached,
        },
    }
    if stopped is not None:
        found["stopped_by"] = stopped
        found["speedup"]["stopped_by"] = stopped.received.name
    return found


class TrialStopped(Stopped):
    """A signal stopped the trial; ``trial`` is its record of what it measured until then,
    marked with ``stopped_by``, for the caller to write before the command stops."""

    def __init__(self, stop: Stopped, trial: dict[str, Any]) -> None:
        super().__init__(stop.received)
        self.trial = trial


def stopped_phrase(stop: Stopped, rounds: int) -> str:
    return f"stopped by {stop.received.name} after {rounds} round(s), too few for a speedup"


# The label of a precision timed compiled by speed.compile: "bf16 compiled".
COMPILED = "compiled"


def compile_variants(configs: Mapping[str, RunConfig], speed: SpeedConfig) -> dict[str, RunConfig]:
    """The runs timed: as configured, or (``speed.compile``) each eager and/or compiled, every
    one against eager fp32, so that the eager and the compiled speedups share a baseline."""
    if speed.compile is None:
        return dict(configs)

    def compiled_as(cfg: RunConfig, compiled: bool) -> RunConfig:
        return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, compile=compiled))

    variants = {BASELINE: compiled_as(configs[BASELINE], False)}
    for label, cfg in configs.items():
        for compiled in dict.fromkeys(speed.compile):
            variants.setdefault(
                f"{label} {COMPILED}" if compiled else label, compiled_as(cfg, compiled)
            )
    return variants


def run_trial(
    configs: Mapping[str, RunConfig], speed: SpeedConfig, stand_in: str | None = None
) -> dict[str, Any]:
    """Time the runs ``configs`` describes (by precision label, fp32's under ``BASELINE``),
    each against fp32 in a pair of its own; returns the trial as speed.json records it.
    ``stand_in`` says what the single process stands in for (a torchrun job's world size and
    strategy): such a trial is shown, labelled, and kept out of the report's verdicts."""
    configs = compile_variants(configs, speed)
    baseline = configs[BASELINE]
    device = resolve_device(baseline.trainer.device)
    pairs, speedups, not_timed = {}, {}, {}
    stopped: Stopped | None = None
    for label, cfg in configs.items():
        if label == BASELINE:
            continue
        if stopped is not None:
            not_timed[label] = f"stopped by {stopped.received.name} before its turn"
            continue
        try:
            found = time_pair(baseline, label, cfg, speed)
        except Stopped as stop:  # while its runs were built or warmed up
            found = {"not_timed": stopped_phrase(stop, 0), "stopped_by": stop}
        # Give back the memory of the pair's runs before the next pair is built: an engine and
        # its callbacks refer to each other, so only the collector frees them.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        stopped = found.pop("stopped_by", None)
        if "not_timed" in found:
            not_timed[label] = found["not_timed"]
            continue
        speedups[label] = found.pop("speedup")
        pairs[label] = found
    trial = {
        "model": baseline.model.name,
        "setting": "",
        "device": device.type,
        "device_name": device_name(device),
        "stand_in": stand_in,
        "samples_per_step": global_batch_size(baseline, 1),
        "max_warmup_steps": speed.max_warmup_steps,
        # Warm-up ended where the Mann-Kendall test found no trend at this level.
        "warmup_level": WARMUP_LEVEL,
        "steps": speed.steps,
        "rounds": speed.rounds,
        "max_rounds": speed.max_rounds,
        "target_halfwidth": speed.target_halfwidth,
        "pairs": pairs,
        "speedup": speedups,
        "not_timed": not_timed,
    }
    if stopped is not None:
        trial["stopped_by"] = stopped.received.name
        raise TrialStopped(stopped, trial)
    return trial


def trial_markdown(trials: list[dict[str, Any]]) -> str:
    """speed.md: a table per trial, and how to read it."""
    lines = ["# amp_exp speed trial", ""]
    for trial in trials:
        # Models, settings, devices, labels and errors are recorded values: text, never markup.
        lines += [f"## {md_text(subject(trial['model'], trial.get('setting')))}", ""]
        if "error" in trial:
            lines += [f"The trial failed: {md_text(trial['error'])}", ""]
            continue
        if trial["stand_in"]:
            lines += [f"A {trial['stand_in']}: shown here, kept out of the report's verdicts.", ""]
        if trial.get("stopped_by"):
            lines += [
                f"**Partial: {trial['stopped_by']} stopped this trial.** Shown is what the rounds "
                "done before it measured.",
                "",
            ]
        device = md_text(trial["device_name"])
        lines += [
            f"{device}, {trial['samples_per_step']} samples per step: each precision "
            f"against {BASELINE} in a pair of its own, each side warmed up until its last "
            f"{2 * SPEED_WARMUP_WINDOW} step times showed no trend (Mann-Kendall, not rejected at "
            f"{show_level(trial['warmup_level'])}; at most {trial['max_warmup_steps']} steps), "
            f"then rounds of {trial['steps']} steps each, in "
            f"the orders AB, BA, AB, ...: {trial['rounds']} rounds, then a look every "
            f"{LOOK_EVERY} rounds up to {trial['max_rounds']}, stopping once the "
            f"{show_level(TRIAL_CONFIDENCE)} interval of the log ratio has a half-width below "
            f"{trial['target_halfwidth']:.3f} (x{math.exp(trial['target_halfwidth']):.2f} either "
            "way)",
            "",
            f"| precision | ms per applied step ({BASELINE} / it) | speedup vs {BASELINE} "
            "[CI, rounds], total time | warm-up steps | skipped steps |",
            "|---|---|---|---|---|",
        ]
        for label, pair in trial["pairs"].items():
            columns = ("ms_per_applied_step", "warmup_steps", "skipped_steps")
            ms, warm, skipped = (pair[column] for column in columns)
            unsteady = [key for key, steady in pair["steady"].items() if not steady]
            lines.append(
                f"| {md_text(label)} | {ms[BASELINE]:.3g} / {ms[label]:.3g} | "
                f"{show_speedup(trial['speedup'][label])} | "
                f"{warm[BASELINE]} / {warm[label]}"
                + (f" (not steady: {', '.join(unsteady)})" if unsteady else "")
                + f" | {skipped[BASELINE]} / {skipped[label]} |"
            )
        lines += [
            f"- {md_text(label)}: {md_text(why)}" for label, why in trial["not_timed"].items()
        ]
        lines.append("")
    lines.append(
        f"Speedup: each round's {BASELINE} median step over the precision's, each times its steps "
        "over its applied steps; the geometric mean over rounds, with a t interval on the log "
        "ratios. Total time: the wall-clock time per applied step, "
        f"{BASELINE}'s over the precision's. A TREND is Spearman's rank correlation of the log "
        "ratio with the round at p < 0.05: the rounds drifted, which the interval assumes they "
        "did not."
    )
    return "\n".join(lines) + "\n"
