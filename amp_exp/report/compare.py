"""The comparison table: each run against the completed fp32 run of its model, setting and seed
(its pair), and how the report shows a difference (report/verdicts.py writes the sentences)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from amp_exp.config.plain import flatten_config
from amp_exp.config.precisions import REFERENCE, get, names
from amp_exp.report.runs import Run, report_order, report_plugin
from amp_exp.tasks.metrics import TaskMetrics

BASELINE = REFERENCE
# Jobs that differ only in seed are replicates of one cell: seed s is paired with fp32's seed s.
REPLICATE_KEY = "seed"


def is_compared(key: str) -> bool:
    """The keys a comparison is about (the model, the precision and the knobs that make a variant
    of it, its plugin's ``variant_keys`` and options); every other config key that differs is part
    of a run's setting."""
    return (
        key in {"model.name", "precision.name", "precision._target_", REPLICATE_KEY}
        or key.startswith("precision.options.")
        or key.removeprefix("precision.") in variant_keys()
    )


def variant_keys() -> set[str]:
    return {key for name in names() for key in get(name).variant_keys}


# Options that change nothing trained: how a run is reported, timed, logged and checkpointed. They
# never split a cell or a pairing (fp32 timed in a speed trial still pairs with bf16 not timed).
UNTRAINED_SECTIONS = ("report.", "speed.", "wandb.", "checkpoint.", "sensitivity.")
UNTRAINED_KEYS = {"resume", "trainer.log_every", "trainer.timing_warmup_steps"}
# How a run ran, from its summary: part of its setting too. A 1-rank fp32 run at global batch 16
# is no baseline for a 2-rank bf16 run at 32, whose difference would come from the batch.
RUN_FACTS = ("world_size", "strategy", "global_batch_size")
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


def trained(key: str) -> bool:
    """Whether a flat config key can change what a run trains (``UNTRAINED_SECTIONS``)."""
    return key not in UNTRAINED_KEYS and not key.startswith(UNTRAINED_SECTIONS)


def varied_facts(runs: list[Run]) -> list[str]:
    """The ``RUN_FACTS`` whose known values differ between ``runs`` (a killed run knows none)."""
    return [
        key
        for key in RUN_FACTS
        if len({run.summary[key] for run in runs if run.summary.get(key) is not None}) > 1
    ]


def subject(model: str, setting: str | None) -> str:
    """The model, and its setting where the runs of a model differ in more than precision."""
    return f"{model} ({setting})" if setting else model


def assign_settings(runs: list[Run]) -> None:
    """Name, for each run, the config values and the ``RUN_FACTS`` in which it differs from the
    runs of its model.

    fp16 with clipping is then compared with fp32 with clipping, not with fp32 without it, and a
    2-rank run with a 2-rank run. Runs whose summary holds no config are left with an empty
    setting.
    """
    for model in dict.fromkeys(run.model for run in runs):
        group = [run for run in runs if run.model == model and "config" in run.summary]
        varied = [key for key in varied_keys(group) if trained(key) and not is_compared(key)]
        facts = varied_facts(group)
        for run in group:
            flat = flatten_config(run.summary["config"])
            values = [flat.get(key) for key in varied] + [run.summary.get(key) for key in facts]
            run.setting = ", ".join(
                f"{key}={_override_value(value)}"
                for key, value in zip([*varied, *facts], values, strict=True)
            )


def strategy_note(rows: list[dict[str, Any]]) -> str | None:
    """A sentence for the report when its runs ran under different strategies, None otherwise:
    each is compared only within its own strategy, and a precision may compute in other dtypes
    under each (FSDP2 casts the weights themselves)."""
    seen = {
        (row["strategy"], row["param_dtype"], row["reduce_dtype"])
        for row in rows
        if row["strategy"] is not None
    }
    if len({strategy for strategy, _, _ in seen}) < 2:
        return None
    described = "; ".join(
        f"{strategy} (weights compute in {param or '-'}, gradients reduced in {reduce or '-'})"
        for strategy, param, reduce in sorted(seen, key=str)
    )
    return (
        "These runs ran under different strategies, so each is compared only with the "
        f"{BASELINE} run of its own strategy, world size and global batch: {described}."
    )


def seed_of(run: Run) -> int | None:
    return (run.summary.get("config") or {}).get(REPLICATE_KEY)


def audit_of(summary: dict[str, Any]) -> dict[str, Any]:
    """The run's precision audit (training/audit/), or nothing for a run without one."""
    return summary.get("precision_audit") or {}


def engaged(summary: dict[str, Any]) -> bool | None:
    """Whether the run's audit found its precision engaged; None when it was not audited."""
    return audit_of(summary).get("engaged")


def find_baseline(run: Run, runs: list[Run]) -> Run | None:
    """The completed fp32 run of the same model, setting and seed, if its fp32 engaged: the same
    initial weights and the same batches, so the two form a pair."""
    return next(
        (
            other
            for other in runs
            if other.completed
            and other.precision == BASELINE
            and engaged(other.summary) is not False
            and other.model == run.model
            and other.setting == run.setting
            and seed_of(other) == seed_of(run)
        ),
        None,
    )


def precision_knobs(summary: dict[str, Any]) -> dict[str, Any]:
    return (summary.get("config") or {}).get("precision") or {}


def precision_options(summary: dict[str, Any]) -> dict[str, Any]:
    """The ``precision.*`` values that make the run's variant of its mode, as a user passes them
    back beside ``precision=`` (``{"stochastic_rounding": false}`` for bf16_true rounding to
    nearest); empty for a mode without variants."""
    plugin, knobs = report_plugin(str(summary.get("precision"))), precision_knobs(summary)
    if plugin is None:
        return {}
    chosen = {key: knobs[key] for key in sorted(plugin.variant_keys) if key in knobs}
    return {**chosen, **({"options": knobs["options"]} if knobs.get("options") else {})}


def precision_label(summary: dict[str, Any]) -> str:
    """The precision as the report shows it: the mode, the variant of bf16_true or fp8, and
    whether it did not engage (then the run's figures are not that precision's)."""
    precision = variant_label(summary)
    return f"{precision} ({NOT_ENGAGED})" if engaged(summary) is False else precision


def variant_label(summary: dict[str, Any]) -> str:
    """The mode and its variant, as its plugin words it: "bf16_true (nearest)", "fp8 (rowwise,
    emulated)"; a precision no plugin here knows keeps its name."""
    precision = str(summary.get("precision") or "?")
    plugin = report_plugin(precision)
    return precision if plugin is None else plugin.variant_label(precision_knobs(summary))


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
        "converted_linears": details_of(summary).get("converted_linears"),
        "skipped_linears": details_of(summary).get("skipped_linears"),
        "hardware_advice": (summary.get("hardware") or {}).get("advice", []),
    }


