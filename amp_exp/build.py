"""Build everything a run needs from its validated config, before the first step.

Config in; device, task, model, optimizer, schedule, precision plugin, strategy and engine out.
Nothing here trains or writes files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from amp_exp.capability.auto import resolve_precision
from amp_exp.capability.device import capability_of, check_request, kernels_of
from amp_exp.capability.rounds import pass_trials
from amp_exp.config.adaptive import COMPILE_AUTO
from amp_exp.config.precisions import ResolvedPrecision
from amp_exp.config.schema import NonFiniteAction, RunConfig
from amp_exp.launch import ALONE
from amp_exp.runtime.distributed import Distributed
from amp_exp.runtime.fsdp import ShardingDtypes
from amp_exp.runtime.hardware import configure_backends, device_name, resolve_device
from amp_exp.tasks.blocks import checkpoint_blocks, compile_blocks, model_blocks
from amp_exp.tasks.sampling import Placement
from amp_exp.tasks.workload import build_workload
from amp_exp.training.audit.step import PrecisionAudit
from amp_exp.training.diagnostics import Diagnostics
from amp_exp.training.engine import Engine
from amp_exp.training.flops import peak_tflops
from amp_exp.training.keep_fp32 import match_keep_fp32
from amp_exp.training.loop import LoopPlan, plan_total_steps
from amp_exp.training.meters import Meter
from amp_exp.training.optim import build_optimizer, build_scheduler
from amp_exp.training.precisions.base import PrecisionPlugin, create
from amp_exp.training.rng import seed_everything
from amp_exp.training.signals import Limits, SignalCollector, SignalsCallback
from amp_exp.training.skips import SkipMonitor

log = logging.getLogger("amp_exp")


@dataclass
class Built:
    """Everything a run needs, built from its config before the first step."""

    device: torch.device
    resolved: ResolvedPrecision
    # The module as built, inside any DDP or torch.compile wrapper the engine trains through
    # (FSDP2 shards it in place).
    model: torch.nn.Module
    channels_last: bool
    engine: Engine
    hardware: dict
    # What the data records in summary.json (the synthetic tokens' loss_floor).
    recorded: dict = field(default_factory=dict)
    distributed: Distributed | None = None
    resumed_from: str | None = None
    # strategy (single, ddp, fsdp2), param_dtype and reduce_dtype: what summary.json and W&B say.
    parallelism: dict | None = None
    # Whether the model trains compiled (trainer.compile, auto resolved for this precision).
    compiled: bool = False

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run's files: always, but for ranks 1+ under torchrun."""
        return self.distributed is None or self.distributed.is_main


def global_batch_size(cfg: RunConfig, world_size: int) -> int:
    """Samples per optimizer step: dataset.batch_size is per rank and per micro-batch."""
    return cfg.dataset.batch_size * cfg.trainer.grad_accum_steps * world_size


def compiles(cfg: RunConfig, plugin: PrecisionPlugin) -> bool:
    """trainer.compile, with auto resolved: compiled on CUDA where the precision's row says it
    needs compiling to be fast (fp8), and only where it is timed (emulated fp8 is not)."""
    choice = cfg.trainer.compile
    if choice == COMPILE_AUTO:
        return plugin.device.type == "cuda" and plugin.spec.compile_on_cuda and plugin.timed
    return bool(choice)


