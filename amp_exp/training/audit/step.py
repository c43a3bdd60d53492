"""The audited step: one real training step, recorded, off the throughput clock.

``PrecisionAudit.instrument`` is the engine's step instrument (``Engine.step_instrument``): at the
audited step it returns a context that records the step's matmuls (``matmuls``) and the bytes
its forward saves for backward (``saved``), catches its gradients before the optimizer steps,
and afterwards reads the state and communication dtypes (``dtypes``) and judges whether the
precision engaged (``verdict``). At every other step it returns a context that does nothing: no
dispatch mode, no hook. The audited step trains like any other; only its time, samples and step
are left out of throughput.

The step audited is ``diagnostics.audit_step``, or by default the first timed step (the first
after ``trainer.timing_warmup_steps``): kernels are chosen and caches warm by then. A resumed
run that started past it audits its own first timed step. A compiled run's audited step runs
eagerly (``torch.compiler.set_stance("force_eager")``: compiled kernels hide their ops), by
default its first step, before anything is compiled; the record says so. Under torchrun every
rank audits its step; the FLOPs are summed over the ranks, the saved bytes are the largest
rank's (what one device holds), the state and dtypes rank 0's (its shards under FSDP2), and
rank 0 warns and records.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from amp_exp.config.precisions import PrecisionSpec
from amp_exp.runtime.distributed import unwrap
from amp_exp.training.audit import dtypes
from amp_exp.training.audit.matmuls import PHASES, RECOMPUTE, MatmulFlops, MatmulRecorder
from amp_exp.training.audit.saved import SavedActivations
from amp_exp.training.audit.verdict import (
    Verdict,
    higher_precision_modules,
    judge,
    kept_fp32_share,
    share_by_dtype,
    warning_text,
)
from amp_exp.training.engine import Engine
from amp_exp.training.meters import optimizer_tensors

log = logging.getLogger("amp_exp")

TF32_NOTE = (
    "float32 matmuls and convolutions ran as TF32 on this GPU (trainer.tf32=true): fp32 range, "
    "10-bit mantissa; the dtype alone cannot show it"
)


class PrecisionAudit:
    """Audits one step of ``engine``; ``summary()`` is what summary.json records of it."""

    def __init__(self, engine: Engine, audit_step: int | None, eager: bool = False) -> None:
        """``eager``: the run is compiled, so its audited step runs eagerly (compiled kernels
        hide their ops), by default the first step of the attempt, before compilation."""
        self.engine = engine
        self.audit_step = audit_step
        self.eager = eager
        self.result: dict[str, Any] | None = None
        self._first_step: int | None = None
        engine.step_instrument = self.instrument

    def instrument(self, step: int, first_timed_step: int) -> contextlib.AbstractContextManager:
        """The audit's context at its step, a context that does nothing at every other."""
        if self._first_step is None:
            self._first_step = step  # where this attempt starts
        wanted = self.audit_step
        if wanted is None or wanted < self._first_step:
            wanted = self._first_step if self.eager else first_timed_step
        if self.result is not None or step != min(wanted, self.engine.total_steps):
            return contextlib.nullcontext()
        return self._audited(step)

    @contextlib.contextmanager
    def _audited(self, step: int) -> Iterator[None]:
        engine = self.engine
        recorder = MatmulRecorder(engine.model, unwrap(engine.model))
        saved = SavedActivations(stopped=lambda: recorder.backward_started)
        grads: list[torch.Tensor] = []

        def catch_grads(optimizer, args, kwargs) -> None:
            grads.extend(p.grad for p in engine.parameters if p.grad is not None)

        hook = engine.optimizer.register_step_pre_hook(catch_grads)
        # force_eager runs every torch.compile'd module and function of the step as written.
        stance = (
            torch.compiler.set_stance("force_eager") if self.eager else contextlib.nullcontext()
        )
        try:
            with engine.throughput.left_out(engine.progress), stance, recorder, saved:
                yield
        finally:
            hook.remove()
        model, optimizer, distributed = unwrap(engine.model), engine.optimizer, engine.distributed
        local = step_figures(recorder, saved, engine.parameters, grads, optimizer, model)
        grad_bytes = dtypes.bytes_by_dtype(grads)
        local["communication"] = dtypes.communication(engine.model, distributed, grad_bytes)
        self.result = self._recorded(step, self._over_ranks(local))

    def _over_ranks(self, local: dict[str, Any]) -> dict[str, Any]:
        """The figures of all ranks: FLOPs summed, bytes of the largest rank."""
        distributed = self.engine.distributed
        if distributed is None:
            return local
        everyone = distributed.gather(local)
        flops = MatmulFlops.from_rows(row for figures in everyone for row in figures["flops"])
        largest = max(everyone, key=lambda f: f["saved_activation_bytes"]["total"])
        return {
            **local,
            "flops": flops.as_rows(),
            "saved_activation_bytes": largest["saved_activation_bytes"],
            "ranks": len(everyone),
        }

    def _recorded(self, step: int, figures: dict[str, Any]) -> dict[str, Any]:
        precision, distributed = self.engine.precision, self.engine.distributed
        converted, kept = precision.converted_linears(), precision.kept_fp32
        record = audit_record(step, precision.spec, figures, converted, kept, self.eager)
        record["tf32"] = TF32_NOTE if self._tf32(record["flops_by_dtype"]) else None
        is_main = distributed is None or distributed.is_main
        if is_main:
            line = described(
                step, record["flops_by_dtype"], figures, record["keep_fp32_flop_share"]
            )
            log.info("%s%s", line, " (an eager step of the compiled run)" if self.eager else "")
        if record["engaged"] is False and is_main:
            log.warning("%s", warning_text(precision.spec.name, verdict_of(record)))
        return record

    def _tf32(self, by_dtype: dict[str, float]) -> bool:
        device = self.engine.device
        return (
            device.type == "cuda"
            and by_dtype.get("float32", 0) > 0
            and torch.cuda.get_device_capability(device) >= (8, 0)
            and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
        )

    def summary(self) -> dict[str, Any] | None:
        return self.result


