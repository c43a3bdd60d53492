"""The loop's plain records: when things happen (``LoopPlan``), where training stands
(``Progress``), and what a finished ``fit`` hands back (``TrainResult``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from amp_exp.config.schema import TrainerConfig
from amp_exp.errors import ConfigError

# Under torchrun the ranks agree whether to stop (a preemption signal may reach only some of
# them) at every log step and at least every this many steps, so a preempted job trains at most
# this many steps more, whatever trainer.log_every is. Each check is one all-reduce of a flag and
# one host read: a sync every ten steps, not every step.
STOP_CHECK_STEPS = 10


@dataclass(frozen=True)
class LoopPlan:
    """How long to train and at which steps to log, evaluate and time."""

    total_steps: int
    grad_accum_steps: int = 1
    log_every: int = 25
    # 0 = evaluate only at the end; None = never.
    eval_every: int | None = 0
    # None = the whole eval split.
    eval_batches: int | None = None
    # Optimizer steps left out of throughput: allocator warm-up, autotuning, compilation.
    timing_warmup_steps: int = 5

    @classmethod
    def from_config(cls, trainer: TrainerConfig, total_steps: int) -> LoopPlan:
        # Every other field is the trainer's key of the same name.
        knobs = {f.name: getattr(trainer, f.name) for f in fields(cls) if f.name != "total_steps"}
        return cls(total_steps, **knobs)

    def is_log_step(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

    def is_stop_check_step(self, step: int) -> bool:
        return step % STOP_CHECK_STEPS == 0 or self.is_log_step(step)

    def is_eval_step(self, step: int) -> bool:
        if self.eval_every is None:
            return False
        return step == self.total_steps or (self.eval_every > 0 and step % self.eval_every == 0)


def plan_total_steps(trainer: TrainerConfig, batches_per_epoch: int) -> int:
    """Optimizer steps to run: the first of max_steps and epochs to be reached."""
    steps_per_epoch = batches_per_epoch // trainer.grad_accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"an epoch has {batches_per_epoch} batches, fewer than "
            f"trainer.grad_accum_steps={trainer.grad_accum_steps}; lower it or the batch size"
        )
    # values.py refuses a zero or negative one, cross_checks.py two nulls.
    epoch_steps = None if trainer.epochs is None else trainer.epochs * steps_per_epoch
    return min(limit for limit in (trainer.max_steps, epoch_steps) if limit is not None)


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
    # The partly filled log interval, so a resumed run logs the same rows (the loss: this rank's
    # sum; a checkpoint keeps every rank's, Engine.state_dict).
    interval_steps: int = 0
    interval_loss: float = 0.0
    final_loss: float | None = None
    # The latest evaluation, as the task names its metrics (eval_loss, eval_acc, ...).
    eval: dict[str, float | None] = field(default_factory=dict)
    # The step it was made at.
    eval_step: int | None = None
    # The first skipped step: when, which parameters had non-finite gradients, and whether the
    # loss itself was finite (if it was, the overflow happened in the backward pass).
    first_overflow: dict | None = None


@dataclass
class TrainResult:
    progress: Progress
    # Over the timed steps of the latest attempts in the run's current precision.
    samples_per_s: float | None
    step_time_ms: float | None
    timed_steps: int
    warmup_s: float
    peak_mem_bytes: int
    loss_scale: float | None
    # Set when a stop request (a preemption signal) ended the run before total_steps.
    stopped_early: bool = False
    # Each attempt of the run (a resume starts one): precision, steps and speed
    # (meters.Throughput.attempts).
    attempts: list[dict] = field(default_factory=list)
