"""The training loop: one code path for every precision, device and task.

The engine trains whatever its ``Task`` hands it and knows nothing of what that is. It does no
I/O: rows go to ``emit`` and checkpoints to a ``CheckpointSink``. Nothing in the per-step path
reads a device value back to the host: loss, scale and gradient norm stay on the device and are
read only at log intervals. A step with non-finite gradients is skipped on the device, and the
host learns of it at the next log step (training/skips.py); only an optimizer that cannot
skip on the device makes the host decide, one read per step (training/precisions/base.py).

Under torchrun (``distributed``) every rank runs this loop on its own shard. The ranks agree on
whatever a host decision depends on (the logged loss, skipped steps, evaluation sums) at log
intervals, and on a stop request at least every ``STOP_CHECK_STEPS`` steps, so they always take
the same branch and meet in the same collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from amp_exp.runtime.distributed import Distributed, load_plain_state, plain_state, unwrap
from amp_exp.tasks.base import Batches, Task
from amp_exp.training.callbacks import StepCallbacks
from amp_exp.training.loop import LoopPlan, Progress, TrainResult
from amp_exp.training.meters import (
    Meter,
    Throughput,
    peak_memory_bytes,
    reset_peak_memory,
    synchronize,
)
from amp_exp.training.precisions.base import PrecisionPlugin
from amp_exp.training.rng import own_rng_state, restore_rng_state, rng_state
from amp_exp.training.signals import SignalCollector
from amp_exp.training.skips import SkipMonitor, SkipRecord

Emit = Callable[[dict], None]
StepInstrument = Callable[[int, int], contextlib.AbstractContextManager]
NO_INSTRUMENT = contextlib.nullcontext()


class CheckpointSink(Protocol):
    """Decides when a checkpoint is due, and keeps the engine's state when it is."""

    def is_due(self, progress: Progress, last: bool) -> bool: ...

    def save(self, state: dict[str, Any]) -> None: ...


