"""The comparison table: each run against the completed fp32 run of its model, setting and seed
(its pair), grouped into cells (a model, a setting and a precision: the jobs that differ only in
seed), and what each run's record says of it: whether it learned, and how it gave no usable
result (report/words.py writes the sentences).

Whether a run learned is the test that keeps a verdict from measuring optimization luck: when
fp32 never left its starting plateau on a seed, that seed's difference says how lucky each
optimization was, not what the precision did, and more seeds only average such luck. The rule
(README "How to decide"): a run learned when its eval loss (its training loss where no eval
loss was measured) is at most ``DROP`` times its initial loss (the first training loss it
logged) and, where the data knows its best reachable loss (``loss_floor``, the synthetic tokens'
entropy), at most ``FLOOR_FACTOR`` times that floor.

How a run gave no usable result, by what it says about its precision: a numerical fault, a
divergence or an out-of-memory is a finding about the precision (it cannot train this seed); a
kill or a stop from outside is missing data (report/evidence.py's seed account).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
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
        or any(key.removeprefix("precision.") in get(name).variant_keys for name in names())
    )


# Options that change nothing trained: how a run is reported, timed, logged and checkpointed. They
# never split a cell or a pairing (fp32 timed in a speed trial still pairs with bf16 not timed).
UNTRAINED_SECTIONS = ("report.", "speed.", "wandb.", "checkpoint.", "sensitivity.")
UNTRAINED_KEYS = {"resume", "trainer.log_every", "trainer.timing_warmup_steps"}
# How a run ran, from its summary: part of its setting too. A 1-rank fp32 run at global batch 16
# is no baseline for a 2-rank bf16 run at 32, whose difference would come from the batch.
RUN_FACTS = ("world_size", "strategy", "global_batch_size")
NOT_ENGAGED = "did not engage"
Row = dict[str, Any]
CellKey = tuple[str, str, str]


def _override_value(value: Any) -> str:
    # null, true and false as a Hydra override spells them.
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


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
    pair = (run.model, run.setting, seed_of(run))
    return next(
        (
            other
            for other in runs
            if other.completed
            and other.precision == BASELINE
            and engaged(other.summary) is not False
            and (other.model, other.setting, seed_of(other)) == pair
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
    return None if value is None or not baseline else value / baseline


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
        # Why no check ran (None where they did): "checks passed" would claim what nobody saw.
        "unchecked": unchecked(summary),
        "first_overflow": summary.get("first_overflow"),
        "underflow_frac_scaled": underflow.get("underflow_frac_scaled"),
        "suggested_init_scale": summary.get("suggested_init_scale"),
        "stale_weight_frac": summary.get("stale_weight_frac"),
        "converted_linears": details_of(summary).get("converted_linears"),
        "skipped_linears": details_of(summary).get("skipped_linears"),
        "hardware_advice": (summary.get("hardware") or {}).get("advice", []),
    }


def unchecked(summary: dict[str, Any]) -> str | None:
    """Why the run's AMP checks (master weights, unscaled gradients) never ran, or None where they
    did: a summary without diagnostics (the HF and Lightning integrations record none), or a run
    with ``diagnostics.checks=false``, whose checks stay as they began."""
    if not summary.get("checks"):
        return "no diagnostics recorded"
    diagnostics = (summary.get("config") or {}).get("diagnostics")
    if isinstance(diagnostics, dict) and diagnostics.get("checks") is False:
        return "diagnostics.checks=false"
    return None


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


def quality_entry(declared: dict[str, Any]) -> dict[str, Any]:
    """The quality metric's entry among the metrics a task declares: its label and format."""
    return next(m for m in declared["metrics"] if m["name"] == declared["quality"])


def recorded(summary: dict[str, Any], *keys: str) -> dict[str, Any]:
    """The summary's values of ``keys`` as the row keeps them (None where not recorded)."""
    return {key: summary.get(key) for key in keys}