def build(
    cfg: RunConfig,
    distributed: Distributed | None = None,
    kept: ResolvedPrecision | None = None,
) -> Built:
    """``kept``: the precision a resumed run keeps (results.resume.kept_precision), in place
    of deciding precision=auto again."""
    device = distributed.device if distributed else resolve_device(cfg.trainer.device)
    check_request(cfg.precision.name, device, cfg.precision)
    configure_backends(device, cfg.trainer.deterministic, cfg.trainer.tf32)
    # Measured under the backend switches just set; cached after the first run on this device.
    capability = capability_of(device)
    seed_everything(cfg.seed)
    worker = distributed.rank if distributed else ALONE
    workload = build_workload(cfg, Placement(cfg.seed, device, worker))
    # As soon as the model exists: a pattern that matches nothing stops the run before
    # precision=auto's timing or anything else is spent on it.
    keep_fp32 = match_keep_fp32(workload.model, cfg.precision.keep_fp32)
    resolved = kept or resolve_precision(cfg, capability, workload, pass_trials, distributed)
    shards = distributed is not None and distributed.shards
    dtypes = None
    if distributed is not None:
        dtypes = ShardingDtypes.for_precision(
            resolved.precision, cfg.precision.reduce_dtype, cfg.precision.fsdp_cast_params
        )
    plugin = create(
        resolved.precision,
        cfg.precision,
        device,
        guard_nonfinite=cfg.trainer.on_nonfinite is not NonFiniteAction.off,
        params_cast=shards and dtypes is not None and dtypes.casts_params,
        keep_fp32=keep_fp32,
    )
    model, data = plugin.convert_module(workload.model), workload.data
    compiled = compiles(cfg, plugin)
    if cfg.trainer.activation_checkpointing:
        checkpoint_blocks(model, cfg.model.name)
    if shards and compiled:
        # torchtitan's order: each block compiled (after its checkpointing), then sharded.
        compile_blocks(model, cfg.trainer.compile_mode)
    blocks = model_blocks(model) or []
    trained = distributed.wrap(model, dtypes, blocks, keep_fp32) if distributed else model
    # After wrapping: FSDP2 replaced the parameters with their shards.
    optimizer, plugin.rounding = build_optimizer(
        cfg.optimizer, model, device, plugin.stochastic_rounding, sharded=shards
    )
    total_steps = plan_total_steps(cfg.trainer, len(data.train))
    if compiled and not shards:
        # Compile the DDP wrapper, not the reverse, so DDP's bucketed all-reduce stays in charge.
        trained = torch.compile(trained, mode=cfg.trainer.compile_mode.value)
    hardware = capability.summary(resolved, kernels_of(workload.model))
    # The run's meter: the task's units, the model's FLOPs, and one device's peaks (on a GPU: the
    # datasheet's, and the probe's measured one).
    peak, measured_peak = (None, None), None
    if device.type == "cuda":
        peak = peak_tflops(device_name(device), resolved.precision, cfg.trainer.tf32)
        measured_peak = hardware["measured_peak_tflops"]
    task = workload.task
    units = (task.unit, task.units_per_sample, worker.world_size, workload.flops_per_token)
    meter = Meter(*units, *peak, measured_peak)
    engine = Engine(
        trained,
        workload.task,
        data.train,
        data.eval,
        optimizer,
        plugin,
        LoopPlan.from_config(cfg.trainer, total_steps),
        scheduler=build_scheduler(cfg.scheduler, optimizer, total_steps),
        skips=SkipMonitor.from_config(
            cfg.precision, cfg.trainer.on_nonfinite, cfg.checkpoint.every_steps is not None
        ),
        distributed=distributed,
        meter=meter,
    )
    if cfg.diagnostics.signals:
        engine.signals = SignalCollector(Limits.of(plugin.spec)).attach(
            model, activations=not compiled
        )
        engine.callbacks.add(SignalsCallback(engine.signals))
    # How the model was spread over the ranks, the dtype the forward took its weights in
    # (autocast casts from there) and the one gradients were summed over the ranks in.
    strategy, param, reduce = "single", plugin.spec.weight_dtype.short, None
    if distributed is not None and dtypes is not None:
        strategy, param, reduce = distributed.strategy.value, dtypes.param, dtypes.reduce
    return Built(
        device,
        resolved,
        model,
        workload.channels_last,
        engine,
        hardware,
        data.recorded,
        distributed,
        parallelism={"strategy": strategy, "param_dtype": param, "reduce_dtype": reduce},
        compiled=compiled,
    )


def attach_diagnostics(cfg: RunConfig, built: Built, emit: Callable[[dict], None]) -> Diagnostics:
    engine = built.engine
    diagnostics = Diagnostics(
        cfg.diagnostics,
        built.model,
        progress=lambda: engine.progress,
        current_scale=engine.precision.scale,
        emit=emit,
        weight_dtype=engine.precision.spec.weight_dtype.torch,
        distributed=built.distributed,
    )
    engine.callbacks.add(diagnostics)
    return diagnostics


def attach_audit(cfg: RunConfig, built: Built) -> PrecisionAudit | None:
    """The precision audit of one step (training/audit/), unless turned off: then nothing is
    installed, and no step pays for it."""
    if not cfg.diagnostics.audit:
        return None
    # Compiled kernels hide their ops: a compiled run audits one step run eagerly, by default its
    # first, before anything is compiled.
    return PrecisionAudit(built.engine, cfg.diagnostics.audit_step, eager=built.compiled)