def details_of(summary: dict[str, Any]) -> dict[str, Any]:
    """What the run's precision plugin recorded (fp8's and the block-scaled formats' linears)."""
    return summary.get("precision_details") or {}


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
        # The config name a user passes back as precision=, its variant's options, and the label
        # the report shows (the cell's: whether the run engaged is its own column).
        "precision": run.precision,
        "precision_options": precision_options(summary),
        "label": variant_label(summary),
        "setting": run.setting,
        "seed": seed_of(run),
        "steps": summary.get("steps"),
        "world_size": summary.get("world_size", 1),
        "strategy": summary.get("strategy"),
        "param_dtype": summary.get("param_dtype"),
        "reduce_dtype": summary.get("reduce_dtype"),
        "samples_per_s": summary.get("samples_per_s"),
        # Timed beside other jobs on its node (hydra/launcher=node): under contention.
        "contended": (summary.get("launch_slot") or {}).get("parallel_jobs", 1) > 1,
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
        "emulated": bool(details_of(summary).get("emulated")),
        "stale_weight_frac": summary.get("stale_weight_frac"),
        "final_loss": summary.get("final_loss"),
        # The best loss the data allows, where it knows one (report/learned.py reads it).
        "loss_floor": summary.get("loss_floor"),
        **quality_fields(summary, base),
        "skipped_steps": summary.get("skipped_steps"),
        "loss_scale": summary.get("loss_scale"),
        "baseline": None if baseline is None else os.path.relpath(baseline.path, out_dir),
        "device_name": summary.get("device_name"),
        "error": summary.get("error"),
        "health": amp_health(summary),
    }


def comparison_rows(runs: list[Run], out_dir: Path) -> list[dict[str, Any]]:
    """One row per run, grouped by model and setting, fp32 first within each group, then by
    precision variant and seed."""
    model_order = {model: i for i, model in enumerate(dict.fromkeys(r.model for r in runs))}
    setting_order = {setting: i for i, setting in enumerate(dict.fromkeys(r.setting for r in runs))}
    labels = {id(r): variant_label(r.summary) for r in runs}
    label_order = {label: i for i, label in enumerate(dict.fromkeys(labels.values()))}
    ordered = sorted(
        runs,
        key=lambda r: (
            model_order[r.model],
            setting_order[r.setting],
            # Within a model the baseline comes first, then the precisions in their facts' order.
            report_order(r.precision),
            label_order[labels[id(r)]],
            seed_of(r) if isinstance(seed_of(r), int) else -1,
        ),
    )
    return [
        comparison_row(run, find_baseline(run, runs) if run.completed else None, out_dir)
        for run in ordered
    ]


def tolerance_for(row: dict[str, Any], tolerance: float | None) -> float | None:
    """``report.tolerance``, or (null) the default the run's task declares."""
    declared = row["quality_metric"]
    if tolerance is not None or declared is None:
        return tolerance
    return declared["default_tolerance"]


def describe_end(row: dict[str, Any]) -> str:
    """How a run that did not complete ended: failed (with its error) or stopped by a signal."""
    return f"{row['status']} ({row['error']})" if row["error"] else str(row["status"])


def stall_phrase(row: dict[str, Any]) -> str | None:
    """Why a run whose weights stopped moving stalled, and what to do; None if it did not."""
    stale = row["stale_weight_frac"]
    if stale is None or stale < STALL_FRACTION:
        return None
    # The precision's plugin says why, from the options that make the run's variant.
    plugin = report_plugin(row["precision"]) or report_plugin(REFERENCE)
    why = plugin.stall_advice(row["precision_options"])
    return f"{stale:.0%} of weights did not move over the last interval: {why}"
