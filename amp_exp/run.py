"""Build everything a run needs from its config, train it, and write its results to disk."""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from amp_exp.config import RunConfig
from amp_exp.data import build_data
from amp_exp.engine import Engine, LossFn, TrainResult, plan_total_steps
from amp_exp.hardware import (
    configure_backends,
    device_name,
    git_sha,
    resolve_device,
    seed_everything,
)
from amp_exp.loggers import ConsoleLogger, JsonlLogger, Logger
from amp_exp.models import build_model, is_convolutional
from amp_exp.optim import build_optimizer, build_scheduler
from amp_exp.precision import PrecisionPolicy, ResolvedPrecision, resolve_precision
from amp_exp.sweep import SweepJob
from amp_exp.wandb_logger import open_wandb_logger

log = logging.getLogger("amp_exp")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def build_summary(
    cfg: RunConfig,
    resolved: ResolvedPrecision,
    device: torch.device,
    result: TrainResult,
    parameters: int,
    channels_last: bool,
    wall_s: float,
) -> dict[str, Any]:
    return {
        "status": "completed",
        "precision": resolved.precision.value,
        "precision_reason": resolved.reason,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name.value,
        "optimizer": cfg.optimizer.name,
        "device": device.type,
        "device_name": device_name(device),
        "seed": cfg.seed,
        "batch_size": cfg.dataset.batch_size,
        "grad_accum_steps": cfg.trainer.grad_accum_steps,
        "parameters": parameters,
        "channels_last": channels_last,
        "compile": cfg.trainer.compile,
        "steps": result.steps,
        "samples_seen": result.samples_seen,
        "timed_steps": result.timed_steps,
        "warmup_s": result.warmup_s,
        "samples_per_s": result.samples_per_s,
        "step_time_ms": result.step_time_ms,
        "peak_mem_bytes": result.peak_mem_bytes,
        "peak_mem_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss",
        "final_loss": result.final_loss,
        "eval_loss": result.eval_loss,
        "eval_acc": result.eval_acc,
        "loss_scale": result.loss_scale,
        "skipped_steps": result.skipped_steps,
        "wall_s": wall_s,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "git_sha": git_sha(),
    }


@dataclass
class Built:
    """Everything a run needs, built from its config before the first step."""

    device: torch.device
    resolved: ResolvedPrecision
    model: torch.nn.Module
    channels_last: bool
    engine: Engine


def build(cfg: RunConfig, loss_fn: Optional[LossFn] = None) -> Built:
    device = resolve_device(cfg.trainer.device)
    resolved = resolve_precision(cfg.precision.name, device)
    configure_backends(device, cfg.trainer.deterministic)
    seed_everything(cfg.seed)
    data = build_data(cfg.dataset, cfg.seed, device)
    model = build_model(cfg.model, data.input_shape, data.num_classes).to(device)
    channels_last = cfg.trainer.channels_last
    if channels_last is None:
        channels_last = device.type == "cuda" and is_convolutional(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(cfg.optimizer, model, device, resolved.precision)
    total_steps = plan_total_steps(cfg.trainer, len(data.train))
    compiled = cfg.trainer.compile
    engine = Engine(
        torch.compile(model, mode=cfg.trainer.compile_mode.value) if compiled else model,
        optimizer,
        build_scheduler(cfg.scheduler, optimizer, total_steps),
        PrecisionPolicy(resolved.precision, cfg.precision, device),
        data,
        cfg.trainer,
        device,
        total_steps,
        channels_last=channels_last,
        loss_fn=loss_fn,
    )
    return Built(device, resolved, model, channels_last, engine)


def train(
    cfg: RunConfig,
    output_dir: Path,
    loss_fn: Optional[LossFn] = None,
    sweep: Optional[SweepJob] = None,
) -> dict[str, Any]:
    """Run one experiment; writes metrics.jsonl and summary.json into ``output_dir``."""
    started = time.perf_counter()
    output_dir.mkdir(parents=True, exist_ok=True)
    built = build(cfg, loss_fn)
    log.info(
        "precision %s (%s) on %s",
        built.resolved.precision.value,
        built.resolved.reason,
        device_name(built.device),
    )
    wandb_logger = open_wandb_logger(
        cfg,
        output_dir,
        built.resolved.precision.value,
        built.device.type,
        built.engine.total_steps,
        sweep,
    )
    loggers: list[Logger] = [
        ConsoleLogger(built.engine.total_steps),
        JsonlLogger(output_dir / "metrics.jsonl"),
        *([wandb_logger] if wandb_logger else []),
    ]
    try:
        result = built.engine.fit(lambda row: [logger.log(row) for logger in loggers])
        summary = build_summary(
            cfg,
            built.resolved,
            built.device,
            result,
            sum(p.numel() for p in built.model.parameters()),
            built.channels_last,
            time.perf_counter() - started,
        )
        write_json(output_dir / "summary.json", summary)
    finally:
        # W&B closes last: whatever its finish() does, the result files are already written.
        for logger in loggers:
            logger.close()
    log.info(
        "done: %s %s on %s, %s samples/s, final loss %.4f, eval acc %s -> %s",
        summary["model"],
        summary["precision"],
        summary["device"],
        "-" if result.samples_per_s is None else f"{result.samples_per_s:.0f}",
        result.final_loss,
        "-" if result.eval_acc is None else f"{result.eval_acc:.2%}",
        output_dir,
    )
    return summary