def step_figures(
    recorder: MatmulRecorder,
    saved: SavedActivations,
    parameters: list[torch.Tensor],
    grads: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
) -> dict[str, Any]:
    """One rank's figures of the audited step (no communication, one rank), for
    ``audit_record``."""
    return {
        "flops": recorder.flops.as_rows(),
        "saved_activation_bytes": saved.summary(),
        "state": {
            "weights": dtypes.bytes_by_dtype(parameters),
            # None when the step was skipped (the optimizer never ran).
            "grads": dtypes.bytes_by_dtype(grads) if grads else None,
            "optimizer_state": dtypes.bytes_by_dtype(optimizer_tensors(optimizer)),
        },
        "weight_elements": dtypes.parameter_elements(model),
        "communication": None,
        "ranks": 1,
    }


def audit_record(
    step: int,
    spec: PrecisionSpec,
    figures: dict[str, Any],
    converted: list[str] | None = None,
    kept: list[str] | tuple[str, ...] = (),
    eager: bool = False,
) -> dict[str, Any]:
    """summary.json's ``precision_audit``: the audited step's figures (its matmul FLOPs as rows,
    weight elements, saved bytes, state, communication, ranks) judged against ``spec``. Every
    writer of the results format records its audit through this (the engine, amp_exp.record and
    the trainer callbacks)."""
    recorded = MatmulFlops.from_rows(figures["flops"])
    # Shares and verdicts are those of the step's own forward and backward: activation
    # checkpointing's recompute repeats forward matmuls in the same dtypes, and counting it
    # would make the shares of one configuration differ with checkpointing on and off.
    flops = recorded.where(lambda _, phase: phase != RECOMPUTE)
    verdict = judge(spec, flops, figures["weight_elements"], converted, list(kept))
    return {
        "step": step,
        # The run trains compiled, and this step ran eagerly (before compilation by default).
        "eager_step_of_compiled_run": eager,
        "ranks": figures["ranks"],
        "engaged": verdict.engaged,
        "shortfalls": verdict.shortfalls,
        "responsible": verdict.responsible,
        # Forward and backward; the recompute's are under "recompute".
        "matmul_flops": flops.total,
        "flops_by_dtype": share_by_dtype(flops.by_dtype()),
        **{
            phase: {
                "matmul_flops": sum(recorded.by_dtype(phase).values()),
                "flops_by_dtype": share_by_dtype(recorded.by_dtype(phase)),
            }
            for phase in PHASES
        },
        "higher_precision_modules": higher_precision_modules(spec, flops),
        # The share of matmul FLOPs inside the modules precision.keep_fp32 kept (None when
        # it keeps none); the verdict judges the rest.
        "keep_fp32_flop_share": kept_fp32_share(flops, list(kept)) if kept else None,
        "modules": flops.by_module(),
        "tf32": None,
        "saved_activation_bytes": figures["saved_activation_bytes"],
        "state": figures["state"],
        "communication": figures["communication"],
    }


def verdict_of(record: dict[str, Any]) -> Verdict:
    return Verdict(record["engaged"], record["shortfalls"], record["responsible"])


def shares(fractions: dict[str, float]) -> str:
    shown = [f"{dtype} {share:.0%}" for dtype, share in fractions.items() if share >= 0.005]
    return ", ".join(shown) or "none"


def described(
    step: int,
    flops_shares: dict[str, float],
    figures: dict[str, Any],
    kept_share: float | None = None,
) -> str:
    """The audit in one line: what the matmuls ran in (and how much of it precision.keep_fp32
    kept in fp32), and what the forward saved."""
    saved = figures["saved_activation_bytes"]
    kept = "" if kept_share is None else f" ({kept_share:.0%} kept in fp32 by precision.keep_fp32)"
    return (
        f"precision audit @ step {step}: matmul FLOPs {shares(flops_shares)}{kept}; saved for "
        f"backward {saved['total'] / 2**20:,.2f} MiB ({shares(share_by_dtype(saved['by_dtype']))})"
    )
