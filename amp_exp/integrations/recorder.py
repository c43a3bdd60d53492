"""The one writer for runs trained outside amp_exp's engine: ``amp_exp.record`` and both trainer
callbacks record through ``Recorder``, into amp_exp's results format (docs/results_format.md).

It records what the engine records, from the trainer's own state:

- **The precision and how it was set:** amp_exp's name for it, the trainer's flags, and the
  autocast dtype the model's first forward actually ran under (a forward pre-hook, removed after
  it fires); the precision audit then shows what the matmuls ran in.
- **The audit:** one step (the last warm-up step) runs under the audit's ``MatmulRecorder`` and
  ``SavedActivations`` (training/audit/), judged as the engine judges its own (``audit_record``):
  "bf16 did not engage" is caught, whoever set the flags.
- **Loss scale and skipped steps** from the scaler's own state: an optimizer step post-hook
  fires only for a step the optimizer took (a GradScaler skips ``optimizer.step()`` on inf/NaN
  gradients, having read its flag on the host already), so a skip costs no device read; the scale
  itself is read at log steps. A collapse (``SkipMonitor``, the engine's rule and message) and a
  non-finite loss without a scaler are a ``NumericalFault``: the run ends failed, its summary says
  why.
- **Throughput** (training/meters.Throughput) from the end of warm-up, evaluation left out.
- **The long-run signals** (training/signals.py, what ``python -m amp_exp.forecast`` reads): the
  collector is armed before the forward of each step that will be a log step, sees the weights
  around the update through optimizer step pre- and post-hooks (every trainer calls
  ``optimizer.step()``, so one place serves them all, and a step the scaler skipped measures no
  update), and is read into a ``signals`` row after the train row, as the engine writes it.
- **No host sync per step:** the loss is summed on the device and read, with the loss scale, the
  clock and the signals, only at log steps.

The directory is claimed as amp_exp's runs claim theirs (results/ownership.py): a directory in
use is refused, and one holding a finished record takes only ``resume=True``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from amp_exp.config.precisions import get, names
from amp_exp.errors import NumericalFault, RunRefused, first_line, require_choice
from amp_exp.integrations.audited_step import AuditedStep
from amp_exp.integrations.facts import RunFacts, plain, unwrapped_optimizer
from amp_exp.integrations.interval import Interval
from amp_exp.integrations.metric_names import looked_for, task_metrics, task_names
from amp_exp.results.files import METRICS_FILE, SUMMARY_FILE, write_json
from amp_exp.results.loggers import EVAL, TRAIN, JsonlLogger, read_rows
from amp_exp.results.ownership import hold_directory, holdings
from amp_exp.results.summary import Status, make_summary
from amp_exp.runtime.hardware import device_name
from amp_exp.training.audit.matmuls import dtype_name
from amp_exp.training.loop import Progress
from amp_exp.training.meters import Throughput, peak_memory_bytes, state_bytes
from amp_exp.training.signals import Limits, SignalCollector, distributed
from amp_exp.training.skips import SkipMonitor

log = logging.getLogger("amp_exp")


class Recorder:
    """Records one run into ``run_dir``: ``open``, then ``begin_step``/``end_step`` around each
    optimizer step, ``eval`` after each evaluation, and ``close`` (which writes summary.json)."""

    def __init__(
        self,
        run_dir: Path | str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        facts: RunFacts,
        scaler: Any = None,
    ) -> None:
        require_choice(facts.precision, names(), f"precision={facts.precision!r} is not an option")
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.model, self.facts, self.scaler = model, facts, scaler
        self.optimizer = unwrapped_optimizer(optimizer)
        self.task, self.declared = task_metrics(facts.task)
        self.device = next(model.parameters()).device
        self.warmup_steps = max(
            1, facts.log_every if facts.warmup_steps is None else facts.warmup_steps
        )
        self.progress = Progress()
        self.throughput = Throughput(self.device, facts.precision)
        self.monitor = SkipMonitor()  # the engine's limits, as its defaults set them
        self.audit: dict[str, Any] | None = None
        self.autocast: dict[str, Any] | None = None
        self.unmapped: set[str] = set()
        # What ended the run, once it ended with a fault: a reopened record keeps it.
        self.error: BaseException | None = None
        self._held = contextlib.ExitStack()
        self._hooks: list[Any] = []
        self._auditing: AuditedStep | None = None
        self._applied = self._applied_before = 0
        self._interval = Interval()
        self._first_batch: int | None = None
        self._grad_norm: Any = None
        self._started = self._timing_from = time.perf_counter()
        self._logger: JsonlLogger | None = None
        self.signals = self._collector(model)
        # The step the signals are armed for: a log step the run may end before.
        self._signals_step: int | None = None

    def _collector(self, model: nn.Module) -> SignalCollector | None:
        """The signals' collector; none under several ranks, as only rank zero records and
        the collector's reduction across ranks would wait on the others. A compiled model is
        measured through the module it wraps, its updates alone: a hook on its modules would
        break its graph at every log step (as the engine's compiled runs)."""
        if distributed():
            return None
        inner = getattr(model, "_orig_mod", model)
        collector = SignalCollector(Limits.of(get(self.facts.precision).spec))
        return collector.attach(inner, activations=inner is model)

    # The run's life.

    def open(self) -> Recorder:
        """Claim the directory, open metrics.jsonl, and hook the model and the optimizer."""
        directory = self.run_dir

        def check() -> None:
            held = holdings(directory)
            if held and not self.facts.resume:
                raise RunRefused(
                    f"{directory} holds {held}; a new record there would overwrite it: pass "
                    "resume=True to continue it, or give this run its own directory"
                )

        hold_directory(directory, check, self._held)
        metrics = directory / METRICS_FILE
        if self.facts.resume:
            rows, _ = read_rows(metrics)
            self.progress.step = max((row["step"] for row in rows), default=0)
        self._logger = JsonlLogger(metrics, append=self.facts.resume)
        self._hooks = [
            self.optimizer.register_step_post_hook(self._applied_one),
            *self._autocast_hooks(),
        ]
        if (signals := self.signals) is not None:
            self._hooks += [
                self.optimizer.register_step_pre_hook(lambda *_: signals.before_update()),
                self.optimizer.register_step_post_hook(lambda *_: signals.after_update()),
            ]
        return self

    def reopen(self) -> Recorder:
        """A closed record open again, for an evaluation after training (``trainer.evaluate()``
        once ``train()`` returned); ``close`` then rewrites the summary with it."""
        hold_directory(self.run_dir, lambda: None, self._held)
        self._logger = JsonlLogger(self.run_dir / METRICS_FILE, append=True)
        return self

    def close(self, error: BaseException | None = None) -> dict[str, Any]:
        """Write summary.json (failed, with ``error``'s line, if it ended with one) and let the
        directory go; returns the summary. A fault the last log step finds is raised after."""
        found, error = None, error or self.error
        try:
            self._end_audit()
            if error is None and self._interval.steps:
                self._log_train_row()
        except NumericalFault as fault:
            error = found = fault
        finally:
            for hook in self._hooks:
                hook.remove()
            if self.signals is not None:
                self.signals.disarm()
        self.error = error
        try:
            summary = self._summary(error)
            write_json(self.run_dir / SUMMARY_FILE, summary)
        finally:
            if self._logger is not None:
                self._logger.close()
            self._held.close()
        if found is not None:
            raise found
        return summary

    # Each step.

    def begin_step(self) -> None:
        """Before the forward of the next optimizer step: the audit starts at its step."""
        if self.audit is None and self._auditing is None and self._next_step == self._warm_until:
            self._auditing = AuditedStep(self.model, self.optimizer, self.facts.precision).begin()
        # A trainer may call this twice for one step; the signals are armed once.
        step = self._next_step
        if self.signals is not None and step != self._signals_step and self._is_log_step(step):
            self.signals.arm()
            self._signals_step = step

    def end_step(
        self, loss: Any, samples: int, grad_norm: Any = None, epoch: int | None = None
    ) -> None:
        """After an optimizer step (taken or skipped): ``loss`` (a tensor stays on the device;
        None if the trainer hands none over), the samples it trained on, the gradient norm where
        known. Raises ``NumericalFault`` when the loss scale collapsed or the loss went
        non-finite (read at log steps only)."""
        progress = self.progress
        warm_until = self._warm_until  # fixed before this attempt's first step counts
        progress.step += 1
        progress.samples += samples
        if epoch is not None:
            progress.epoch = epoch
        if self._first_batch is None:
            self._first_batch = samples
        skipped = self._applied == self._applied_before
        self._applied_before = self._applied
        scaling = self._scaling()
        self._interval.add(progress, loss, skipped and scaling, self.scaler if scaling else None)
        if grad_norm is not None:
            self._grad_norm = grad_norm
        if progress.step == warm_until:
            self._end_audit()
            self._timing_from = time.perf_counter()
            self.throughput.start(progress.samples, progress.step)
        if self._is_log_step(progress.step):
            self._log_train_row()

    def end_trainer_step(self, loss: Any, samples: int, epoch: int) -> bool:
        """``end_step`` for a trainer's callback, which must not raise into the trainer: a
        ``NumericalFault`` is kept (the summary says it) and logged; True: stop training."""
        try:
            self.end_step(loss, samples, epoch=epoch)
        except NumericalFault as fault:
            self.error = fault
            log.error("amp_exp: %s; stopping training", first_line(str(fault)))
            return True
        return False

    def close_logged(self, error: BaseException | None = None) -> None:
        """``close`` for a trainer's callback: a fault the last log step finds is logged."""
        try:
            self.close(error)
        except NumericalFault as fault:
            log.error("amp_exp: %s", first_line(str(fault)))

    def note_grad_norm(self) -> None:
        """Before the optimizer steps, the gradients' total norm, computed (on the device, never
        read here) only when the step is a log step: a trainer's callbacks call this."""
        if self._is_log_step(self._next_step):
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self._grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None

    def eval(self, metrics: dict[str, Any]) -> dict[str, float]:
        """An evaluation's metrics, under the task's names; its time is left out of the clock."""
        mapped, other = task_names(metrics, self.declared)
        self.unmapped.update(other)
        progress = self.progress
        progress.eval.update(mapped)
        progress.eval_step = progress.step
        assert self._logger is not None
        self._logger.log(
            {"kind": EVAL, "step": progress.step, "samples": progress.samples, **mapped}
        )
        if self.throughput.started:  # the evaluation's time is left out of throughput
            self.throughput.start(progress.samples, progress.step)
        return mapped

    @functools.cached_property
    def _warm_until(self) -> int:
        """The last warm-up step (the audited one): ``warmup_steps`` into this attempt, which a
        resumed run starts past its earlier steps."""
        return self.progress.step + self.warmup_steps

    @property
    def _next_step(self) -> int:
        return self.progress.step + 1

    def _is_log_step(self, step: int) -> bool:
        return step % self.facts.log_every == 0 or step == self.facts.total_steps

    def _applied_one(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._applied += 1

    def _scaling(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def _autocast_hooks(self) -> list[Any]:
        """Forward pre-hooks on the model's children (the model itself if it has none): a
        trainer may wrap the model's own forward in autocast (Accelerate does), so the model's
        pre-hook runs outside it, and its children's inside."""
        children = list(self.model.children()) or [self.model]
        return [child.register_forward_pre_hook(self._see_autocast) for child in children]

    def _see_autocast(self, module: nn.Module, args: Any) -> None:
        """The autocast the first training forward runs under: what the trainer really set."""
        if not module.training or self.autocast is not None:
            return
        kind = self.device.type
        on = torch.is_autocast_enabled(kind)
        self.autocast = {
            "enabled": on,
            "dtype": dtype_name(torch.get_autocast_dtype(kind)) if on else None,
            "weights": dtype_name(next(self.model.parameters()).dtype),
        }

    def _end_audit(self) -> None:
        if self._auditing is not None:
            self.audit = self._auditing.end(self.progress.step)
            self._auditing = None

    def _log_train_row(self) -> None:
        """The log step: the one place the device is read (the loss, the scale, the clock)."""
        progress, interval = self.progress, self._interval
        loss = float(interval.loss_sum) / interval.losses if interval.losses else None
        progress.final_loss = loss
        scale, scale_mean = interval.scale.read(self.scaler) if self._scaling() else (None, None)
        samples_per_s, step_time_ms = self.throughput.lap(progress.samples, progress.step)
        grad_norm = None if self._grad_norm is None else float(self._grad_norm)
        assert self._logger is not None
        self._logger.log(
            {
                "kind": TRAIN,
                "step": progress.step,
                "epoch": progress.epoch,
                "samples": progress.samples,
                "loss": loss,
                "lr": self.optimizer.param_groups[0]["lr"],
                "grad_norm": grad_norm,
                "scale": scale,
                "scale_mean": scale_mean,
                "skipped_steps": progress.skipped_steps,
                "samples_per_s": samples_per_s,
                "step_time_ms": step_time_ms,
                "peak_mem_bytes": peak_memory_bytes(self.device),
            }
        )
        self._log_signals()
        self._interval = Interval(carried_run=progress.consecutive_skips)
        if interval.skipped:
            self.monitor.on_skipped_steps(
                progress, self.facts.precision, scale, interval.skipped_steps(progress)
            )
        elif scale is None and loss is not None and not math.isfinite(loss):
            raise NumericalFault(
                f"the loss went non-finite by step {progress.step} in {self.facts.precision}: "
                "the run diverged. Try a lower learning rate or gradient clipping"
            )

    def _log_signals(self) -> None:
        """The signals row of a step they were armed for, after its train row (the engine's
        order); a step the run ended before leaves them disarmed, unread."""
        if self.signals is None or not self.signals.armed:
            return
        if self._signals_step != self.progress.step:
            self.signals.disarm()
            return
        assert self._logger is not None
        self._logger.log({"kind": "signals", "step": self.progress.step, **self.signals.collect()})

    def _summary(self, error: BaseException | None) -> dict[str, Any]:
        facts, progress = self.facts, self.progress
        if error is not None:
            status = Status.failed
        else:
            status = Status.completed
            missing = self.declared.quality not in progress.eval
            if missing:
                log.warning(
                    "%s: no %s was recorded (looked for %s; got %s): the report cannot judge this "
                    "run's quality",
                    self.run_dir,
                    self.declared.quality,
                    looked_for(self.declared.quality),
                    ", ".join(sorted(self.unmapped)) or "no evaluation",
                )
        config = {
            "seed": facts.seed,
            "task": self.task,
            "model": {"name": facts.model_name},
            "optimizer": {"name": type(self.optimizer).__name__, **plain(self.optimizer.defaults)},
            "precision": {"name": facts.precision},
            "trainer": {"name": facts.trainer, **facts.config},
        }
        parameters = list(self.model.parameters())
        return make_summary(
            status,
            config,
            task_metrics=self.declared.as_dict(),
            eval_metrics=dict(progress.eval),
            error=None if error is None else f"{type(error).__name__}: {first_line(str(error))}",
            precision_reason=self._how(),
            device=self.device.type,
            device_name=device_name(self.device),
            batch_size=self._first_batch,
            grad_accum_steps=facts.grad_accum_steps,
            world_size=1,
            strategy="single",
            global_batch_size=self._first_batch,
            parameters=sum(p.numel() for p in parameters),
            steps=progress.step,
            total_steps=facts.total_steps,
            samples_seen=progress.samples,
            timed_steps=self.throughput.timed_steps(),
            warmup_s=self._timing_from - self._started,
            samples_per_s=self.throughput.samples_per_s(),
            step_time_ms=self.throughput.step_time_ms(),
            attempts=self.throughput.attempts(progress.step),
            peak_mem_bytes=peak_memory_bytes(self.device),
            peak_mem_kind="cuda_max_allocated" if self.device.type == "cuda" else "cpu_peak_rss",
            final_loss=progress.final_loss,
            loss_scale=float(self.scaler.get_scale()) if self._scaling() else None,
            skipped_steps=progress.skipped_steps,
            first_overflow=progress.first_overflow,
            state_bytes=state_bytes(parameters, self.optimizer),
            precision_audit=self.audit,
            precision_details={
                "trainer": facts.trainer,
                "flags": facts.flags,
                "autocast": self.autocast,
                "trainer_config": facts.resolved,
                "log_every": facts.log_every,
                "warmup_steps": self.warmup_steps,
            },
            wall_s=time.perf_counter() - self._started,
        )

    def _how(self) -> str:
        seen = self.autocast
        if seen is None:
            return f"{self.facts.how}; no training forward was seen"
        ran = f"autocast {seen['dtype']}" if seen["enabled"] else "no autocast"
        return f"{self.facts.how}; {ran}, {seen['weights']} weights in the first forward"
