"""The comparison: each run against the completed fp32 run of its model and setting, and the
verdict line per model that says what each precision bought, and at what cost."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from amp_exp.config.plain import flatten_config
from amp_exp.report.runs import Run
from amp_exp.tasks.metrics import TaskMetrics, ToleranceUnit

BASELINE = "fp32"
# Within a model the baseline comes first, then the precisions compared with it.
PRECISION_ORDER = {"fp32": 0, "bf16": 1, "fp16": 2, "bf16_true": 3, "fp8": 4}
# Knobs that make a variant of a precision mode; the run's precision label names them.
VARIANT_KEYS = {
    "precision.stochastic_rounding",
    "precision.fp8_recipe",
    "precision.fp8_emulate",
    "precision.fp8_skip_first_last",
}
# The keys a comparison is about; every other config key that differs is part of a run's setting.
COMPARED_KEYS = {"model.name", "precision.name", *VARIANT_KEYS}
# A run in which at least this share of the weights did not move over the last diagnostics
# interval has stalled.
STALL_FRACTION = 0.5
NOT_ENGAGED = "did not engage"


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def varied_keys(runs: list[Run]) -> list[str]:
    """The flat config keys (``optimizer.lr``) whose values differ between ``runs``, in config
    order. Runs whose summary holds no config are left out."""
    flats = [flatten_config(run.summary["config"]) for run in runs if "config" in run.summary]
    keys = dict.fromkeys(key for flat in flats for key in flat)
    return [key for key in keys if len({json.dumps(flat.get(key)) for flat in flats}) > 1]


def assign_settings(runs: list[Run]) -> None:
    """Name, for each run, the config values in which it differs from the runs of its model.

    fp16 with clipping is then compared with fp32 with clipping, not with fp32 without it. Runs
    whose summary holds no config are left with an empty setting.
    """
    for model in dict.fromkeys(run.model for run in runs):
        group = [run for run in runs if run.model == model and "config" in run.summary]
        varied = [key for key in varied_keys(group) if key not in COMPARED_KEYS]
        flats = [flatten_config(run.summary["config"]) for run in group]
        for run, flat in zip(group, flats, strict=True):
            run.setting = ", ".join(f"{key}={_override_value(flat.get(key))}" for key in varied)


def audit_of(summary: dict[str, Any]) -> dict[str, Any]:
    """The run's precision audit (training/audit/), or nothing for a run without one."""
    return summary.get("precision_audit") or {}


def engaged(summary: dict[str, Any]) -> bool | None:
    """Whether the run's audit found its precision engaged; None when it was not audited."""
    return audit_of(summary).get("engaged")


def find_baseline(run: Run, runs: list[Run]) -> Run | None:
    """The completed fp32 run of the same model and setting, if its fp32 engaged."""
    return next(
        (
            other
            for other in runs
            if other.completed
            and other.precision == BASELINE
            and engaged(other.summary) is not False
            and other.model == run.model
            and other.setting == run.setting
        ),
        None,
    )


def precision_label(summary: dict[str, Any]) -> str:
    """The precision as the report shows it: the mode, the variant of bf16_true or fp8, and
    whether it did not engage (then the run's figures are not that precision's)."""
    precision = str(summary.get("precision") or "?")
    knobs = (summary.get("config") or {}).get("precision") or {}
    if precision == "bf16_true" and knobs.get("stochastic_rounding") is False:
        precision = "bf16_true (nearest)"
    elif precision == "fp8":
        details = [str(knobs.get("fp8_recipe", "tensorwise"))]
        if knobs.get("fp8_skip_first_last") is False:
            details.append("all linears")
        if knobs.get("fp8_emulate"):
            details.append("emulated")
        precision = f"fp8 ({', '.join(details)})"
    return f"{precision} ({NOT_ENGAGED})" if engaged(summary) is False else precision


def _ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or not baseline:
        return None
    return value / baseline


def amp_health(summary: dict[str, Any]) -> dict[str, Any]:
    """The run's diagnostics (training/diagnostics.py), reduced to what a reader acts on."""
    checks = summary.get("checks") or {}
    underflow = summary.get("underflow") or {}
    return {
        "failed_checks": {
            name: check.get("offenders", [])
            for name, check in checks.items()
            if check.get("passed") is False
        },
        "first_overflow": summary.get("first_overflow"),
        "underflow_frac_scaled": underflow.get("underflow_frac_scaled"),
        "suggested_init_scale": summary.get("suggested_init_scale"),
        "stale_weight_frac": summary.get("stale_weight_frac"),
        "fp8_converted": summary.get("fp8_converted"),
        "fp8_skipped": summary.get("fp8_skipped"),
        "hardware_advice": (summary.get("hardware") or {}).get("advice", []),
    }


def saved_activation_bytes(summary: dict[str, Any]) -> int | None:
    return (audit_of(summary).get("saved_activation_bytes") or {}).get("total")