def comparison_row(run: Run, baseline: Run | None, out_dir: Path) -> dict[str, Any]:
    summary = run.summary
    base = baseline.summary if baseline is not None else {}

    def ratio(key: str) -> float | None:
        return _ratio(summary.get(key), base.get(key))

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
        **recorded(summary, "strategy", "param_dtype", "reduce_dtype", "samples_per_s"),
        # Timed beside other jobs on its node (hydra/launcher=node): under contention.
        "contended": (summary.get("launch_slot") or {}).get("parallel_jobs", 1) > 1,
        **recorded(summary, "tokens_per_s", "mfu"),
        "speedup": ratio("samples_per_s"),
        "peak_mem_bytes": summary.get("peak_mem_bytes"),
        "peak_mem_ratio": ratio("peak_mem_bytes"),
        "peak_mem_kind": summary.get("peak_mem_kind"),
        **memory_fields(summary, base),
        "state_bytes": summary.get("state_bytes"),
        "state_ratio": ratio("state_bytes"),
        "engaged": engaged(summary),
        "audit": audit_health(summary),
        "emulated": bool(details_of(summary).get("emulated")),
        # loss_floor: the best loss the data allows, where it knows one (``learned`` reads it).
        **recorded(summary, "stale_weight_frac", "final_loss", "loss_floor"),
        **quality_fields(summary, base),
        **recorded(summary, "skipped_steps", "loss_scale"),
        "baseline": None if baseline is None else os.path.relpath(baseline.path, out_dir),
        **recorded(summary, "device_name", "error"),
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


def setting_key(row: Row) -> tuple[str, str]:
    """A model and setting: the runs (or comparisons) that share an fp32 baseline."""
    return row["model"], row["setting"]


def cell_key(row: Row) -> CellKey:
    return row["model"], row["setting"], row["label"]


def group_cells(rows: list[Row], key: Callable[[Row], Any] = cell_key) -> dict[Any, list[Row]]:
    """The rows of each cell (or of each ``key``), in the order first seen: a cell's seeds are
    its replicates."""
    cells: dict[Any, list[Row]] = {}
    for row in rows:
        cells.setdefault(key(row), []).append(row)
    return cells


# "Fell well below its initial loss": by at least a fifth.
DROP = 0.8
# "Came within a factor of the floor": a run still 1.5x above the best reachable loss has not
# found the data's structure (a plateau at 3.6 against a floor of 1.05; AdamW reaches 1.13).
FLOOR_FACTOR = 1.5
# What a comparison whose fp32 run did not learn suggests: a fix of the training, never seeds.
FIX = "lower optimizer.lr, use optimizer=adamw, or raise trainer.max_steps"


def initial_loss(metrics: list[dict[str, Any]]) -> float | None:
    """The first training loss the run logged (metrics.jsonl)."""
    train = (row for row in metrics if row.get("kind", "train") == "train")
    return next((row["loss"] for row in train if isinstance(row.get("loss"), float)), None)


