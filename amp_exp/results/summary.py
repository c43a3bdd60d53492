"""summary.json: one schema for every way a run can end, and how a failure is recorded.

A completed, stopped, failed or killed run has the same keys; what a run never measured is null.
A report can then read any run without guessing which keys exist.
"""

from __future__ import annotations

import logging
import platform
from enum import Enum
from pathlib import Path
from typing import Any

from amp_exp.errors import first_line
from amp_exp.results.files import (
    FAILED_ATTEMPT_FILE,
    SUMMARY_FILE,
    UntrustedFile,
    read_json,
    write_json,
)
from amp_exp.results.format import FORMAT_VERSION, VERSION_KEY
from amp_exp.results.provenance import git_sha

log = logging.getLogger("amp_exp")


class Status(str, Enum):
    completed = "completed"
    # A preemption signal ended the run early, after a checkpoint.
    stopped = "stopped"
    failed = "failed"
    # No summary was written (SIGKILL, the OOM killer); the report fills this one in.
    killed = "killed"
    # The summary says completed, and metrics.jsonl is missing or cut short: the report fills
    # this one in, and judges no such run as if its record were whole.
    damaged = "damaged"


# Every key of summary.json, in the order written (results/schema/summary.v1.json types each).
FIELDS = (
    # The results format's version (results/format.py): a reader of another one refuses it.
    VERSION_KEY,
    "status",
    "error",
    "stop_signal",
    "precision",
    "precision_reason",
    "model",
    "dataset",
    "optimizer",
    "task",
    "device",
    "device_name",
    "seed",
    "batch_size",
    "grad_accum_steps",
    "world_size",
    # single, ddp or fsdp2; the dtype the weights computed in, and that gradients were reduced in.
    "strategy",
    "param_dtype",
    "reduce_dtype",
    "global_batch_size",
    "parameters",
    "channels_last",
    "compile",
    "steps",
    "total_steps",
    "samples_seen",
    "timed_steps",
    "warmup_s",
    # Over every rank (global), timed steps of the latest attempts in the run's precision.
    "samples_per_s",
    # Language models: tokens/s over every rank and per device, and the FLOPs one device ran
    # (TFLOP/s) against one device's peak (MFU), as torchtitan and nanoGPT report them.
    "tokens_per_s",
    "tokens_per_s_per_device",
    "flops_per_token",
    "tflops",
    "mfu",
    "mfu_peak_source",
    # MFU against the probe's measured matmul peak (CUDA only), per device.
    "mfu_measured",
    "step_time_ms",
    # Each attempt (a resume starts one): precision, first and last step, timed steps, speed.
    "attempts",
    "peak_mem_bytes",
    "peak_mem_kind",
    "final_loss",
    # The task's declaration of its eval metrics (tasks.base.TaskMetrics.as_dict); the values
    # of those metrics follow it, under the names it declares (eval_acc, eval_perplexity, ...).
    "task_metrics",
    # The best eval loss any model can reach on the data, where the data knows it.
    "loss_floor",
    "loss_scale",
    "skipped_steps",
    "resumed_from",
    "hardware",
    "first_overflow",
    "checks",
    "underflow",
    "suggested_init_scale",
    "stale_weight_frac",
    # Bytes of the parameters and the optimizer state, counted from the tensors.
    "state_bytes",
    # How many jobs shared the node with this one (hydra/launcher=node), its device and threads.
    "launch_slot",
    # What one audited step ran in: matmul FLOPs by dtype and module, the bytes saved for
    # backward, state and communication dtypes, and whether the precision engaged.
    "precision_audit",
    # What a precision plugin records of its run beyond these fields (PrecisionPlugin.summary):
    # fp8's and the block-scaled formats' converted and skipped linears, whether emulated.
    "precision_details",
    # The facts and words a report shows of the run's precision plugin (label, order, colour,
    # whether it scales the loss, stall advice): a report where that plugin is not installed
    # shows the run by them, never importing its module (report/runs.py).
    "precision_facts",
    # The modules precision.keep_fp32 matched (the outermost ones), run in fp32 in every mode.
    "keep_fp32_modules",
    "replicas_identical",
    "wall_s",
    "torch_version",
    "python_version",
    "git_sha",
    "config",
)


def _name(section: Any) -> Any:
    return section.get("name") if isinstance(section, dict) else section


def identity(config: dict[str, Any]) -> dict[str, Any]:
    """What a run is, read from its config alone: enough to place a failed or killed run."""
    return {
        "precision": _name(config.get("precision")),
        "model": _name(config.get("model")),
        "dataset": _name(config.get("dataset")),
        "optimizer": _name(config.get("optimizer")),
        "seed": config.get("seed"),
        "task": config.get("task"),
    }


def make_summary(
    status: Status,
    config: dict[str, Any],
    task_metrics: dict[str, Any] | None = None,
    eval_metrics: dict[str, Any] | None = None,
    **values: Any,
) -> dict[str, Any]:
    """A summary with every key of ``FIELDS``: those given, the run's identity from ``config``,
    and null for the rest. A key outside the schema is a programming error.

    ``task_metrics`` is the task's declaration; each metric it names gets a key right after it,
    holding its value from ``eval_metrics`` (null if the run never evaluated).
    """
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise KeyError(f"not summary.json fields: {', '.join(unknown)}")
    declared = [metric["name"] for metric in (task_metrics or {}).get("metrics", [])]
    undeclared = sorted(set(eval_metrics or {}) - set(declared))
    if undeclared:
        raise KeyError(f"eval metrics the task did not declare: {', '.join(undeclared)}")
    summary: dict[str, Any] = {}
    for key in FIELDS:
        summary[key] = None
        if key == "task_metrics":
            summary.update(dict.fromkeys(declared))
    summary["task_metrics"] = task_metrics
    summary.update(eval_metrics or {})
    summary.update(identity(config))
    if status is not Status.killed:  # a killed run's code version is not the reader's
        import torch  # only runs import it; a report reading killed runs stays light

        summary.update(
            torch_version=str(torch.__version__),
            python_version=platform.python_version(),
            git_sha=git_sha(),
        )
    summary.update(values)
    summary.update(status=Status(status).value, config=config, **{VERSION_KEY: FORMAT_VERSION})
    return summary


def failure_summary(
    config: dict[str, Any], error: Exception, task_metrics: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What a run that raised leaves in summary.json, so a sweep report can show it as failed;
    ``task_metrics``, where the task is known, gives it the same metric keys (null)."""
    return make_summary(
        Status.failed,
        config,
        task_metrics=task_metrics,
        error=f"{type(error).__name__}: {first_line(str(error))}",
    )


def record_failure(
    output_dir: Path,
    config: dict[str, Any],
    error: Exception,
    task_metrics: dict[str, Any] | None = None,
) -> Path:
    """Write the failure summary; beside, never over, a completed run's summary.json."""
    path = output_dir / SUMMARY_FILE
    if completed_summary(output_dir) is not None:
        path = output_dir / FAILED_ATTEMPT_FILE
        log.error(
            "this run completed before; its summary.json is kept, this failure is in %s", path
        )
    write_json(path, failure_summary(config, error, task_metrics))
    return path


def completed_summary(output_dir: Path) -> dict[str, Any] | None:
    """The run directory's summary.json, if it records a completed run; ``UntrustedFile`` for one
    amp_exp cannot have written (a link, a FIFO), which no command may take for absent."""
    try:
        summary = read_json(output_dir / SUMMARY_FILE)
    except UntrustedFile:
        raise
    except (OSError, ValueError):
        return None
    completed = isinstance(summary, dict) and summary.get("status") == Status.completed.value
    return summary if completed else None
