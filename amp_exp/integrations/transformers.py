"""``AmpExpCallback`` for the Hugging Face Trainer: one line in ``Trainer(callbacks=[...])`` and
the run is recorded in amp_exp's results format (docs/integrations.md).

What it reads, all from the Trainer's own state:

- **The precision** from ``TrainingArguments`` (``bf16``, ``fp16``) and the weights' dtype (a
  model loaded in bfloat16 trains in ``bf16_true``); the audit checks what the matmuls ran in.
- **The loss scaler** of the Trainer's accelerator: the Trainer hands every callback its
  ``AcceleratedOptimizer``, which holds ``accelerator.scaler`` as ``scaler``; the callback keeps
  that reference from ``on_train_begin`` on. Its skipped steps are those the wrapped optimizer
  did not take (``accelerator.optimizer_step_was_skipped``, counted without a device read).
- **The loss** of each micro-batch from the model's output (``outputs.loss``, as the Trainer's own
  ``compute_loss`` takes it), through a forward hook; a custom ``compute_loss_func`` that computes
  it outside the model leaves the loss unrecorded (the rest still is).
- **Eval metrics** from ``on_evaluate``: ``eval_loss``, ``eval_accuracy`` (what compute_metrics
  returns, prefixed by the Trainer) map to the task's names (``integrations.metric_names``).

It writes into ``run_dir``, by default ``args.output_dir/amp_exp``. A Trainer resuming from its
checkpoint (``state.global_step > 0`` at the start) continues the record; otherwise a finished
record there is refused, as amp_exp's own runs refuse theirs. Only the main process records.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from amp_exp.integrations.facts import RunFacts, plain
from amp_exp.integrations.recorder import Recorder

# The TrainingArguments that change what a run trains: they make a run's setting in the report.
# Paths, names, logging and the precision flags (recorded apart) do not.
TRAINED_ARGS = (
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "num_train_epochs",
    "max_steps",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "optim",
    "label_smoothing_factor",
    "gradient_checkpointing",
    "torch_compile",
)
PRECISION_ARGS = ("bf16", "fp16", "bf16_full_eval", "fp16_full_eval", "tf32")
# Model classes whose name says they predict tokens: judged on the eval loss.
LANGUAGE_MODEL_WORDS = ("CausalLM", "LMHead", "MaskedLM", "Seq2SeqLM")


def precision_of(args: Any, weights_dtype: Any) -> str:
    """amp_exp's name for what the Trainer was set to run."""
    if str(weights_dtype) == "torch.bfloat16":
        return "bf16_true"
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def task_of(model: Any) -> str:
    """lm for a model that predicts tokens (judged on the eval loss), else classification."""
    language_model = any(word in type(model).__name__ for word in LANGUAGE_MODEL_WORDS)
    return "lm" if language_model else "classification"


def model_name(model: Any) -> str:
    config = getattr(model, "config", None)
    return (
        getattr(config, "name_or_path", None)
        or getattr(config, "model_type", None)
        or type(model).__name__
    )


@dataclass(eq=False)  # eq=False: a callback stays hashable, compared by identity
class AmpExpCallback(TrainerCallback):
    """Records a ``transformers.Trainer`` run into ``run_dir`` (default
    ``args.output_dir/amp_exp``). ``task``: classification or lm (default: from the model's
    class); ``name``: the model's name runs are paired by (default: its config's
    ``name_or_path``); ``warmup_steps``: left out of throughput (default: ``logging_steps``)."""

    run_dir: Path | str | None = None
    _: KW_ONLY
    task: Any = None
    name: str | None = None
    warmup_steps: int | None = None
    resume: bool = False
    recorder: Recorder | None = field(default=None, init=False)
    # The record once training ended: an evaluation after train() reopens it.
    closed: Recorder | None = field(default=None, init=False)
    _losses: list[Any] = field(default_factory=list, init=False)
    _hook: Any = field(default=None, init=False)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if not state.is_world_process_zero:
            return
        weights = next(model.parameters()).dtype
        flags = {key: getattr(args, key) for key in PRECISION_ARGS if hasattr(args, key)}
        shown = ", ".join(f"{key}={value}" for key, value in flags.items() if value)
        log_every = int(args.logging_steps) if args.logging_steps >= 1 else 10
        facts = RunFacts(
            precision=precision_of(args, weights),
            how=f"transformers TrainingArguments({shown})",
            seed=args.seed,
            task=self.task or task_of(model),
            model_name=self.name or model_name(model),
            trainer="transformers",
            flags=flags,
            resolved=plain(args.to_dict()),
            config={key: getattr(args, key) for key in TRAINED_ARGS if hasattr(args, key)},
            log_every=log_every,
            warmup_steps=self.warmup_steps,
            grad_accum_steps=args.gradient_accumulation_steps,
            total_steps=state.max_steps or None,
            resume=self.resume or state.global_step > 0,
        )
        run_dir = self.run_dir or Path(args.output_dir) / "amp_exp"
        scaler = getattr(optimizer, "scaler", None)
        self.recorder = Recorder(run_dir, model, optimizer, facts, scaler).open()
        self.recorder.progress.step = state.global_step
        self._hook = model.register_forward_hook(self._take_loss)
        self.samples = (
            args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        )

    def _take_loss(self, module: Any, args: Any, output: Any) -> None:
        loss = getattr(output, "loss", None)
        if module.training and loss is not None:
            self._losses.append(loss.detach())

    def on_step_begin(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self.recorder.begin_step()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self.recorder.note_grad_norm()

    def on_step_end(self, args, state, control, **kwargs):
        if self.recorder is None or self.recorder.error is not None:
            return
        losses, self._losses = self._losses, []
        loss = sum(losses) / len(losses) if losses else None
        if self.recorder.end_trainer_step(loss, self.samples, int(state.epoch or 0)):
            control.should_training_stop = True

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.recorder is not None:
            self.recorder.eval(dict(metrics or {}))
        elif self.closed is not None:
            self.closed.reopen().eval(dict(metrics or {}))
            self.closed.close()

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is None:
            return
        self._hook.remove()
        self.closed, self.recorder = self.recorder, None
        self.closed.close_logged()
