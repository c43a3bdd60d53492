"""One run's life: build it, resume it (results.resume), train it, and leave its results in its
directory.

``train`` is what ``python -m amp_exp`` calls per Hydra job. Under torchrun every rank calls it
and trains its shard; rank 0 alone writes the files and the W&B run, so a job has one of each.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from pathlib import Path
from typing import Any

import torch

from amp_exp.build import Built, attach_audit, attach_diagnostics, build, global_batch_size
from amp_exp.config.plain import plain_run_config
from amp_exp.config.precisions import DType
from amp_exp.config.schema import RunConfig
from amp_exp.launch import launch_slot
from amp_exp.results.checkpoint import Checkpointer, ShardedCheckpointer, checkpoint_dir
from amp_exp.results.contract import user_code_cannot_exit
from amp_exp.results.files import METRICS_FILE, SUMMARY_FILE, write_json
from amp_exp.results.loggers import ConsoleLogger, JsonlLogger, Logger, describe_eval
from amp_exp.results.ownership import RunDirectoryLock, check_directory
from amp_exp.results.resume import find_checkpoint, kept_precision, resume
from amp_exp.results.summary import Status, completed_summary, make_summary
from amp_exp.results.sweep import SweepJob
from amp_exp.results.wandb_logger import open_wandb_logger
from amp_exp.runtime.distributed import process_group
from amp_exp.runtime.fsdp import is_sharded
from amp_exp.runtime.hardware import device_name
from amp_exp.runtime.quiet import once_per
from amp_exp.runtime.signals import StopRequest
from amp_exp.training.loop import TrainResult
from amp_exp.training.meters import state_bytes

log = logging.getLogger("amp_exp")


def run_summary(cfg: RunConfig, built: Built, result: TrainResult, **measured: Any) -> dict:
    """The summary of a run that trained to its end, or stopped early on a signal; ``measured``:
    the stop signal's name, the wall time and what the run's callbacks measured."""
    progress, device, engine = result.progress, built.device, built.engine
    return make_summary(
        Status.stopped if result.stopped_early else Status.completed,
        plain_run_config(cfg),
        precision=built.resolved.precision,
        precision_reason=built.resolved.reason,
        device=device.type,
        device_name=device_name(device),
        batch_size=cfg.dataset.batch_size,
        grad_accum_steps=cfg.trainer.grad_accum_steps,
        world_size=engine.world_size,
        **(built.parallelism or {}),
        global_batch_size=global_batch_size(cfg, engine.world_size),
        parameters=sum(p.numel() for p in built.model.parameters()),
        channels_last=built.channels_last,
        compile=built.compiled,
        steps=progress.step,
        total_steps=engine.total_steps,
        samples_seen=progress.samples,
        timed_steps=result.timed_steps,
        warmup_s=result.warmup_s,
        **engine.meter.summary(result.samples_per_s),
        step_time_ms=result.step_time_ms,
        attempts=result.attempts,
        peak_mem_bytes=result.peak_mem_bytes,
        peak_mem_kind="cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss",
        final_loss=progress.final_loss,
        task_metrics=engine.task.metrics.as_dict(),
        eval_metrics=progress.eval,
        **built.recorded,
        task=cfg.task.value,
        loss_scale=result.loss_scale,
        skipped_steps=progress.skipped_steps,
        resumed_from=built.resumed_from,
        hardware=built.hardware,
        first_overflow=progress.first_overflow,
        state_bytes=state_bytes(engine.parameters, engine.optimizer),
        launch_slot=launch_slot(),
        **engine.precision.summary_fields(),
        **measured,
    )


def outcome_phrase(summary: dict[str, Any], unit: str) -> str:
    rate = summary[f"{unit}_per_s"]
    return f"{'-' if rate is None else f'{rate:.0f}'} {unit}/s"


def replicas_identical(built: Built) -> bool | None:
    """Under torchrun, whether all ranks ended with bit-identical weights and loss scale.

    Under FSDP2 each rank holds a shard of every weight, not a replica, so only the loss scale
    is compared (None without one: nothing is replicated). Buffers are left out: DDP hands rank
    0's to the others at each forward, so between forwards the ranks' BatchNorm statistics
    differ by design.
    """
    if built.distributed is None:
        return None
    state = [p for p in built.model.parameters() if not is_sharded(p)]
    scale = built.engine.precision.scale()
    if scale is not None:
        state.append(torch.tensor(scale))
    if not state:
        return None
    identical = built.distributed.replicas_identical(state)
    if not identical:
        log.error("the ranks' model replicas differ at the end of the run")
    return identical


def train(cfg: RunConfig, output_dir: Path, sweep: SweepJob | None = None) -> dict[str, Any]:
    """Run one experiment; writes metrics.jsonl, checkpoints and summary.json to ``output_dir``."""
    started = time.perf_counter()
    with process_group(cfg.trainer.device, cfg.trainer.strategy) as distributed:
        output_dir.mkdir(parents=True, exist_ok=True)
        # Rank 0 holds the lock for the whole job; the other ranks only follow it.
        is_main = distributed is None or distributed.is_main
        with RunDirectoryLock(output_dir) if is_main else contextlib.nullcontext():
            # Every rank: they read the same files and refuse alike, before any collective.
            world_size = 1 if distributed is None else distributed.world_size
            done = check_directory(cfg, output_dir, world_size)
            if done is not None:
                log.info("%s", done)
                return completed_summary(output_dir)  # type: ignore[return-value]
            found = find_checkpoint(cfg, output_dir, distributed)
            with user_code_cannot_exit():
                built = build(cfg, distributed, kept_precision(cfg.precision.name, found))
            # The probe's advice is a fact of the machine, the same in every job: once per sweep.
            for advice in built.hardware["advice"]:
                log.warning("%s", advice, extra=once_per(None if sweep is None else sweep.dir))
            resumed = resume(cfg, built.engine, output_dir, found, writes=built.is_main)
            if resumed.complete:
                return completed_summary(output_dir)  # type: ignore[return-value]
            built.resumed_from = resumed.path
            return train_built(cfg, built, output_dir, sweep, started)


def open_loggers(cfg: RunConfig, built: Built, output_dir: Path, sweep: SweepJob | None):
    """The console, metrics.jsonl and (if it starts) W&B; none on ranks other than 0."""
    if not built.is_main:
        return [], None
    resumed_dir = Path(built.resumed_from).parent.parent if built.resumed_from else None
    wandb_logger = open_wandb_logger(
        cfg,
        output_dir,
        built.resolved.precision,
        built.device.type,
        built.engine.total_steps,
        sweep,
        resumed_run_dir=resumed_dir,
        parallelism=built.parallelism,
    )
    loggers: list[Logger] = [
        ConsoleLogger(
            built.engine.total_steps,
            built.engine.task.metrics,
            fp16=built.engine.precision.spec.compute_dtype is DType.float16,
        ),
        # A fresh start replaces the rows of an earlier attempt in this directory.
        JsonlLogger(output_dir / METRICS_FILE, append=built.resumed_from is not None),
        *([wandb_logger] if wandb_logger else []),
    ]
    return loggers, wandb_logger


def train_built(
    cfg: RunConfig, built: Built, output_dir: Path, sweep: SweepJob | None, started: float
) -> dict[str, Any]:
    distributed = built.distributed
    log.info(
        "precision %s (%s) on %s%s",
        built.resolved.precision,
        built.resolved.reason,
        device_name(built.device),
        ""
        if distributed is None
        else f", {distributed.world_size} ranks ({distributed.strategy.value}), global batch "
        f"{global_batch_size(cfg, distributed.world_size)}",
    )
    checkpoints = None
    if cfg.checkpoint.every_steps is not None:
        sharded = distributed is not None and distributed.shards
        checkpoints = (ShardedCheckpointer if sharded else Checkpointer)(
            checkpoint_dir(output_dir),
            cfg.checkpoint.every_steps,
            cfg.checkpoint.keep,
            # Each rank's place in the epoch is counted in batches of its own shard.
            {"world_size": built.engine.world_size, "config": plain_run_config(cfg)},
            writes=built.is_main,
        )
    loggers, wandb_logger = open_loggers(cfg, built, output_dir, sweep)

    def emit(row: dict[str, Any]) -> None:
        for logger in loggers:
            logger.log(row)

    try:
        diagnostics = attach_diagnostics(cfg, built, emit)
        audit = attach_audit(cfg, built)
        with StopRequest() as stop, user_code_cannot_exit():
            result = built.engine.fit(emit, checkpoints, stop_requested=stop)
        stop_signal = stop.requested
        if distributed is not None and result.stopped_early:
            # The ranks stopped together, but the signal may have reached only some of them:
            # all report it, and all exit with its status.
            stop_signal = signal.Signals(int(distributed.max(stop_signal or 0)))
        summary = run_summary(
            cfg,
            built,
            result,
            stop_signal=None if stop_signal is None else stop_signal.name,
            wall_s=time.perf_counter() - started,
            **diagnostics.summary(),
            precision_audit=None if audit is None else audit.summary(),
            replicas_identical=replicas_identical(built),
        )
        if built.is_main:
            write_json(output_dir / SUMMARY_FILE, summary)
        if wandb_logger:
            wandb_logger.record_summary(summary)
    except BaseException:
        if wandb_logger:
            wandb_logger.exit_code = 1
        raise
    finally:
        # W&B closes last: whatever its finish() does, the result files are already written.
        for logger in loggers:
            logger.close()
    log.info(
        "%s: %s %s on %s, %s, final loss %s, %s -> %s",
        summary["status"],
        summary["model"],
        summary["precision"],
        summary["device"],
        outcome_phrase(summary, built.engine.task.unit),
        "-" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}",
        f"eval {describe_eval(summary, built.engine.task.metrics)}",
        output_dir,
    )
    # Under submitit, its SIGUSR2 handler now requeues the job to resume (runtime/signals.py).
    stop.hand_over()
    return summary