class Engine:
    def __init__(
        self,
        model: nn.Module,
        task: Task,
        data: Batches,
        eval_data: Batches | None,
        optimizer: torch.optim.Optimizer,
        precision: PrecisionPlugin,
        plan: LoopPlan,
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        skips: SkipMonitor | None = None,
        distributed: Distributed | None = None,
        meter: Meter | None = None,
    ) -> None:
        """``model`` is what trains (it may be wrapped by DDP or torch.compile, or sharded by
        FSDP2); state dicts are taken from the module inside the wrappers, or (FSDP2) are this
        rank's shards, keyed by parameter name. ``meter`` turns samples/s into the task's units,
        FLOPs and MFU (the Meter that build makes); without one, rows count samples only."""
        self.model, self.task, self.data, self.eval_data = model, task, data, eval_data
        self.optimizer, self.precision, self.plan = optimizer, precision, plan
        self.scheduler = scheduler
        self.skips = skips or SkipMonitor()
        self.distributed = distributed
        self.device = precision.device
        self.world_size = 1 if distributed is None else distributed.world_size
        self.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.progress = Progress()
        self.meter = meter or Meter()
        # Timed training of this run, attempt by attempt.
        self.throughput = Throughput(self.device, precision.spec.name, precision.timed)
        # What examines each step besides the update, in training/callbacks.ORDER.
        self.callbacks = StepCallbacks()
        names = {id(p): name for name, p in unwrap(model).named_parameters()}
        self.skip_record = SkipRecord([names[id(p)] for p in self.parameters], self.device)
        # Called before each step with the step and this attempt's first timed step; the
        # context it returns wraps that step (training/audit/step.py audits one this way).
        self.step_instrument: StepInstrument = lambda step, first_timed_step: NO_INSTRUMENT
        # The long-run signals (training/signals.py): armed before each log step, read into a
        # "signals" row after its train row; None measures nothing.
        self.signals: SignalCollector | None = None

    @property
    def total_steps(self) -> int:
        return self.plan.total_steps

    # --- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: model, optimizer, schedule, scaler, progress,
        the skipped steps not yet read, and every rank's random number generators (a
        collective under torchrun: every rank calls it)."""
        model_state, optimizer_state = (
            plain_state(self.model, self.optimizer)
            if self.distributed is None
            else self.distributed.state_of(self.model, self.optimizer)
        )
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            **self.precision.checkpoint_state(),
            "progress": dataclasses.asdict(self.progress),
            "throughput": self.throughput.state_dict(self.progress.step),
            "skip_record": self.skip_record.state_dict(),
            # Each rank's own: its loss over the partly filled log interval, its generators.
            "interval_losses": self._every_rank(self.progress.interval_loss),
            "rng": self._every_rank(rng_state(self.device)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load = load_plain_state if self.distributed is None else self.distributed.load_state
        load(self.model, self.optimizer, state["model"], state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_checkpoint_state(state)
        self.progress = Progress(**state["progress"])
        rank = 0 if self.distributed is None else self.distributed.rank.rank
        losses = state["interval_losses"]
        # On another number of ranks (FSDP2 reshards) each takes their mean: the same logged mean.
        same_ranks = len(losses) == self.world_size
        self.progress.interval_loss = losses[rank] if same_ranks else sum(losses) / len(losses)
        self.throughput.load_state_dict(state["throughput"])
        self.skip_record.load_state_dict(state["skip_record"])
        restore_rng_state(own_rng_state(state["rng"], rank), self.device)

    # --- collectives (no-ops in a single process) ---------------------------------------------

    def _sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.distributed is None else self.distributed.sum(tensor)

    def _every_rank(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank, on every rank."""
        return [value] if self.distributed is None else self.distributed.gather(value)

    def _gradient_sync(self, micro_batch: int) -> contextlib.AbstractContextManager:
        """DDP and FSDP2 reduce gradients on the last micro-batch of a step only."""
        last = micro_batch == self.plan.grad_accum_steps - 1
        if self.distributed is None or last:
            return contextlib.nullcontext()
        return self.distributed.no_sync()

    # --- pieces of a step ---------------------------------------------------------------------

    def train_batches(self) -> Iterator[Any]:
        """Batches from where ``progress`` stands, keeping its epoch position current."""
        progress = self.progress
        for epoch in itertools.count(progress.epoch):
            start = progress.batch_in_epoch if epoch == progress.epoch else 0
            progress.epoch, progress.batch_in_epoch = epoch, start
            self.data.set_epoch(epoch, start)
            for batch in self.data:
                progress.batch_in_epoch += 1
                yield batch

    def train_step(
        self, batches: Iterator[Any], interval_loss: torch.Tensor, want_grad_norm: bool
    ) -> torch.Tensor | None:
        """One optimizer step over ``grad_accum_steps`` micro-batches: the AMP sequence, top to
        bottom. Each comment names what the precision's plugin does there (its hooks:
        training/precisions/base.py); the GradScaler's three (scale, unscale, update) are fp16's
        alone and pass through elsewhere. The step callbacks run where training/callbacks.py
        states. Returns the gradient norm (on the device) or None."""
        precision, accum = self.precision, self.plan.grad_accum_steps
        progress = self.progress
        step = progress.step + 1
        for micro_batch in range(accum):
            batch = self.task.to_device(next(batches))
            with self._gradient_sync(micro_batch):
                # autocast: the forward and the loss in the plugin's ``forward_context``.
                with precision.forward_context():
                    loss = self.task.loss(self.model, batch)
                    if accum > 1:
                        # [accumulate] k micro-batches then sum to one batch k times larger.
                        loss = loss / accum
                # scale (the GradScaler), then backward: the plugin's ``backward``.
                precision.backward(precision.scaled(loss))
            interval_loss += loss.detach()
            progress.samples += self.task.batch_samples(batch) * self.world_size
        # unscale (the GradScaler): clipping thresholds refer to true gradients.
        precision.unscale(self.optimizer)
        # clip, and find on the device whether this step must skip (non-finite gradients).
        gradients = precision.clip(self.parameters, want_grad_norm)
        self.callbacks.after_clip(step, gradients)
        # step, skipped on the device if non-finite: the plugin's ``optimizer_step``.
        precision.step(self.optimizer, gradients.found_inf)
        # update (the GradScaler): its scale backs off after a skip, grows after a finite run.
        precision.update()
        self.callbacks.after_step(step)
        if gradients.found_inf is not None:
            # Every earlier step since the last read was applied, so its loss was finite: the
            # interval's sum is finite exactly when this step's loss is.
            self.skip_record.add(step, gradients.found_inf, interval_loss, gradients.nonfinite)
        progress.step = step
        progress.interval_steps += 1
        if self.scheduler is not None:
            # scheduler: as if the step was applied; read_skips takes back the steps that were
            # not (the host learns of them only at the next log step).
            with warnings.catch_warnings():
                # Of a skipped first step PyTorch warns that the schedule loses its first value;
                # taken back, it does not.
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return gradients.norm

    def read_skips(self) -> None:
        """Take in the steps the device skipped since the last read; one host read.

        The schedule stepped on each of them, so it is moved back by as many: until this read
        the learning rate ran ahead by the steps skipped in the interval.
        """
        skipped = self.skip_record.read(self.distributed)
        progress = self.progress
        progress.consecutive_skips = skipped.run
        if not skipped.count:
            return
        progress.skipped_steps += skipped.count
        if self.scheduler is not None:
            # amp_exp's schedules (LambdaLR, OneCycleLR) are closed-form in the step count.
            self.scheduler.last_epoch -= skipped.count + 1
            self.scheduler.step()
        self.skips.on_skipped_steps(
            progress, self.precision.spec.name, self.precision.scale(), skipped
        )

    def log_row(
        self,
        interval_loss: torch.Tensor,
        grad_norm: torch.Tensor | None,
        rates: tuple[float | None, float | None],
    ) -> dict[str, Any]:
        """The train row of a log step; reads the loss, grad norm and scale from the device."""
        progress = self.progress
        interval_total = self._sum_over_ranks(interval_loss).item()
        progress.final_loss = interval_total / (progress.interval_steps * self.world_size)
        samples_per_s, step_time_ms = rates
        scale, scale_mean = self.precision.scale_reading()
        return {
            "kind": "train",
            "step": progress.step,
            "epoch": progress.epoch,
            "samples": progress.samples,
            "loss": progress.final_loss,
            # float(): torchao's optimizers keep the learning rate in a (CPU) tensor.
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "grad_norm": None if grad_norm is None else grad_norm.item(),
            "scale": scale,
            "scale_mean": scale_mean,
            "skipped_steps": progress.skipped_steps,
            **self.meter.rates(samples_per_s),
            "step_time_ms": step_time_ms,
            "peak_mem_bytes": peak_memory_bytes(self.device),
        }

    def evaluate(self) -> dict[str, float | None]:
        """The task's eval metrics over the eval split, in the training precision.

        Under torchrun each rank evaluates its share with rank 0's buffers, on a module whose
        forward is no collective (``Distributed.evaluating``): a rank without eval batches never
        joins one.
        """
        evaluating = (
            contextlib.nullcontext(self.model)
            if self.distributed is None
            else self.distributed.evaluating(self.model)
        )
        totals = torch.zeros(len(self.task.eval_sum_names), device=self.device, dtype=torch.float64)
        batches = itertools.islice(self.eval_data or [], self.plan.eval_batches)
        with evaluating as model:
            model.eval()
            with self.precision.inference_context(), self.precision.forward_context():
                for batch in batches:
                    totals += self.task.eval_sums(model, self.task.to_device(batch))
            model.train()
        return self.task.eval_metrics(self._sum_over_ranks(totals).tolist())

    def _evaluate_at(self, step: int, emit: Emit) -> None:
        with self.throughput.paused():
            self.progress.eval = self.evaluate()
        self.progress.eval_step = step
        emit({"kind": "eval", "step": step, "samples": self.progress.samples, **self.progress.eval})

    def maybe_save(
        self, checkpoints: CheckpointSink | None, interval_loss: torch.Tensor, last: bool
    ) -> None:
        """Save when ``checkpoints`` says one is due, off the throughput clock."""
        if checkpoints is None or not checkpoints.is_due(self.progress, last):
            return
        # Due by the step count; is it inside a run of skipped steps as of now, not as of the
        # last log step?
        self.progress.consecutive_skips = self.skip_record.current_run()
        if not checkpoints.is_due(self.progress, last):
            return
        with self.throughput.paused():
            self.progress.interval_loss = interval_loss.item()
            checkpoints.save(self.state_dict())

    # --- the loop -------------------------------------------------------------------------------

    def fit(
        self,
        emit: Emit,
        checkpoints: CheckpointSink | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
    ) -> TrainResult:
        """Train from ``self.progress`` to ``plan.total_steps``, or until a stop is requested.

        Rows go to ``emit`` as they happen; a stop request ends the run after the current step,
        with a checkpoint when ``checkpoints`` is given.
        """
        plan, progress = self.plan, self.progress
        first_step = progress.step + 1
        warmup_steps = min(plan.timing_warmup_steps, max(plan.total_steps - first_step, 0))
        batches = self.train_batches()
        throughput = self.throughput
        reset_peak_memory(self.device)
        interval_loss = torch.tensor(progress.interval_loss, device=self.device)
        scale = self.precision.scale()
        started = time.perf_counter()
        warmup_s = 0.0
        stopped_early = False
        self.model.train()
        for step in range(first_step, plan.total_steps + 1):
            if step == first_step + warmup_steps:
                throughput.start(progress.samples, progress.step)
                warmup_s = time.perf_counter() - started
            is_log_step = plan.is_log_step(step)
            if is_log_step and self.signals is not None:
                self.signals.arm()
            with self.step_instrument(step, first_step + warmup_steps):
                grad_norm = self.train_step(batches, interval_loss, want_grad_norm=is_log_step)
            if is_log_step:
                self.read_skips()
                row = self.log_row(interval_loss, grad_norm, throughput.lap(progress.samples, step))
                scale = row["scale"]
                emit(row)
                if self.signals is not None:
                    emit({"kind": "signals", "step": step, **self.signals.collect()})
                interval_loss.zero_()
                progress.interval_steps = 0
            if plan.is_eval_step(step):
                self._evaluate_at(step, emit)
            last = step == plan.total_steps
            requested = stop_requested()
            if self.distributed is not None:
                # A signal may reach the ranks at different steps; they agree at a stop check.
                requested = plan.is_stop_check_step(step) and self.distributed.any(requested)
            stopped_early = requested and not last
            self.maybe_save(checkpoints, interval_loss, last or stopped_early)
            if stopped_early:
                break
        if stopped_early and not is_log_step:
            self.read_skips()
        # Resumed at its last step, saved before that step was the last (a run stopped at step
        # 20, resumed with max_steps=20): it ends, as every run does, with an evaluation.
        resumed_at_end = first_step > plan.total_steps and progress.eval_step != progress.step
        if resumed_at_end and plan.is_eval_step(progress.step):
            self._evaluate_at(progress.step, emit)
        synchronize(self.device)
        return TrainResult(
            progress=progress,
            samples_per_s=throughput.samples_per_s(),
            step_time_ms=throughput.step_time_ms(),
            timed_steps=throughput.timed_steps(),
            attempts=throughput.attempts(progress.step),
            warmup_s=warmup_s,
            peak_mem_bytes=peak_memory_bytes(self.device),
            loss_scale=scale,
            stopped_early=stopped_early,
        )
