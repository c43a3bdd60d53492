"""The training loop: one code path for every precision and device.

The engine works on already-built objects and hands metric dicts to ``emit``; it does no I/O.
Nothing in the per-step path reads a device value back to the host: loss, scale and gradient
norm stay on the device and are read only at log intervals.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from amp_exp.config import TrainerConfig
from amp_exp.data import DataBundle
from amp_exp.meters import Throughput, peak_memory_bytes, reset_peak_memory, synchronize
from amp_exp.precision import PrecisionPolicy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Emit = Callable[[dict], None]


@dataclass
class TrainResult:
    steps: int
    samples_seen: int
    skipped_steps: int
    final_loss: float | None
    eval_loss: float | None
    eval_acc: float | None
    samples_per_s: float | None
    step_time_ms: float | None
    timed_steps: int
    warmup_s: float
    peak_mem_bytes: int
    loss_scale: float | None


def plan_total_steps(trainer: TrainerConfig, batches_per_epoch: int) -> int:
    """Optimizer steps to run: the first of max_steps and epochs to be reached."""
    limits = []
    if trainer.max_steps is not None:
        limits.append(trainer.max_steps)
    if trainer.epochs is not None:
        steps_per_epoch = batches_per_epoch // trainer.grad_accum_steps
        if steps_per_epoch == 0:
            raise ValueError(
                f"an epoch has {batches_per_epoch} batches, fewer than "
                f"trainer.grad_accum_steps={trainer.grad_accum_steps}"
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
        device: torch.device,
        total_steps: int,
        channels_last: bool = False,
        loss_fn: LossFn | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.policy, self.data, self.trainer, self.device = policy, data, trainer, device
        self.loss_fn = loss_fn or F.cross_entropy
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.total_steps = total_steps
        policy.watch(optimizer)

    def _to_device(self, images: torch.Tensor, labels: torch.Tensor):
        images = images.to(self.device, non_blocking=True, memory_format=self.memory_format)
        return images, labels.to(self.device, non_blocking=True)

    def _train_batches(self) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
        for epoch in itertools.count():
            self.data.train.set_epoch(epoch)
            for batch in self.data.train:
                yield epoch, batch

    def _is_eval_step(self, step: int) -> bool:
        every = self.trainer.eval_every
        if every is None:
            return False
        return step == self.total_steps or (every > 0 and step % every == 0)

    def evaluate(self) -> dict:
        """Loss and accuracy over the eval split, in the training precision."""
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        count = 0
        with torch.inference_mode(), self.policy.autocast():
            for images, labels in itertools.islice(self.data.eval, self.trainer.eval_batches):
                images, labels = self._to_device(images, labels)
                logits = self.model(images)
                loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
                correct += (logits.argmax(dim=1) == labels).sum()
                count += labels.shape[0]
        self.model.train()
        if count == 0:
            return {"eval_loss": None, "eval_acc": None}
        return {"eval_loss": loss_sum.item() / count, "eval_acc": correct.item() / count}

    def fit(self, emit: Emit) -> TrainResult:
        trainer, policy, optimizer = self.trainer, self.policy, self.optimizer
        accum = trainer.grad_accum_steps
        warmup_steps = min(trainer.timing_warmup_steps, max(self.total_steps - 1, 0))
        batches = self._train_batches()
        throughput = Throughput(self.device)
        reset_peak_memory(self.device)
        interval_loss = torch.zeros((), device=self.device)
        interval_steps = 0
        samples = skipped = 0
        final_loss = scale = None
        eval_metrics: dict = {"eval_loss": None, "eval_acc": None}
        started = time.perf_counter()
        warmup_s = 0.0
        self.model.train()
        if warmup_steps == 0:
            throughput.start(samples, 0)
        for step in range(1, self.total_steps + 1):
            for _ in range(accum):
                epoch, (images, labels) = next(batches)
                images, labels = self._to_device(images, labels)
                with policy.autocast():
                    # Dividing by accum makes k micro-batches sum to one batch k times larger.
                    loss = self.loss_fn(self.model(images), labels) / accum
                policy.backward(loss)
                interval_loss += loss.detach()
                samples += labels.shape[0]
            is_log_step = step % trainer.log_every == 0 or step == self.total_steps
            stepped, grad_norm = policy.step(optimizer, self.parameters, want_grad_norm=is_log_step)
            optimizer.zero_grad(set_to_none=True)
            if stepped:
                if self.scheduler is not None:
                    self.scheduler.step()
            else:
                skipped += 1
            interval_steps += 1
            if step == warmup_steps:
                throughput.start(samples, step)
                warmup_s = time.perf_counter() - started
            if is_log_step:
                samples_per_s, step_time_ms = throughput.lap(samples, step)
                final_loss = interval_loss.item() / interval_steps
                scale = policy.scale()
                emit(
                    {
                        "step": step,
                        "epoch": epoch,
                        "samples": samples,
                        "loss": final_loss,
                        "lr": optimizer.param_groups[0]["lr"],
                        "grad_norm": None if grad_norm is None else grad_norm.item(),
                        "scale": scale,
                        "skipped_steps": skipped,
                        "samples_per_s": samples_per_s,
                        "step_time_ms": step_time_ms,
                        "peak_mem_bytes": peak_memory_bytes(self.device),
                    }
                )
                interval_loss.zero_()
                interval_steps = 0
            if self._is_eval_step(step):
                throughput.pause()
                eval_metrics = self.evaluate()
                emit({"step": step, "samples": samples, **eval_metrics})
                throughput.resume()
        synchronize(self.device)
        return TrainResult(
            steps=self.total_steps,
            samples_seen=samples,
            skipped_steps=skipped,
            final_loss=final_loss,
            eval_loss=eval_metrics["eval_loss"],
            eval_acc=eval_metrics["eval_acc"],
            samples_per_s=throughput.samples_per_s(),
            step_time_ms=throughput.step_time_ms(),
            timed_steps=throughput.total_steps,
            warmup_s=warmup_s,
            peak_mem_bytes=peak_memory_bytes(self.device),
            loss_scale=scale,
        )
