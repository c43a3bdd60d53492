"""The training loop: one code path for every precision and device.

The engine works on already-built objects and hands metric dicts to ``emit``; it does no I/O.
Nothing in the per-step path reads a device value back to the host: loss, scale and gradient
norm stay on the device and are read only at log intervals. The exceptions are rare events: a
skipped step is examined when it happens, and the fp32/bf16 non-finite guard reads one flag.

Under torchrun (``distributed``) every rank runs this loop on its own shard. The ranks agree on
whatever a host decision depends on (the logged loss, a stop request, evaluation sums) at log
intervals, so they always take the same branch and meet in the same collectives.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from amp_exp.config import ConfigError, NonFiniteAction, PrecisionConfig, TrainerConfig
from amp_exp.data import DataBundle
from amp_exp.distributed import Distributed
from amp_exp.meters import Throughput, peak_memory_bytes, reset_peak_memory, synchronize
from amp_exp.models import unwrap
from amp_exp.precision import PrecisionPolicy

log = logging.getLogger("amp_exp")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Emit = Callable[[dict], None]


class NumericalFault(RuntimeError):
    """Training cannot go on in this precision; the message says why and what to try."""


@dataclass
class Progress:
    """Where training stands: all a checkpoint needs to continue the loop exactly."""

    step: int = 0
    epoch: int = 0
    # Batches of ``epoch`` already trained on.
    batch_in_epoch: int = 0
    samples: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    # The partly filled log interval, so a resumed run logs the same rows.
    interval_steps: int = 0
    interval_loss: float = 0.0
    final_loss: float | None = None
    eval_loss: float | None = None
    eval_acc: float | None = None
    # The first skipped step: when, which parameters had non-finite gradients, and whether the
    # loss itself was finite (if it was, the overflow happened in the backward pass).
    first_overflow: dict | None = None


@dataclass
class TrainResult:
    progress: Progress
    samples_per_s: float | None
    step_time_ms: float | None
    timed_steps: int
    warmup_s: float
    peak_mem_bytes: int
    loss_scale: float | None
    # Set when a stop request (a preemption signal) ended the run before total_steps.
    stopped_early: bool = False


@dataclass
class SkipForensics:
    """What the skipped steps looked like, kept for the message when a run has to stop."""

    first_nonfinite: list[str] = field(default_factory=list)
    scale_history: deque = field(default_factory=lambda: deque(maxlen=8))


def plan_total_steps(trainer: TrainerConfig, batches_per_epoch: int) -> int:
    """Optimizer steps to run: the first of max_steps and epochs to be reached."""
    limits = []
    if trainer.max_steps is not None:
        limits.append(trainer.max_steps)
    if trainer.epochs is not None:
        steps_per_epoch = batches_per_epoch // trainer.grad_accum_steps
        if steps_per_epoch == 0:
            raise ConfigError(
                f"an epoch has {batches_per_epoch} batches, fewer than "
                f"trainer.grad_accum_steps={trainer.grad_accum_steps}; lower it or the batch size"
            )
        limits.append(trainer.epochs * steps_per_epoch)
    return min(limits)


class Engine:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        policy: PrecisionPolicy,
        data: DataBundle,
        trainer: TrainerConfig,
        limits: PrecisionConfig,
        device: torch.device,
        total_steps: int,
        channels_last: bool = False,
        loss_fn: LossFn | None = None,
        distributed: Distributed | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.policy, self.data, self.trainer, self.device = policy, data, trainer, device
        self.limits = limits
        self.loss_fn = loss_fn or F.cross_entropy
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.parameter_names = {id(p): name for name, p in unwrap(model).named_parameters()}
        self.distributed = distributed
        self.world_size = 1 if distributed is None else distributed.world_size
        self.total_steps = total_steps
        self.progress = Progress()
        self.forensics = SkipForensics()
        policy.watch(optimizer)

    def _to_device(self, images: torch.Tensor, labels: torch.Tensor):
        images = images.to(self.device, non_blocking=True, memory_format=self.memory_format)
        return images, labels.to(self.device, non_blocking=True)

    def _train_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches from where ``progress`` stands, keeping its epoch position current."""
        progress = self.progress
        for epoch in itertools.count(progress.epoch):
            start = progress.batch_in_epoch if epoch == progress.epoch else 0
            progress.epoch, progress.batch_in_epoch = epoch, start
            self.data.train.set_epoch(epoch, start)
            for batch in self.data.train:
                progress.batch_in_epoch += 1
                yield batch

    def _sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.distributed is None else self.distributed.sum(tensor)

    def _gradient_sync(self, micro_batch: int) -> contextlib.AbstractContextManager:
        """DDP all-reduces gradients on the last micro-batch of a step only."""
        last = micro_batch == self.trainer.grad_accum_steps - 1
        if self.distributed is None or last:
            return contextlib.nullcontext()
        return self.distributed.no_sync()

    def _stop_agreed(self, requested: bool, is_log_step: bool) -> bool:
        """A signal may reach the ranks at different steps; they agree at a log step."""
        if self.distributed is None:
            return requested
        return is_log_step and self.distributed.any(requested)

    def _is_eval_step(self, step: int) -> bool:
        every = self.trainer.eval_every
        if every is None:
            return False
        return step == self.total_steps or (every > 0 and step % every == 0)

    def evaluate(self) -> dict:
        """Loss and accuracy over the eval split, in the training precision.

        Under DDP each rank evaluates its share on the bare module, after taking rank 0's buffers
        as DDP's own forward would: a DDP forward here would be a collective that a rank without
        eval batches never joins.
        """
        model = self.model
        if self.distributed is not None:
            model = unwrap(model)
            self.distributed.broadcast_buffers(model)
        model.eval()
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        count = 0
        with torch.inference_mode(), self.policy.autocast():
            for images, labels in itertools.islice(self.data.eval, self.trainer.eval_batches):
                images, labels = self._to_device(images, labels)
                logits = model(images)
                loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
                correct += (logits.argmax(dim=1) == labels).sum()
                count += labels.shape[0]
        model.train()
        totals = self._sum_over_ranks(
            torch.stack([loss_sum.double(), correct.double(), loss_sum.new_tensor(count).double()])
        )
        loss_total, correct_total, count_total = totals.tolist()
        if count_total == 0:
            return {"eval_loss": None, "eval_acc": None}
        return {"eval_loss": loss_total / count_total, "eval_acc": correct_total / count_total}

    def nonfinite_parameters(self) -> list[str]:
        """Names of parameters whose current gradients hold inf or NaN (reads the device)."""
        return [
            self.parameter_names.get(id(p), "?")
            for p in self.parameters
            if p.grad is not None and not torch.isfinite(p.grad).all()
        ]

    def _on_skipped_step(self, step: int, interval_loss: torch.Tensor) -> None:
        """Examine a skipped step while its gradients still exist; stop if training is stuck."""
        progress, forensics = self.progress, self.forensics
        if progress.consecutive_skips == 1:
            forensics.first_nonfinite = self.nonfinite_parameters()
        if progress.first_overflow is None:
            # Every earlier step was applied, so its loss was finite: the interval's sum is
            # finite exactly when this step's loss is.
            progress.first_overflow = {
                "step": step,
                "loss_finite": bool(torch.isfinite(self._sum_over_ranks(interval_loss))),
                "parameters": forensics.first_nonfinite[:10],
                "nonfinite_parameter_count": len(forensics.first_nonfinite),
            }
            log.warning(
                "first non-finite gradients at step %d (loss %s): %s",
                step,
                "finite" if progress.first_overflow["loss_finite"] else "non-finite",
                ", ".join(forensics.first_nonfinite[:10]) or "none found",
            )
        layer = forensics.first_nonfinite[0] if forensics.first_nonfinite else "unknown"
        scale = self.policy.scale()
        if scale is None:
            if self.trainer.on_nonfinite is NonFiniteAction.stop:
                raise NumericalFault(
                    f"non-finite gradients at step {step} in {self.policy.precision.value} "
                    f"(first in {layer}), and trainer.on_nonfinite=stop. Try a lower "
                    "optimizer.lr or precision.clip_grad_norm=1.0; the last good checkpoint "
                    "is kept"
                )
            return
        forensics.scale_history.append(f"{step}:{scale:g}")
        too_many = progress.consecutive_skips >= self.limits.max_consecutive_skips
        if too_many or scale < self.limits.min_scale:
            reason = (
                f"{progress.consecutive_skips} consecutive skipped steps"
                if too_many
                else f"loss scale {scale:g} fell below precision.min_scale"
            )
            raise NumericalFault(
                f"fp16 loss scaling collapsed at step {step}: {reason}. Scale history "
                f"(step:scale): {', '.join(forensics.scale_history)}. Gradients first went "
                f"non-finite in {layer}. Try a lower precision.init_scale, precision=bf16, or "
                "precision.clip_grad_norm=1.0; the last good checkpoint is kept"
            )

    def fit(
        self,
        emit: Emit,
        checkpoint: Callable[[Progress], None] | None = None,
        checkpoint_every: int = 0,
        stop_requested: Callable[[], bool] = lambda: False,
    ) -> TrainResult:
        """Train from ``self.progress`` to ``total_steps``.

        ``checkpoint`` (if any) is called every ``checkpoint_every`` steps (0: only at the end),
        and when ``stop_requested()`` turns true, after which the run returns early.
        """
        trainer, policy, optimizer, progress = (
            self.trainer,
            self.policy,
            self.optimizer,
            self.progress,
        )
        accum = trainer.grad_accum_steps
        first_step = progress.step + 1
        warmup_steps = min(trainer.timing_warmup_steps, max(self.total_steps - first_step, 0))
        batches = self._train_batches()
        throughput = Throughput(self.device)
        reset_peak_memory(self.device)
        interval_loss = torch.tensor(progress.interval_loss, device=self.device)
        scale = policy.scale()
        started = time.perf_counter()
        warmup_s = 0.0
        stopped_early = False
        self.model.train()
        if warmup_steps == 0:
            throughput.start(progress.samples, progress.step)
        for step in range(first_step, self.total_steps + 1):
            for micro_batch in range(accum):
                images, labels = self._to_device(*next(batches))
                with self._gradient_sync(micro_batch):
                    with policy.autocast():
                        # Dividing by accum makes k micro-batches sum to one batch k times larger.
                        loss = self.loss_fn(self.model(images), labels) / accum
                    policy.backward(loss)
                interval_loss += loss.detach()
                progress.samples += labels.shape[0] * self.world_size
            is_log_step = step % trainer.log_every == 0 or step == self.total_steps
            stepped, grad_norm = policy.step(optimizer, self.parameters, want_grad_norm=is_log_step)
            progress.step = step
            progress.interval_steps += 1
            if stepped:
                progress.consecutive_skips = 0
                if self.scheduler is not None:
                    self.scheduler.step()
            else:
                progress.skipped_steps += 1
                progress.consecutive_skips += 1
                self._on_skipped_step(step, interval_loss)
            optimizer.zero_grad(set_to_none=True)
            if step == first_step - 1 + warmup_steps:
                throughput.start(progress.samples, step)
                warmup_s = time.perf_counter() - started
            if is_log_step:
                samples_per_s, step_time_ms = throughput.lap(progress.samples, step)
                interval_total = self._sum_over_ranks(interval_loss).item()
                progress.final_loss = interval_total / (progress.interval_steps * self.world_size)
                scale = policy.scale()
                emit(
                    {
                        "step": step,
                        "epoch": progress.epoch,
                        "samples": progress.samples,
                        "loss": progress.final_loss,
                        "lr": optimizer.param_groups[0]["lr"],
                        "grad_norm": None if grad_norm is None else grad_norm.item(),
                        "scale": scale,
                        "skipped_steps": progress.skipped_steps,
                        "samples_per_s": samples_per_s,
                        "step_time_ms": step_time_ms,
                        "peak_mem_bytes": peak_memory_bytes(self.device),
                    }
                )
                interval_loss.zero_()
                progress.interval_steps = 0
            if self._is_eval_step(step):
                throughput.pause()
                metrics = self.evaluate()
                progress.eval_loss, progress.eval_acc = metrics["eval_loss"], metrics["eval_acc"]
                emit({"step": step, "samples": progress.samples, **metrics})
                throughput.resume()
            stopped_early = (
                self._stop_agreed(stop_requested(), is_log_step) and step < self.total_steps
            )
            if checkpoint is not None:
                due = step == self.total_steps or stopped_early
                # Inside a run of skipped steps a collapse may be starting: keep the last good
                # checkpoint rather than replace it with one that carries the collapsing scale.
                healthy = progress.consecutive_skips == 0
                if due or (healthy and checkpoint_every > 0 and step % checkpoint_every == 0):
                    throughput.pause()
                    # The ranks' mean, so that every rank resumes the interval from the same sum.
                    interval_mean = self._sum_over_ranks(interval_loss) / self.world_size
                    progress.interval_loss = interval_mean.item()
                    checkpoint(progress)
                    throughput.resume()
            if stopped_early:
                break
        synchronize(self.device)
        return TrainResult(
            progress=progress,
            samples_per_s=throughput.samples_per_s(),
            step_time_ms=throughput.step_time_ms(),
            timed_steps=throughput.total_steps,
            warmup_s=warmup_s,
            peak_mem_bytes=peak_memory_bytes(self.device),
            loss_scale=scale,
            stopped_early=stopped_early,
        )
