"""``AmpExpCallback`` for Lightning: one line in ``L.Trainer(callbacks=[...])`` and the run is
recorded in amp_exp's results format (docs/integrations.md).

What it reads, all from the Trainer's own state:

- **The precision** from ``trainer.precision`` (``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``,
  ``"32-true"``, ``"transformer-engine"``), as Lightning resolved it (on the CPU it turns
  ``"16-mixed"`` into bf16 itself); the audit checks what the matmuls ran in.
- **The loss scaler** ``trainer.precision_plugin.scaler`` (16-mixed on a GPU); the steps it
  skipped are those the wrapped optimizer did not take.
- **The loss** each training step returns (``outputs`` of ``on_train_batch_end``), the gradient
  norm in ``on_before_optimizer_step`` (unscaled, before clipping) at log steps only.
- **Eval metrics** from ``trainer.callback_metrics`` at the end of each validation (not the
  sanity check): ``val_loss``, ``val_acc`` map to the task's names; names that start with
  ``train`` are left out.
- **The seed** ``L.seed_everything`` set (``PL_GLOBAL_SEED``), unless given.

It writes into ``run_dir``, by default ``amp_exp/`` under the Trainer's log directory (its
root directory without a logger). A fit resumed from a checkpoint (``global_step > 0`` at its
start) continues the record; otherwise a finished record there is refused. Only global rank 0
records.
"""

from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils._pytree import tree_leaves

from amp_exp.errors import ConfigError
from amp_exp.integrations.facts import RunFacts, plain
from amp_exp.integrations.recorder import Recorder

# Lightning's precision strings, as trainer.precision resolves them, by amp_exp's names.
PRECISIONS = {
    "32-true": "fp32",
    "32": "fp32",
    "bf16-mixed": "bf16",
    "16-mixed": "fp16",
    "bf16-true": "bf16_true",
    "transformer-engine": "fp8",
}
# The Trainer's options that change what a run trains: they make a run's setting in the report.
TRAINED = ("max_steps", "max_epochs", "accumulate_grad_batches", "gradient_clip_val")


def batch_size(batch: Any) -> int:
    """The samples in a batch: the first dimension of its first tensor."""
    tensors = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
    return int(tensors[0].shape[0]) if tensors else 0


@dataclass(eq=False)  # eq=False: a callback stays hashable, compared by identity
class AmpExpCallback(L.Callback):
    """Records a ``lightning.Trainer`` fit into ``run_dir``. ``task``: classification or lm;
    ``name``: the model's name runs are paired by (default: the LightningModule's class);
    ``warmup_steps``: left out of throughput (default: ``log_every_n_steps``)."""

    run_dir: Path | str | None = None
    _: KW_ONLY
    task: Any = "classification"
    name: str | None = None
    seed: int | None = None
    warmup_steps: int | None = None
    resume: bool = False
    recorder: Recorder | None = field(default=None, init=False)
    _samples: int = field(default=0, init=False)
    _step_seen: int = field(default=0, init=False)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        resolved = str(trainer.precision)
        if resolved not in PRECISIONS:
            raise ConfigError(
                f"precision={resolved!r}: amp_exp records {', '.join(PRECISIONS)}; this one has "
                "no amp_exp precision to be judged as"
            )
        seed = self.seed if self.seed is not None else os.environ.get("PL_GLOBAL_SEED")
        facts = RunFacts(
            precision=PRECISIONS[resolved],
            how=f"lightning Trainer(precision={resolved!r})",
            seed=None if seed is None else int(seed),
            task=self.task,
            model_name=self.name or type(pl_module).__name__,
            trainer="lightning",
            flags={"precision": resolved},
            config={
                **{key: getattr(trainer, key, None) for key in TRAINED},
                "hparams": plain(dict(pl_module.hparams)),
            },
            log_every=trainer.log_every_n_steps,
            warmup_steps=self.warmup_steps,
            grad_accum_steps=trainer.accumulate_grad_batches,
            total_steps=trainer.max_steps if trainer.max_steps > 0 else None,
            resume=self.resume or trainer.global_step > 0,
        )
        run_dir = self.run_dir or Path(trainer.log_dir or trainer.default_root_dir) / "amp_exp"
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        optimizer = trainer.optimizers[0]
        self.recorder = Recorder(run_dir, pl_module, optimizer, facts, scaler).open()
        self.recorder.progress.step = self._step_seen = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.recorder is not None and batch_idx % trainer.accumulate_grad_batches == 0:
            self.recorder.begin_step()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.recorder is not None:
            self.recorder.note_grad_norm()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.recorder is None or self.recorder.error is not None:
            return
        self._samples += batch_size(batch)
        if trainer.global_step == self._step_seen:
            return  # a micro-batch of gradient accumulation: its step is not done yet
        self._step_seen = trainer.global_step
        samples, self._samples = self._samples, 0
        # The loss a training step returned: a tensor, or the "loss" of a dict.
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self.recorder.end_trainer_step(loss, samples, trainer.current_epoch):
            trainer.should_stop = True

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.recorder is None or trainer.sanity_checking:
            return
        metrics = {
            key: value
            for key, value in trainer.callback_metrics.items()
            if not key.startswith("train")
        }
        self.recorder.eval(metrics)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close(None)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close(exception)

    def _close(self, error: BaseException | None) -> None:
        if self.recorder is None:
            return
        recorder, self.recorder = self.recorder, None
        recorder.close_logged(error)
