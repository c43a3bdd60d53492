"""The interleaved speed trial: how much faster than fp32 each precision trains a model, with a 95%
confidence interval.

One process builds the run once per precision exactly as training builds it (``amp_exp.build``:
the same model init, data, optimizer, precision policy and non-finite guard) and trains them in
turn through training/timing.py: warm-up steps of each, then ``speed.rounds`` rounds of
``speed.steps`` steps of each, in a fixed order. Round k's speedup is fp32's median step time
over the precision's, both of round k, so drift in the machine's load cancels; the report takes
their median and its distribution-free 95% interval (report/stats.py). The trial's engines are
its own: no run's weights, files or random numbers are touched, and nothing is saved.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any

import torch

from amp_exp.build import Built, build, global_batch_size
from amp_exp.config.schema import RunConfig, SpeedConfig
from amp_exp.report.compare import BASELINE
from amp_exp.report.stats import speedup
from amp_exp.runtime.hardware import device_name
from amp_exp.training.timing import interleave


def training_step(built: Built) -> Callable[[], object]:
    """One optimizer step of the built run, as its engine trains it (gradient accumulation,
    scaler, clipping, skip guard and scheduler included)."""
    engine = built.engine
    batches = engine.train_batches()
    interval_loss = torch.zeros((), device=engine.device)
    engine.model.train()
    return lambda: engine.train_step(batches, interval_loss, want_grad_norm=False)


def run_trial(configs: Mapping[str, RunConfig], speed: SpeedConfig) -> dict[str, Any]:
    """Time the runs ``configs`` describes (by precision label, fp32's under ``BASELINE``)
    against each other; returns the trial as speed.json records it."""
    if BASELINE not in configs:
        raise ValueError(f"a speed trial needs {BASELINE} to compare with")
    ordered = {BASELINE: configs[BASELINE], **configs}
    built = {label: build(cfg) for label, cfg in ordered.items()}
    timed = {label: b for label, b in built.items() if b.engine.policy.timed}
    fp32 = built[BASELINE]
    steps = interleave(
        {label: training_step(b) for label, b in timed.items()},
        fp32.device,
        speed.steps,
        speed.rounds,
        speed.warmup_steps,
    )
    # A round's median step: a neighbour's burst during one step does not move it.
    seconds = {label: [statistics.median(r) for r in rounds] for label, rounds in steps.items()}
    samples_per_step = global_batch_size(configs[BASELINE], 1)
    return {
        "model": configs[BASELINE].model.name,
        "setting": "",
        "device": fp32.device.type,
        "device_name": device_name(fp32.device),
        "samples_per_step": samples_per_step,
        "warmup_steps": speed.warmup_steps,
        "steps": speed.steps,
        "rounds": speed.rounds,
        # Each round's median step time.
        "ms_per_step": {label: [1e3 * s for s in values] for label, values in seconds.items()},
        "samples_per_s": {
            label: samples_per_step / statistics.median(values) for label, values in seconds.items()
        },
        "speedup": {
            label: speedup(seconds[BASELINE], values).as_dict()
            for label, values in seconds.items()
            if label != BASELINE
        },
        "not_timed": {label: "emulated fp8 is not timed" for label in built if label not in timed},
    }


def trial_markdown(trials: list[dict[str, Any]]) -> str:
    """speed.md: a table per trial, and how to read it."""
    lines = ["# amp_exp speed trial", ""]
    for trial in trials:
        subject = trial["model"] + (f" ({trial['setting']})" if trial.get("setting") else "")
        if "error" in trial:
            lines += [f"## {subject}", "", f"The trial failed: {trial['error']}", ""]
            continue
        lines += [
            f"## {subject}",
            "",
            f"{trial['device_name']}, {trial['samples_per_step']} samples per step: "
            f"{trial['warmup_steps']} warm-up steps of each precision, then {trial['rounds']} "
            f"rounds of {trial['steps']} timed steps of each, in turns.",
            "",
            "| precision | median ms/step | samples/s | speedup vs fp32 | 95% CI |",
            "|---|---|---|---|---|",
        ]
        for label, values in trial["ms_per_step"].items():
            found = trial["speedup"].get(label)
            shown = (
                ("1.00x", "-")
                if found is None
                else (
                    f"{found['median']:.2f}x",
                    f"[{found['ci95'][0]:.2f}x, {found['ci95'][1]:.2f}x]",
                )
            )
            lines.append(
                f"| {label} | {statistics.median(values):.3g} | "
                f"{trial['samples_per_s'][label]:,.1f} | {shown[0]} | {shown[1]} |"
            )
        lines += [f"- {label}: {why}" for label, why in trial["not_timed"].items()]
        lines.append("")
    lines.append(
        "Speedup: fp32's median step time over the precision's in the same round; the median "
        "over rounds, and its distribution-free 95% confidence interval (order statistics)."
    )
    return "\n".join(lines) + "\n"
