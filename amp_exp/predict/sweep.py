"""A sweep's roofline predictions (``report.predict=[h100]``): for each model and setting the
speed trial times, each precision's predicted speedup over fp32 on the named GPUs, written to the
sweep's predicted.json before its report is built. The report shows them beside the measured
trial, labelled as predictions; it never mixes them with what was measured.

The report callback (report/assemble.py) receives ``predict_sweep`` from conf/config.yaml, as it
receives the speed trial: tracing a step builds the model (on the meta device), a layer above the
report's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from amp_exp.devices import PREDICTABLE
from amp_exp.predict.predict import speedup
from amp_exp.predict.roofline import predict_one
from amp_exp.predict.trace import trace_step
from amp_exp.report.compare import BASELINE, assign_settings
from amp_exp.report.runs import find_runs
from amp_exp.results.files import PREDICTED_JSON, write_json
from amp_exp.speed.sweep import trial_config, trial_groups

log = logging.getLogger("amp_exp")


def predict_group(
    jobs: dict[str, Any], devices: list[str], trusted: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Per device, each precision label's predicted step time and speedup over fp32, from one
    trace of the fp32 job's step (every job of a group trains the same model on the same
    batch). A job's world size is predicted as it ran, its collectives at predict's stated
    interconnect bandwidth."""
    configs = {label: trial_config(run, trusted) for label, run in jobs.items()}
    for label, cfg in configs.items():
        cfg.predict.world_size = int(jobs[label].summary.get("world_size") or 1)
    trace = trace_step(configs[BASELINE])
    found: dict[str, Any] = {}
    for key in devices:
        device = PREDICTABLE[key]
        rows = {
            label: predict_one(cfg, trace, device, cfg.precision.name)
            for label, cfg in configs.items()
        }
        found[key] = {
            "label": device.label,
            "precisions": {
                label: {
                    "step_time_s": row["step_time_s"],
                    "speedup_vs_fp32": speedup(rows[BASELINE], row),
                    # The report's word for why there is no prediction.
                    "unavailable": row["why"],
                }
                for label, row in rows.items()
            },
        }
    return found


def predict_sweep(
    sweep_dir: Path, devices: list[str], trusted: frozenset[str] = frozenset()
) -> Path | None:
    """Write the sweep's predicted.json; returns its path, or None when no model and setting ran
    fp32 and another precision. A group whose trace fails is recorded with its error, and its
    report shows no prediction. ``trusted``: the code the sweep names (speed.sweep.trial_config)."""
    if not devices:
        return None
    runs = find_runs([sweep_dir])
    assign_settings(runs)
    predictions: list[dict[str, Any]] = []
    for (model, setting), jobs in trial_groups(runs).items():
        try:
            found: dict[str, Any] = {"devices": predict_group(jobs, devices, trusted)}
        except Exception as error:
            log.warning("no prediction for %s: %s", model, error)
            found = {"error": f"{type(error).__name__}: {error}"}
        predictions.append({**found, "model": model, "setting": setting})
    if not predictions:
        return None
    write_json(sweep_dir / PREDICTED_JSON, {"predictions": predictions})
    return sweep_dir / PREDICTED_JSON
