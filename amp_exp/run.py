"""Build everything a run needs from its config, train it, and write its results to disk."""

from __future__ import annotations

import json
import logging
import platform
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from amp_exp.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointWriter,
    checkpoint_payload,
    load_newest_valid,
    restore,
)
from amp_exp.cli import first_line
from amp_exp.config import ConfigError, NonFiniteAction, RunConfig, to_plain_dict
from amp_exp.data import build_data
from amp_exp.diagnostics import Diagnostics, forward_activation_bytes
from amp_exp.distributed import Distributed, process_group
from amp_exp.engine import Engine, LossFn, Progress, TrainResult, plan_total_steps
from amp_exp.hardware import (
    configure_backends,
    device_name,
    git_sha,
    inspect_hardware,
    precision_advice,
    recommend_precision,
    resolve_device,
    seed_everything,
)
from amp_exp.loggers import (
    METRICS_FILE,
    ConsoleLogger,
    JsonlLogger,
    Logger,
    json_safe,
    keep_metrics_until,
)
from amp_exp.models import build_model, is_convolutional
from amp_exp.optim import build_optimizer, build_scheduler
from amp_exp.precision import PrecisionPolicy, ResolvedPrecision, resolve_precision
from amp_exp.signals import StopRequest
from amp_exp.sweep import SweepJob
from amp_exp.wandb_logger import open_wandb_logger

log = logging.getLogger("amp_exp")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    text = json.dumps(json_safe(payload), indent=2, allow_nan=False)
    tmp.write_text(text + "\n", encoding="utf-8")
    tmp.replace(path)


def build_summary(
    cfg: RunConfig,
    built: Built,
    result: TrainResult,
    stop_signal: signal.Signals | None,
    wall_s: float,
) -> dict[str, Any]:
    progress, device = result.progress, built.device
    return {
        "status": "stopped" if result.stopped_early else "completed",
        "stop_signal": None if stop_signal is None else stop_signal.name,
        "precision": built.resolved.precision.value,
        "precision_reason": built.resolved.reason,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name.value,
        "optimizer": cfg.optimizer.name,
        "device": device.type,
        "device_name": device_name(device),
        "seed": cfg.seed,
        "batch_size": cfg.dataset.batch_size,
        "grad_accum_steps": cfg.trainer.grad_accum_steps,
        "world_size": built.engine.world_size,
        "global_batch_size": global_batch_size(cfg, built.engine.world_size),
        "parameters": sum(p.numel() for p in built.model.parameters()),
        "channels_last": built.channels_last,
        "compile": cfg.trainer.compile,
        "steps": progress.step,
        "total_steps": built.engine.total_steps,
        "samples_seen": progress.samples,
        "timed_steps": result.timed_steps,
        "warmup_s": result.warmup_s,
        "samples_per_s": result.samples_per_s,
        "step_time_ms": result.step_time_ms,
        "peak_mem_bytes": result.peak_mem_bytes,
        "peak_mem_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss",
        "final_loss": progress.final_loss,
        "eval_loss": progress.eval_loss,
        "eval_acc": progress.eval_acc,
        "loss_scale": result.loss_scale,
        "skipped_steps": progress.skipped_steps,
        "resumed_from": built.resumed_from,
        "hardware": built.hardware,
        "first_overflow": progress.first_overflow,
        "wall_s": wall_s,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "git_sha": git_sha(),
        "config": to_plain_dict(OmegaConf.structured(cfg)),
    }


def failure_summary(config: dict[str, Any], error: Exception) -> dict[str, Any]:
    """What a run that raised leaves in summary.json, so a sweep report can show it as failed."""
    return {
        "status": "failed",
        "error": f"{type(error).__name__}: {first_line(str(error))}",
        "precision": config["precision"]["name"],
        "model": config["model"]["name"],
        "dataset": config["dataset"]["name"],
        "seed": config["seed"],
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "git_sha": git_sha(),
        "config": config,
    }


def global_batch_size(cfg: RunConfig, world_size: int) -> int:
    """Samples per optimizer step: dataset.batch_size is per rank and per micro-batch."""
    return cfg.dataset.batch_size * cfg.trainer.grad_accum_steps * world_size


@dataclass
class Built:
    """Everything a run needs, built from its config before the first step."""

    device: torch.device
    resolved: ResolvedPrecision
    model: torch.nn.Module
    channels_last: bool
    engine: Engine
    hardware: dict
    distributed: Distributed | None = None
    resumed_from: str | None = None

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run's files: always, but for ranks 1+ under torchrun."""
        return self.distributed is None or self.distributed.is_main


