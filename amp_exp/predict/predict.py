"""The prediction of a run's step on each device and precision of ``predict.*``: one trace,
then the roofline (predict/roofline.py) per pair, with speedups over bf16 and fp32."""

from __future__ import annotations

from typing import Any

from amp_exp.config.precisions import REFERENCE
from amp_exp.config.schema import RunConfig
from amp_exp.devices import PREDICTABLE
from amp_exp.predict.published import INTERVAL_RATE, STATED_INTERVAL
from amp_exp.predict.roofline import ASSUMPTIONS, predict_one
from amp_exp.predict.trace import StepTrace

# The speedups' baselines: fp32, and bf16, the usual mixed precision.
BASELINES = (REFERENCE, "bf16")


def speedup(baseline: dict, found: dict) -> float | None:
    """None where either has no step time (not supported, not fitting, not trainable)."""
    if baseline["step_time_s"] is None or found["step_time_s"] is None:
        return None
    return baseline["step_time_s"] / found["step_time_s"]


def intervals(found: dict, unit: str) -> dict[str, list[float]]:
    """Each throughput and speedup of a record as the stated interval around it
    (published.STATED_INTERVAL): a prediction, not a measurement, and this its uncertainty."""
    kinds = {"samples_per_s": "throughput", f"{unit}_per_s": "throughput"}
    kinds |= {f"speedup_vs_{baseline}": "speedup" for baseline in BASELINES}
    return {
        key: [found[key] / STATED_INTERVAL[kind], found[key] * STATED_INTERVAL[kind]]
        for key, kind in kinds.items()
        if found[key] is not None
    }


def predict_trace(cfg: RunConfig, trace: StepTrace) -> dict[str, Any]:
    """predict.json's content for a traced step."""
    devices = {}
    # ``predict.precisions`` with both baselines first.
    precisions = dict.fromkeys([*BASELINES, *cfg.predict.precisions])
    for key in cfg.predict.devices:
        device = PREDICTABLE[key]
        rows = {p: predict_one(cfg, trace, device, p) for p in precisions}
        for found in rows.values():
            for baseline in BASELINES:
                found[f"speedup_vs_{baseline}"] = speedup(rows[baseline], found)
            found["interval"] = intervals(found, trace.unit)
        devices[key] = {
            "label": device.label,
            "tflops": device.tflops,
            "hbm_tb_per_s": device.hbm_tb_per_s,
            "memory_gb": device.memory_gb,
            "sources": [device.source, device.memory_source],
            "precisions": rows,
        }
    return {
        "model": {
            "parameters": trace.parameters,
            "batch_size": trace.batch_size,
            "unit": trace.unit,
            "units_per_sample": trace.units_per_sample,
            "traced_ops": len(trace.ops),
            "flops_per_step": sum(op.flops for op in trace.ops),
        },
        "world_size": cfg.predict.world_size,
        "interconnect_gb_per_s": cfg.predict.interconnect_gb_per_s,
        "assumptions": list(ASSUMPTIONS),
        # The share of published figures (not held out) the stated intervals held.
        "interval_rate": INTERVAL_RATE,
        "interval_factors": dict(STATED_INTERVAL),
        "devices": devices,
    }
