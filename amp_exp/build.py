"""Build everything a run needs from its validated config, before the first step.

Config in; device, task, model, optimizer, schedule, precision policy, strategy and engine out.
Nothing here trains or writes files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from amp_exp.config.schema import NonFiniteAction, RunConfig
from amp_exp.runtime.distributed import Distributed
from amp_exp.runtime.flops import Utilization, peak_tflops
from amp_exp.runtime.hardware import (
    ResolvedPrecision,
    configure_backends,
    device_name,
    inspect_hardware,
    precision_advice,
    recommend_precision,
    resolve_device,
    resolve_precision,
)
from amp_exp.tasks.classification import LossFn
from amp_exp.tasks.workload import build_workload
from amp_exp.training.diagnostics import Diagnostics, forward_activation_bytes
from amp_exp.training.engine import Engine
from amp_exp.training.loop import LoopPlan, plan_total_steps
from amp_exp.training.optim import build_optimizer, build_scheduler
from amp_exp.training.precision import PrecisionPolicy
from amp_exp.training.rng import seed_everything
from amp_exp.training.skips import SkipMonitor

log = logging.getLogger("amp_exp")


@dataclass
class Built:
    """Everything a run needs, built from its config before the first step."""

    device: torch.device
    resolved: ResolvedPrecision
    # The module as built, inside any DDP or torch.compile wrapper the engine trains through.
    model: torch.nn.Module
    channels_last: bool
    engine: Engine
    hardware: dict
    # Tokens/s to TFLOP/s and MFU, for tasks whose unit is tokens.
    utilization: Utilization = field(default_factory=Utilization)
    # What the data records in summary.json (the synthetic tokens' loss_floor).
    recorded: dict = field(default_factory=dict)
    distributed: Distributed | None = None
    resumed_from: str | None = None

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run's files: always, but for ranks 1+ under torchrun."""
        return self.distributed is None or self.distributed.is_main


def global_batch_size(cfg: RunConfig, world_size: int) -> int:
    """Samples per optimizer step: dataset.batch_size is per rank and per micro-batch."""
    return cfg.dataset.batch_size * cfg.trainer.grad_accum_steps * world_size


def hardware_facts(device: torch.device, precision: str) -> dict:
    """What the device offers, the advice for this precision (logged), and the recommendation."""
    hardware = inspect_hardware(device)
    hardware["advice"] = precision_advice(precision, hardware)
    hardware["recommended_precision"], hardware["recommendation"] = recommend_precision(hardware)
    for advice in hardware["advice"]:
        log.warning("%s", advice)
    return hardware


def build(
    cfg: RunConfig, loss_fn: LossFn | None = None, distributed: Distributed | None = None
) -> Built:
    device = distributed.device if distributed else resolve_device(cfg.trainer.device)
    resolved = resolve_precision(cfg.precision.name, device)
    configure_backends(device, cfg.trainer.deterministic, cfg.trainer.tf32)
    seed_everything(cfg.seed)
    rank, world_size = (distributed.rank.rank, distributed.world_size) if distributed else (0, 1)
    workload = build_workload(cfg, device, rank, world_size, loss_fn)
    model, data = workload.model, workload.data
    optimizer = build_optimizer(cfg.optimizer, model, device, resolved.precision)
    total_steps = plan_total_steps(cfg.trainer, len(data.train))
    # Compile the DDP wrapper, not the reverse, so DDP's bucketed all-reduce stays in charge.
    trained = distributed.wrap(model) if distributed else model
    if cfg.trainer.compile:
        trained = torch.compile(trained, mode=cfg.trainer.compile_mode.value)
    policy = PrecisionPolicy(
        resolved.precision,
        cfg.precision,
        device,
        guard_nonfinite=cfg.trainer.on_nonfinite is not NonFiniteAction.off,
    )
    engine = Engine(
        trained,
        workload.task,
        data.train,
        data.eval,
        optimizer,
        policy,
        LoopPlan.from_config(cfg.trainer, total_steps),
        scheduler=build_scheduler(cfg.scheduler, optimizer, total_steps),
        skips=SkipMonitor.from_config(
            cfg.precision, cfg.trainer.on_nonfinite, cfg.checkpoint.every_steps is not None
        ),
        distributed=distributed,
    )
    hardware = hardware_facts(device, resolved.precision.value)
    peak = (None, None)
    if device.type == "cuda":
        peak = peak_tflops(device_name(device), resolved.precision.value, cfg.trainer.tf32)
    return Built(
        device,
        resolved,
        model,
        workload.channels_last,
        engine,
        hardware,
        Utilization(workload.flops_per_token, *peak),
        data.recorded,
        distributed,
    )


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
        inputs = engine.task.to_device(next(iter(engine.data)))[0]

        def measure(use_autocast: bool) -> int:
            # The bare model: a DDP forward with gradients but no backward would break DDP's
            # next step.
            return forward_activation_bytes(
                built.model, inputs, engine.policy.autocast, use_autocast
            )

    diagnostics.activation_memory(measure)
    return diagnostics