def build(
    cfg: RunConfig, loss_fn: LossFn | None = None, distributed: Distributed | None = None
) -> Built:
    device = distributed.device if distributed else resolve_device(cfg.trainer.device)
    resolved = resolve_precision(cfg.precision.name, device)
    configure_backends(device, cfg.trainer.deterministic, cfg.trainer.tf32)
    seed_everything(cfg.seed)
    rank, world_size = (distributed.rank.rank, distributed.world_size) if distributed else (0, 1)
    data = build_data(cfg.dataset, cfg.seed, device, rank, world_size)
    model = build_model(cfg.model, data.input_shape, data.num_classes).to(device)
    channels_last = cfg.trainer.channels_last
    if channels_last is None:
        channels_last = device.type == "cuda" and is_convolutional(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(cfg.optimizer, model, device, resolved.precision)
    total_steps = plan_total_steps(cfg.trainer, len(data.train))
    # Compile the DDP wrapper, not the reverse, so DDP's bucketed all-reduce stays in charge.
    trained = distributed.wrap(model) if distributed else model
    if cfg.trainer.compile:
        trained = torch.compile(trained, mode=cfg.trainer.compile_mode.value)
    engine = Engine(
        trained,
        optimizer,
        build_scheduler(cfg.scheduler, optimizer, total_steps),
        PrecisionPolicy(
            resolved.precision,
            cfg.precision,
            device,
            guard_nonfinite=cfg.trainer.on_nonfinite is not NonFiniteAction.off,
        ),
        data,
        cfg.trainer,
        cfg.precision,
        device,
        total_steps,
        channels_last=channels_last,
        loss_fn=loss_fn,
        distributed=distributed,
    )
    hardware = inspect_hardware(device)
    hardware["advice"] = precision_advice(resolved.precision.value, hardware)
    hardware["recommended_precision"], hardware["recommendation"] = recommend_precision(hardware)
    for advice in hardware["advice"]:
        log.warning("%s", advice)
    return Built(device, resolved, model, channels_last, engine, hardware, distributed)


def attach_diagnostics(cfg: RunConfig, built: Built, emit: Callable[[dict], None]) -> Diagnostics:
    engine = built.engine
    diagnostics = Diagnostics(
        cfg.diagnostics,
        built.model,
        engine.optimizer,
        progress=lambda: engine.progress,
        current_scale=engine.policy.scale,
        emit=emit,
    )
    measure = None
    if built.device.type == "cuda" and engine.policy.uses_autocast:
        images, _ = next(iter(engine.data.train))
        images = images.to(built.device, memory_format=engine.memory_format)

        def measure(use_autocast: bool) -> int:
            # The bare model: a DDP forward with gradients but no backward would break DDP's
            # next step.
            return forward_activation_bytes(
                built.model, images, engine.policy.autocast, use_autocast
            )

    diagnostics.activation_memory(measure)
    return diagnostics


def resume(cfg: RunConfig, built: Built, output_dir: Path) -> None:
    """Restore ``built`` from the checkpoint ``cfg.resume`` points at, if there is one."""
    if cfg.resume is None:
        return
    auto = cfg.resume == "auto"
    target = output_dir if auto else Path(cfg.resume).expanduser().resolve()
    if not auto and not target.exists():
        raise ConfigError(f"resume={cfg.resume}: no such file or directory")
    found = load_newest_valid(target)
    if found is None:
        if not auto:
            raise ConfigError(f"resume={cfg.resume}: no usable checkpoint there")
        log.info("resume=auto: no checkpoint in %s yet, starting fresh", output_dir)
        return
    path, payload = found
    restore(built.engine, built.model, payload)
    if built.is_main:
        # The run directory holds checkpoints/<file>; its history up to the checkpoint carries
        # over.
        keep_metrics_until(
            path.parent.parent / METRICS_FILE, output_dir / METRICS_FILE, payload["step"]
        )
    built.resumed_from = str(path)
    log.info("resumed from %s at step %d", path, payload["step"])


def replicas_identical(built: Built) -> bool | None:
    """Under DDP, whether all ranks ended with bit-identical weights and loss scale.

    Buffers are left out: DDP hands rank 0's to the others at each forward, so between forwards
    the ranks' BatchNorm statistics differ by design.
    """
    if built.distributed is None:
        return None
    state = list(built.model.parameters())
    scale = built.engine.policy.scale()
    if scale is not None:
        state.append(torch.tensor(scale))
    identical = built.distributed.replicas_identical(state)
    if not identical:
        log.error("the ranks' model replicas differ at the end of the run")
    return identical


def check_ranks_resumed_alike(built: Built) -> None:
    """Every rank reads the checkpoint itself; one that saw another file (or none) would train a
    diverging replica and, a step out of line, hang the others in a collective."""
    if built.distributed is None:
        return
    step = built.engine.progress.step
    lowest, highest = -built.distributed.max(-step), built.distributed.max(step)
    if lowest != highest:
        raise ConfigError(
            f"the ranks resumed at different steps ({lowest:.0f} to {highest:.0f}): every node "
            "must see the same run directory, on a file system they share"
        )


def train(
    cfg: RunConfig,
    output_dir: Path,
    loss_fn: LossFn | None = None,
    sweep: SweepJob | None = None,
) -> dict[str, Any]:
    """Run one experiment; writes metrics.jsonl, checkpoints and summary.json to ``output_dir``.

    Under torchrun every rank calls this and trains its shard; rank 0 alone writes the files and
    the W&B run, so a job has one of each.
    """
    started = time.perf_counter()
    with process_group(cfg.trainer.device) as distributed:
        return train_in_group(cfg, output_dir, distributed, loss_fn, sweep, started)


def train_in_group(
    cfg: RunConfig,
    output_dir: Path,
    distributed: Distributed | None,
    loss_fn: LossFn | None,
    sweep: SweepJob | None,
    started: float,
) -> dict[str, Any]:
    output_dir.mkdir(parents=True, exist_ok=True)
    built = build(cfg, loss_fn, distributed)
    resume(cfg, built, output_dir)
    check_ranks_resumed_alike(built)
    log.info(
        "precision %s (%s) on %s%s",
        built.resolved.precision.value,
        built.resolved.reason,
        device_name(built.device),
        ""
        if distributed is None
        else f", {distributed.world_size} ranks, global batch "
        f"{global_batch_size(cfg, distributed.world_size)}",
    )
    save = None
    if cfg.checkpoint.every_steps is not None:
        writer = CheckpointWriter(output_dir / CHECKPOINT_DIR, cfg.checkpoint.keep)
        config = to_plain_dict(OmegaConf.structured(cfg))

        # Every rank calls this at the same steps (it takes part in a collective first); the
        # replicas are identical, so rank 0's state stands for all of them.
        def save(progress: Progress) -> None:
            if built.is_main:
                writer.save(checkpoint_payload(built.engine, built.model, progress, config))

    loggers: list[Logger] = []
    wandb_logger = None
    if built.is_main:
        wandb_logger = open_wandb_logger(
            cfg,
            output_dir,
            built.resolved.precision.value,
            built.device.type,
            built.engine.total_steps,
            sweep,
            resumed_run_dir=Path(built.resumed_from).parent.parent if built.resumed_from else None,
        )
        loggers = [
            ConsoleLogger(built.engine.total_steps),
            # A fresh start replaces the rows of an earlier attempt in this directory.
            JsonlLogger(output_dir / METRICS_FILE, append=built.resumed_from is not None),
            *([wandb_logger] if wandb_logger else []),
        ]

    def emit(row: dict[str, Any]) -> None:
        for logger in loggers:
            logger.log(row)

    try:
        diagnostics = attach_diagnostics(cfg, built, emit)
        with StopRequest() as stop:
            result = built.engine.fit(
                emit,
                checkpoint=save,
                checkpoint_every=cfg.checkpoint.every_steps or 0,
                stop_requested=stop,
            )
        stop_signal = stop.requested
        if distributed is not None and result.stopped_early:
            # The ranks stopped together, but the signal may have reached only some of them:
            # all report it, and all exit with its status.
            stop_signal = signal.Signals(int(distributed.max(stop_signal or 0)))
        summary = build_summary(cfg, built, result, stop_signal, time.perf_counter() - started)
        summary.update(diagnostics.summary())
        summary["replicas_identical"] = replicas_identical(built)
        if built.is_main:
            write_json(output_dir / "summary.json", summary)
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
        "%s: %s %s on %s, %s samples/s, final loss %s, eval acc %s -> %s",
        summary["status"],
        summary["model"],
        summary["precision"],
        summary["device"],
        "-" if result.samples_per_s is None else f"{result.samples_per_s:.0f}",
        "-" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}",
        "-" if summary["eval_acc"] is None else f"{summary['eval_acc']:.2%}",
        output_dir,
    )
    # Under submitit, its SIGUSR2 handler now requeues the job to resume (amp_exp/signals.py).
    stop.hand_over()
    return summary