def learned(row: Row, metrics: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """(learned, why) for one run: None where it did not complete or logged no loss to judge."""
    if row["status"] != "completed":
        return None, "did not complete"
    name, loss = "eval loss", row["eval"].get("eval_loss")
    if loss is None:
        name, loss = "final training loss", row["final_loss"]
    start, floor = initial_loss(metrics), row.get("loss_floor")
    if loss is None or start is None or not math.isfinite(loss):
        return None, "no finite loss to judge"
    shown = f"{name} {loss:.4g} from {start:.4g} at first log"
    if loss > DROP * start:
        return False, f"{shown}: it fell by less than {1 - DROP:.0%}"
    if floor is None or floor <= 0:
        return True, shown
    return loss <= FLOOR_FACTOR * floor, f"{shown}, {loss / floor:.2f}x its loss_floor {floor:.4g}"


def mark_learned(rows: list[Row], metrics: dict[str, list[dict[str, Any]]]) -> None:
    """Set each row's ``learned`` and ``learned_reason``; ``metrics`` by the row's ``run``."""
    for row in rows:
        row["learned"], row["learned_reason"] = learned(row, metrics.get(row["run"], []))


def mark_comparisons(comparisons: list[dict[str, Any]], rows: list[Row]) -> None:
    """Set each comparison's ``baseline_not_learned``: the seeds whose fp32 run, paired with a run
    of the comparison's cell, did not learn."""
    by_run = {row["run"]: row for row in rows}
    for found in comparisons:
        pairs = [by_run.get(row["baseline"]) for row in rows if cell_key(row) == cell_key(found)]
        found["baseline_not_learned"] = [
            pair["seed"] for pair in pairs if pair is not None and pair["learned"] is False
        ]


# A completed run whose final loss is this many times the first it logged diverged, even where
# the loss stayed finite (fp32 at 4e10 after 37 skipped steps is no baseline).
DIVERGED_GROWTH = 10.0
# A run that skipped more than this share of its steps took far fewer updates than it claims.
SKIPPED_SHARE = 0.1
# How a seed's attempt ended when it gave no result, by what it says about the precision: a
# finding about it (it cannot train this seed), or missing data (it was stopped from outside).
PRECISION_FAILURES = ("numerical", "diverged", "out_of_memory")
# Where a fault's message names the step it happened at ("at step 12", "by step 40").
STEP_IN_MESSAGE = re.compile(r"\bstep (\d+)")


def finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def first_nonfinite_step(metrics: list[dict[str, Any]]) -> int | None:
    """The first logged step whose loss or an eval metric is not finite (a skipped fp16 step's
    gradient norm is inf with a finite loss: no divergence)."""
    for row in metrics:
        values = [v for k, v in row.items() if k == "loss" or k.startswith("eval_")]
        if "step" in row and not all(finite(v) for v in values if isinstance(v, float)):
            return int(row["step"])
    return None


def failure(row: Row, metrics: dict[str, list]) -> dict[str, Any] | None:
    """How a run gave no usable result: ``status`` (``PRECISION_FAILURES``, or the run's own
    status: failed, killed, stopped), ``reason`` and the ``step``; None for a usable run."""
    logged = metrics.get(row["run"], [])
    error = row["error"] or ""
    if row["status"] == "completed":
        grew = loss_growth(row, logged)
        if grew is not None:
            return {"status": "diverged", "reason": grew, "step": None}
        if finite(row["final_loss"]) and finite(row["quality"]):
            return None
        bad = row["final_loss"] if not finite(row["final_loss"]) else row["quality"]
        return {
            "status": "diverged",
            "reason": f"non-finite ({bad})",
            "step": first_nonfinite_step(logged),
        }
    if row["status"] == "failed" and error.startswith("NumericalFault"):
        status = "numerical"
    elif row["status"] == "failed" and ("OutOfMemory" in error or "out of memory" in error):
        status = "out_of_memory"
    else:
        status = str(row["status"])
    named = STEP_IN_MESSAGE.search(error)
    last = max((int(row["step"]) for row in logged if "step" in row), default=None)
    step = int(named.group(1)) if named else last
    return {"status": status, "reason": error or status, "step": step}


def loss_growth(row: Row, metrics: list[dict[str, Any]]) -> str | None:
    """Why a completed run's finite loss counts as diverged (``DIVERGED_GROWTH``), or None."""
    first, final = initial_loss(metrics), row["final_loss"]
    if first is None or final is None or not math.isfinite(final) or first <= 0:
        return None
    if final <= DIVERGED_GROWTH * first:
        return None
    return f"the loss rose from {first:.3g} to {final:.3g}"


def troubles(row: Row, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What keeps a completed run's checks from having passed, whatever its diagnostics said: a
    diverged loss (non-finite, or ``DIVERGED_GROWTH`` times its first), and the share of its
    steps it skipped (a trouble above ``SKIPPED_SHARE``)."""
    diverged = None
    if row["status"] == "completed":
        bad = row["final_loss"] is not None and not math.isfinite(row["final_loss"])
        diverged = f"the loss is {row['final_loss']}" if bad else loss_growth(row, metrics)
    steps, skipped = row.get("steps"), row.get("skipped_steps")
    share = skipped / steps if steps and skipped is not None else None
    return {"diverged": diverged, "skipped_share": share}
