"""``amp_exp.record``: a plain training loop (or an Accelerate one) recorded in amp_exp's results
format, with two lines added to it and nothing else changed:

    with amp_exp.record("runs/bf16_s0", model=model, optimizer=opt, precision="bf16", seed=0,
                        task="classification", scaler=scaler) as run:
        for batch in loader:
            ...                                   # the loop's own forward, backward and step
            run.step(loss, batch_size=len(batch))
        run.eval(val_loss=loss, val_acc=acc)      # after each evaluation

``step`` is called once per optimizer step, after it (taken or skipped by the scaler). The loss
stays on the device until a log step. A ``NumericalFault`` (the loss scale collapsed, the loss
went non-finite) stops the loop as it stops amp_exp's own runs; the summary records it either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from amp_exp.integrations.facts import RunFacts
from amp_exp.integrations.recorder import Recorder


class RecordHandle:
    """What ``record`` yields: ``step`` after each optimizer step, ``eval`` after each
    evaluation."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def step(self, loss: Any, *, batch_size: int, grad_norm: Any = None) -> None:
        """One optimizer step done: its ``loss`` (a tensor is never read here), the samples it
        trained on, and the gradient norm ``clip_grad_norm_`` returned, if the loop clips."""
        self.recorder.end_step(loss, batch_size, grad_norm)
        self.recorder.begin_step()

    def eval(self, **metrics: Any) -> dict[str, float]:
        """An evaluation's metrics (``val_loss=...``, ``eval_accuracy=...``): returned under the
        task's names. The time since the last log step, the evaluation's, is left out of
        throughput."""
        return self.recorder.eval(metrics)


@contextlib.contextmanager
def record(
    run_dir: Path | str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: str,
    seed: int | None,
    task: Any,
    scaler: Any = None,
    name: str | None = None,
    log_every: int = 10,
    warmup_steps: int | None = None,
    resume: bool = False,
    config: dict[str, Any] | None = None,
) -> Iterator[RecordHandle]:
    """Record the loop run inside into ``run_dir`` (metrics.jsonl, summary.json).

    ``precision`` is amp_exp's name for what the loop does (fp32, bf16 for bf16 autocast, fp16
    for fp16 autocast with a GradScaler, bf16_true for bf16 weights); the audit checks it against
    what the matmuls ran in. ``task``: ``classification`` (judged on accuracy), ``lm`` (eval
    loss), or a ``tasks.metrics.TaskMetrics``. ``scaler``: the loop's ``torch.amp.GradScaler``
    (or Accelerate's ``accelerator.scaler``), for the loss scale and skipped steps. ``name``: the
    model's name (runs are paired by it and the seed; default its class name). ``config``: what
    else sets this run apart (a learning rate you sweep), as plain values. ``resume``: continue a
    record in ``run_dir`` (a finished one is refused otherwise).
    """
    facts = RunFacts(
        precision=precision,
        how=f"amp_exp.record(precision={precision!r})",
        seed=seed,
        task=task,
        model_name=name or type(model).__name__,
        trainer="amp_exp.record",
        config=dict(config or {}),
        log_every=log_every,
        warmup_steps=warmup_steps,
        resume=resume,
    )
    recorder = Recorder(run_dir, model, optimizer, facts, scaler).open()
    recorder.begin_step()
    try:
        yield RecordHandle(recorder)
    except BaseException as error:
        recorder.close(error)
        raise
    recorder.close()
