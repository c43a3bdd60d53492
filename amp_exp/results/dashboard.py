"""How a run appears on the W&B dashboard: name, group, tags, config and metric keys.

Plain functions of the config and the engine's rows, so they are tested without W&B.
"""

from __future__ import annotations

from typing import Any

from amp_exp.config.datasets import dataset_name
from amp_exp.config.plain import plain_run_config
from amp_exp.config.schema import RunConfig
from amp_exp.results.sweep import SweepJob

# The base name already carries these, so a sweep over them adds nothing to it.
NAMED_KEYS = frozenset({"model", "model.name", "precision", "precision.name", "seed"})

# Engine row key -> W&B key. Rows also carry "step", which becomes W&B's step. A task's eval
# metrics (``eval_<name>``, as its TaskMetrics declares them) go under ``eval/<name>``.
EVAL_PREFIX = "eval_"
WANDB_KEYS = {
    "samples": "samples",
    "epoch": "epoch",
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "scale": "amp/scale",
    "scale_mean": "amp/scale_mean",
    "skipped_steps": "amp/skipped_steps",
    "samples_per_s": "perf/samples_per_s",
    "tokens_per_s": "perf/tokens_per_s",
    "tokens_per_s_per_device": "perf/tokens_per_s_per_device",
    "tflops": "perf/tflops",
    "mfu": "perf/mfu",
    "mfu_measured": "perf/mfu_measured",
    "step_time_ms": "perf/step_time_ms",
    "peak_mem_bytes": "perf/peak_mem_bytes",
    "grad_underflow_frac": "amp/grad_underflow_frac",
    "grad_underflow_frac_scaled": "amp/grad_underflow_frac_scaled",
    "grad_overflow_frac_scaled": "amp/grad_overflow_frac_scaled",
    "stale_weight_frac": "amp/stale_weight_frac",
}
SKIP_RATE = "amp/skip_rate"
# Samples seen compares runs with different batch sizes fairly; the step stays selectable.
X_AXIS = "samples"
METRIC_GROUPS = ("train/*", "amp/*", "perf/*", "eval/*")
# What the runs table and parallel-coordinates panels compare once a run ends.
SUMMARIES = {
    "perf/samples_per_s": "last",
    "perf/tokens_per_s": "last",
    "perf/mfu": "last",
    "perf/step_time_ms": "last",
    "perf/peak_mem_bytes": "max",
    "amp/scale": "last",
    "amp/skipped_steps": "last",
}


def choice_label(key: str, value: str) -> str:
    """``optimizer=adamw`` reads as ``adamw``; ``optimizer.lr=0.01`` as ``lr0.01``."""
    field = key.rpartition(".")[2]
    return value if field == key else f"{field}{value}"


def run_name(cfg: RunConfig, precision: str, sweep: SweepJob | None) -> str:
    """``resnet18-fp16-s0``, plus what this job of a sweep varies: ``resnet18-fp16-lr0.01-s0``."""
    if cfg.wandb.name:
        return cfg.wandb.name
    varied = [choice_label(k, v) for k, v in sweep.choices if k not in NAMED_KEYS] if sweep else []
    return "-".join([cfg.model.name, precision, *varied, f"s{cfg.seed}"])


def run_group(cfg: RunConfig, sweep: SweepJob | None) -> str | None:
    """The sweep, so that one click compares all of its jobs."""
    return cfg.wandb.group or (sweep.dir if sweep else None)


def run_tags(cfg: RunConfig, precision: str, device_type: str) -> list[str]:
    automatic = [cfg.model.name, precision, dataset_name(cfg.dataset), device_type]
    return list(dict.fromkeys([*automatic, *cfg.wandb.tags]))


def run_config(
    cfg: RunConfig, precision: str, parallelism: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The resolved config, with ``precision.*`` flat keys that the dashboard filters on.

    ``precision.resolved`` is what ran: ``precision.name`` may be ``auto``. ``parallelism``
    (build.parallelism) adds the strategy that ran and ``precision.param_dtype``, and replaces
    ``precision.reduce_dtype`` (null: from the precision) with the dtype it resolved to.
    """
    plain = plain_run_config(cfg)
    del plain["wandb"]  # how a run is logged is not part of the experiment
    flat = {f"precision.{key}": value for key, value in plain.pop("precision").items()}
    if parallelism is not None:
        flat["precision.param_dtype"] = parallelism["param_dtype"]
        flat["precision.reduce_dtype"] = parallelism["reduce_dtype"]
        plain["strategy"] = parallelism["strategy"]
    return {**plain, **flat, "precision.resolved": precision}


def wandb_metrics(row: dict[str, Any]) -> dict[str, Any]:
    """A row under W&B keys; None (no scale without fp16, no throughput in warm-up) is left out."""
    return {
        wandb_key: value
        for key, value in row.items()
        if (wandb_key := wandb_key_of(key)) is not None and value is not None
    }


def wandb_key_of(key: str) -> str | None:
    """The W&B key of a row's key, or None for keys the dashboard does not chart."""
    if key in WANDB_KEYS:
        return WANDB_KEYS[key]
    if key.startswith(EVAL_PREFIX):
        return f"eval/{key.removeprefix(EVAL_PREFIX)}"
    return None


# The precision audit (training/audit/) on the dashboard: summary keys per run, and a table of
# the audited step's matmul FLOPs by module and dtype.
AUDIT_PREFIX = "audit/"
FLOPS_SHARE_PREFIX = "audit/flops_share/"
AUDIT_TABLE = "audit/matmuls"
AUDIT_COLUMNS = ("module", "dtype", "flops", "share")


def audit_summary(audit: dict[str, Any]) -> dict[str, Any]:
    """The audit's run-summary keys: engaged, FLOPs, the share of each dtype, saved bytes."""
    if not audit:
        return {}
    return {
        f"{AUDIT_PREFIX}engaged": audit.get("engaged"),
        f"{AUDIT_PREFIX}matmul_flops": audit.get("matmul_flops"),
        f"{AUDIT_PREFIX}saved_activation_bytes": (
            (audit.get("saved_activation_bytes") or {}).get("total")
        ),
        **{
            f"{FLOPS_SHARE_PREFIX}{dtype}": share
            for dtype, share in (audit.get("flops_by_dtype") or {}).items()
        },
    }


def audit_rows(audit: dict[str, Any]) -> list[list[Any]]:
    """One row per module and dtype: its matmul FLOPs and their share of the step's."""
    total = audit.get("matmul_flops") or 0
    return [
        [module, dtype, flops, flops / total if total else None]
        for module, dtypes in sorted((audit.get("modules") or {}).items())
        for dtype, flops in dtypes.items()
    ]
