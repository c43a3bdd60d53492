"""The one audited step of a recorded run: the engine's audit (training/audit/), entered before a
step's forward and left after its optimizer step, across the trainer's own calls.

Its ``MatmulRecorder`` is a ``TorchDispatchMode``: entering it in one callback and leaving it in
the next is what lets a trainer's step run unchanged inside it. An evaluation that runs inside
the window would count too, so the recorder audits a warm-up step, not one after an evaluation.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from amp_exp.config.precisions import get
from amp_exp.training.audit.matmuls import MatmulRecorder
from amp_exp.training.audit.saved import SavedActivations
from amp_exp.training.audit.step import audit_record, step_figures, verdict_of
from amp_exp.training.audit.verdict import warning_text

log = logging.getLogger("amp_exp")


class AuditedStep:
    """``begin()`` before the step's forward, ``end(step)`` after its optimizer step: the audit
    record (summary.json's ``precision_audit``), judged against ``precision``'s expectations."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: str) -> None:
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self._recorder = MatmulRecorder(model, model)
        self._saved = SavedActivations(stopped=lambda: self._recorder.backward_started)

    def begin(self) -> AuditedStep:
        self._recorder.__enter__()
        self._saved.__enter__()
        return self

    def end(self, step: int) -> dict[str, Any]:
        self._saved.__exit__(None, None, None)
        self._recorder.__exit__(None, None, None)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        parameters = list(self.model.parameters())
        figures = step_figures(
            self._recorder, self._saved, parameters, grads, self.optimizer, self.model
        )
        record = audit_record(step, get(self.precision).spec, figures)
        if record["engaged"] is False:
            log.warning("%s", warning_text(self.precision, verdict_of(record)))
        return record