def cuda_peak(summary: dict[str, Any]) -> int | None:
    is_cuda = summary.get("peak_mem_kind") == "cuda_max_allocated"
    return summary.get("peak_mem_bytes") if is_cuda else None


def memory_fields(summary: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """What a precision changes in memory: the bytes saved for backward (exact, every device)
    and the CUDA peak, each against fp32's. The CPU's resident set measures the process, not
    the precision, and stays a footnote (``peak_mem_bytes``)."""
    saved, base_saved = saved_activation_bytes(summary), saved_activation_bytes(base)
    return {
        "saved_activation_bytes": saved,
        "activation_ratio": _ratio(saved, base_saved),
        "cuda_peak_bytes": cuda_peak(summary),
        "cuda_peak_ratio": _ratio(cuda_peak(summary), cuda_peak(base)),
    }


def audit_health(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The audit, reduced to what the report shows: the dtypes the matmuls ran in, and why the
    precision did not engage."""
    audit = audit_of(summary)
    if not audit:
        return None
    return {
        "flops_by_dtype": audit.get("flops_by_dtype") or {},
        "shortfalls": audit.get("shortfalls") or [],
        "responsible": sorted(audit.get("responsible") or {}),
    }


def declared_metrics(*summaries: dict[str, Any]) -> TaskMetrics | None:
    """The task's metric declaration, from the first summary that holds a readable one (a failed
    or killed run has none; its baseline's stands in)."""
    for summary in summaries:
        try:
            return TaskMetrics.from_dict(summary["task_metrics"])
        except (KeyError, TypeError, ValueError):
            continue
    return None


def quality_fields(summary: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The task's eval metrics and its quality metric against the baseline's, as it declares."""
    declared = declared_metrics(summary, base)
    if declared is None:
        return {"eval": {}, "quality_metric": None, "quality": None, "quality_delta": None}
    quality = summary.get(declared.quality)
    return {
        "eval": {name: summary.get(name) for name in declared.names},
        "quality_metric": declared.as_dict(),
        "quality": quality,
        "quality_delta": declared.delta(quality, base.get(declared.quality)),
    }


def comparison_row(run: Run, baseline: Run | None, out_dir: Path) -> dict[str, Any]:
    summary = run.summary
    base = baseline.summary if baseline is not None else {}
    return {
        "run": os.path.relpath(run.path, out_dir),
        "status": summary.get("status"),
        "model": run.model,
        "precision": precision_label(summary),
        "mode": run.precision,
        "setting": run.setting,
        "world_size": summary.get("world_size", 1),
        "strategy": summary.get("strategy"),
        "param_dtype": summary.get("param_dtype"),
        "reduce_dtype": summary.get("reduce_dtype"),
        "samples_per_s": summary.get("samples_per_s"),
        "tokens_per_s": summary.get("tokens_per_s"),
        "mfu": summary.get("mfu"),
        "speedup": _ratio(summary.get("samples_per_s"), base.get("samples_per_s")),
        "peak_mem_bytes": summary.get("peak_mem_bytes"),
        "peak_mem_ratio": _ratio(summary.get("peak_mem_bytes"), base.get("peak_mem_bytes")),
        "peak_mem_kind": summary.get("peak_mem_kind"),
        **memory_fields(summary, base),
        "state_bytes": summary.get("state_bytes"),
        "state_ratio": _ratio(summary.get("state_bytes"), base.get("state_bytes")),
        "engaged": engaged(summary),
        "audit": audit_health(summary),
        "emulated": bool(summary.get("fp8_emulated")),
        "stale_weight_frac": summary.get("stale_weight_frac"),
        "stochastic_rounding": (
            ((summary.get("config") or {}).get("precision") or {}).get("stochastic_rounding")
        ),
        "final_loss": summary.get("final_loss"),
        **quality_fields(summary, base),
        "skipped_steps": summary.get("skipped_steps"),
        "loss_scale": summary.get("loss_scale"),
        "baseline": None if baseline is None else os.path.relpath(baseline.path, out_dir),
        "device_name": summary.get("device_name"),
        "error": summary.get("error"),
        "health": amp_health(summary),
    }


def comparison_rows(runs: list[Run], out_dir: Path) -> list[dict[str, Any]]:
    """One row per run, grouped by model and setting, fp32 first within each group."""
    model_order = {model: i for i, model in enumerate(dict.fromkeys(r.model for r in runs))}
    setting_order = {setting: i for i, setting in enumerate(dict.fromkeys(r.setting for r in runs))}
    ordered = sorted(
        runs,
        key=lambda r: (
            model_order[r.model],
            setting_order[r.setting],
            PRECISION_ORDER.get(r.precision, len(PRECISION_ORDER)),
        ),
    )
    return [
        comparison_row(run, find_baseline(run, runs) if run.completed else None, out_dir)
        for run in ordered
    ]


def _speed_phrase(speedup: float | None, emulated: bool) -> str:
    if emulated:
        return "emulated, not timed"
    if speedup is None:
        return "throughput not measured"
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"


def tolerance_for(row: dict[str, Any], tolerance: float | None) -> float | None:
    """``report.tolerance``, or (null) the default the run's task declares."""
    declared = row["quality_metric"]
    if tolerance is not None or declared is None:
        return tolerance
    return declared["default_tolerance"]


def show_delta(delta: float, unit: ToleranceUnit) -> str:
    return f"{delta:+.2f} points" if unit is ToleranceUnit.points else f"{delta:+.2%}"


def show_tolerance(tolerance: float, unit: ToleranceUnit) -> str:
    return f"±{tolerance:g} points" if unit is ToleranceUnit.points else f"±{tolerance:.2%}"


def quality_phrase(row: dict[str, Any], tolerance: float | None) -> str:
    """The quality metric against fp32's, and whether the difference lies within tolerance."""
    declared = row["quality_metric"]
    delta = row["quality_delta"]
    if declared is None or delta is None:
        return "no eval metric to compare"
    label = next(m["label"] for m in declared["metrics"] if m["name"] == declared["quality"])
    unit = ToleranceUnit(declared["tolerance_unit"])
    limit = tolerance_for(row, tolerance)
    shown = f"{label} {show_delta(delta, unit)} vs {BASELINE}"
    # Accuracies are ratios of counts; a difference of exactly the tolerance is within it.
    within = "within" if abs(delta) <= limit + 1e-9 else "OUTSIDE"
    return f"{shown}, {within} {show_tolerance(limit, unit)}"


def describe_end(row: dict[str, Any]) -> str:
    """How a run that did not complete ended: failed (with its error) or stopped by a signal."""
    return f"{row['status']} ({row['error']})" if row["error"] else str(row["status"])


def stall_phrase(row: dict[str, Any]) -> str | None:
    """Why a run whose weights stopped moving stalled, and what to do; None if it did not."""
    stale = row["stale_weight_frac"]
    if stale is None or stale < STALL_FRACTION:
        return None
    phrase = f"{stale:.0%} of weights did not move over the last interval"
    if row["mode"] == "bf16_true" and row["stochastic_rounding"] is False:
        return f"{phrase}: updates round away in bf16; use precision.stochastic_rounding=true"
    return f"{phrase}: the learning rate may be too small for the weights' precision"


def _judge(row: dict[str, Any], tolerance: float | None) -> str:
    precision = row["precision"]
    if row["status"] != "completed":
        return f"{precision} {describe_end(row)}"
    notes = f", skipped {row['skipped_steps']} steps" if row["skipped_steps"] else ""
    if row["final_loss"] is not None and not math.isfinite(row["final_loss"]):
        notes += f", the loss diverged ({row['final_loss']})"
    stall = stall_phrase(row)
    if stall:
        notes += f", {stall}"
    if row["engaged"] is False:
        shortfalls = "; ".join(row["audit"]["shortfalls"])
        return f"{precision}: {shortfalls}, so its figures are not {row['mode']}'s{notes}"
    if row["baseline"] is None:
        final = "-" if row["final_loss"] is None else f"{row['final_loss']:.4f}"
        return f"{precision} final loss {final}{notes}"
    speed, memory = _speed_phrase(row["speedup"], row["emulated"]), memory_phrase(row)
    compared = f"{speed} and {memory} of {BASELINE}" if memory else f"{speed}, memory not measured"
    return f"{precision} {compared}, {quality_phrase(row, tolerance)}{notes}"


def memory_phrase(row: dict[str, Any]) -> str:
    ratios = [
        (row["activation_ratio"], "the saved activations"),
        (row["state_ratio"], "the weights and optimizer state"),
        (row["cuda_peak_ratio"], "the CUDA peak"),
    ]
    return ", ".join(f"{ratio:.2f}x {what}" for ratio, what in ratios if ratio is not None)


def verdicts(rows: list[dict[str, Any]], tolerance: float | None) -> list[str]:
    """One line per model (and setting): what each precision bought over fp32, and at what cost.

    ``tolerance`` is in the unit of each task's quality metric; None takes the task's default."""
    lines = []
    for model, setting in dict.fromkeys((row["model"], row["setting"]) for row in rows):
        group = [row for row in rows if (row["model"], row["setting"]) == (model, setting)]
        is_baseline = [r["precision"] == BASELINE and r["status"] == "completed" for r in group]
        parts = [] if any(is_baseline) else [f"no completed {BASELINE} run to compare with"]
        parts += [
            _judge(row, tolerance) for row, base in zip(group, is_baseline, strict=True) if not base
        ]
        subject = f"{model} ({setting})" if setting else model
        lines.append(f"{subject}: {'; '.join(parts) or f'only {BASELINE} ran'}")
    return lines
