"""AMP health: the checklist of the mixed-precision guides, run automatically.

Diagnostics are a step callback (training/callbacks.py): after clipping they see the gradients
the optimizer will use, after the step the updated (and rounded) parameters. They read the
device only on the few steps they examine. Under FSDP2 each rank holds a shard of every
gradient and weight: on those steps the ranks sum their counts and take the largest magnitude,
so every figure describes the whole model, as one process would measure it.

Every ``underflow_every`` steps a diagnostics row reports how fp16 would treat the gradients and
the share of weights that did not change since the previous row (``stale_weight_frac``): with
bf16 weights and round-to-nearest, updates below half a bf16 step are lost and training stalls.
That comparison holds one copy of the weights between rows; after a resume the first window
starts at the resumed step (``stale_window_steps`` says how many steps a row covers).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from amp_exp.config.schema import DiagnosticsConfig
from amp_exp.runtime.distributed import Distributed
from amp_exp.runtime.fsdp import local
from amp_exp.training.callbacks import StepCallback
from amp_exp.training.loop import Progress
from amp_exp.training.precisions.base import Gradients

log = logging.getLogger("amp_exp")

FP16_SMALLEST_SUBNORMAL = 2.0**-24
FP16_MAX = 65504.0
WORST_LAYERS = 5
# Of all gradient elements: those below fp16's smallest subnormal, unscaled and scaled, and those
# above its maximum, scaled.
FRACTIONS = ("underflow_frac", "underflow_frac_scaled", "overflow_frac_scaled")


def _ranges(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """A gradient's element count, its elements fp16 would flush to zero unscaled and scaled and
    those it would overflow scaled, and its largest magnitude."""
    magnitude = grad.abs()
    scaled = magnitude * scale
    # An FSDP2 rank's shard of a small parameter may be empty.
    largest = magnitude.max() if magnitude.numel() else magnitude.new_zeros(())
    counts = [
        (magnitude < FP16_SMALLEST_SUBNORMAL).sum(),
        (scaled < FP16_SMALLEST_SUBNORMAL).sum(),
        (scaled > FP16_MAX).sum(),
    ]
    return torch.stack([torch.tensor(grad.numel(), device=grad.device), *counts, largest]).double()


def gradient_ranges(
    named_grads: list[tuple[str, torch.Tensor]],
    scale: float,
    distributed: Distributed | None = None,
) -> tuple[dict[str, float], list[dict], float]:
    """How fp16 would treat these unscaled fp32 gradients, with and without ``scale`` applied.

    Fractions are of all elements, and zeros count as lost: a gradient that already flushed to
    zero in the fp16 backward cannot be told apart from an exact zero. Returns the totals, the
    worst layers and the largest magnitude; every statistic comes back in one host read. With
    ``distributed`` the gradients are this rank's shards: the counts are summed over the ranks
    and the largest magnitude is the largest of theirs.
    """
    stats = torch.stack([_ranges(grad, scale) for _, grad in named_grads])
    if distributed is not None:
        stats = torch.cat([distributed.sum(stats[:, :4]), distributed.maximum(stats[:, 4:])], dim=1)
    rows = [row[:4] for row in stats.tolist()]
    max_abs = float(stats[:, 4].max())
    names = [name for name, _ in named_grads]
    layers = [{"layer": name, **_fractions(*row)} for name, row in zip(names, rows, strict=True)]
    totals = _fractions(*(sum(column) for column in zip(*rows, strict=True)))
    worst = sorted(layers, key=lambda layer: layer["underflow_frac_scaled"], reverse=True)
    return totals, worst[:WORST_LAYERS], max_abs


def _fractions(elements: float, *counts: float) -> dict:
    return {name: count / elements for name, count in zip(FRACTIONS, counts, strict=True)}


def largest_safe_scale(max_abs_grad: float) -> float | None:
    """The largest power of two that keeps the largest gradient below fp16's maximum.

    None when the gradients give no magnitude to go by (all zero, or not finite).
    """
    if max_abs_grad <= 0 or not math.isfinite(max_abs_grad):
        return None
    exponent = math.floor(math.log2(FP16_MAX / max_abs_grad))
    # Halve once more when the bound is met exactly: the limit itself is not "below" it.
    if 2.0**exponent * max_abs_grad >= FP16_MAX:
        exponent -= 1
    return 2.0 ** min(exponent, 24)


class Diagnostics(StepCallback):
    """Runs the checks and the underflow measurement on the steps that call for them."""

    name = "diagnostics"

    def __init__(
        self,
        cfg: DiagnosticsConfig,
        model: nn.Module,
        progress: Callable[[], Progress],
        current_scale: Callable[[], float | None],
        emit: Callable[[dict], None],
        weight_dtype: torch.dtype = torch.float32,
        distributed: Distributed | None = None,
    ) -> None:
        """``progress`` is the engine's: callbacks run inside the step it is about to record.
        ``weight_dtype`` is what the precision stores weights in: bf16 weights and gradients
        are by design in bf16_true. ``distributed``: the ranks the model is sharded over, if it
        is (under DDP every rank holds the whole, reduced gradients)."""
        self.cfg = cfg
        self.named_parameters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.progress, self.current_scale, self.emit = progress, current_scale, emit
        self.shards = distributed if distributed is not None and distributed.shards else None
        self.fp32_weights = weight_dtype == torch.float32
        self.steps_checked = 0
        self.checks: dict[str, dict] = {
            "master_weights_fp32": {"passed": True, "offenders": []},
            "unscaled_grads_fp32_finite": {"passed": True, "offenders": []},
        }
        if not self.fp32_weights:
            self.checks["master_weights_fp32"] = {
                "passed": None,
                "note": "bf16 by design (precision=bf16_true): no fp32 master copy",
            }
            self.checks["unscaled_grads_fp32_finite"]["note"] = "bf16 by design: finiteness only"
        self.underflow: dict | None = None
        self.suggested_init_scale: float | None = None
        self.stale_weight_frac: float | None = None
        self._row: dict = {}
        # The weights as of the previous diagnostics row (or the start of this attempt).
        self._snapshot: list[torch.Tensor] = []
        self._snapshot_step = progress().step
        if cfg.underflow_every:
            self._snapshot = [local(p).detach().clone() for _, p in self.named_parameters]

    def _checking(self) -> bool:
        return self.cfg.checks and self.steps_checked < self.cfg.check_steps

    def _fail(self, check: str, offenders: list[str], what: str) -> None:
        result = self.checks[check]
        new = [name for name in offenders if name not in result["offenders"]]
        if new:
            result["passed"] = False
            result["offenders"] += new
            log.warning("AMP check failed: %s: %s", what, ", ".join(new))

    def after_clip(self, step: int, gradients: Gradients) -> None:
        checking, measuring = self._checking(), self._is_diagnostics_step(step)
        if not (checking or measuring):
            return  # most steps: nothing to look at, not even the list of gradients
        grads = [(n, local(p.grad)) for n, p in self.named_parameters if p.grad is not None]
        if checking and grads:
            # Non-finite gradients fail the check only in a step that applies them: the device
            # skips those of an fp16 scale search or of the non-finite guard.
            applied = True if gradients.found_inf is None else gradients.found_inf == 0
            bad = torch.stack(
                [
                    (~torch.isfinite(grad).all() & applied)
                    | (self.fp32_weights and grad.dtype != torch.float32)
                    for _, grad in grads
                ]
            )
            if self.shards is not None:
                bad = self.shards.maximum(bad.int())
            offenders = [name for (name, _), flag in zip(grads, bad.tolist(), strict=True) if flag]
            self._fail(
                "unscaled_grads_fp32_finite",
                offenders,
                "gradients after unscale_ not fp32 and finite",
            )
        if measuring and grads:
            scale = self.current_scale() or 1.0
            totals, worst, max_abs = gradient_ranges(grads, scale, self.shards)
            suggestion = largest_safe_scale(max_abs)
            if suggestion is not None and suggestion < (self.suggested_init_scale or math.inf):
                self.suggested_init_scale = suggestion
            self.underflow = {"step": step, "scale": scale, **totals, "worst": worst}
            self._row = {f"grad_{name}": value for name, value in totals.items()}

    def _is_diagnostics_step(self, step: int) -> bool:
        every = self.cfg.underflow_every
        return bool(every) and step % every == 0

    def after_step(self, step: int) -> None:
        if self._is_diagnostics_step(step):
            self._emit_row(step)
        if not self._checking():
            return
        self.steps_checked += 1
        if self.fp32_weights:
            bad = [name for name, p in self.named_parameters if p.dtype != torch.float32]
            self._fail("master_weights_fp32", bad, "master parameters not fp32 after step")

    def _emit_row(self, step: int) -> None:
        """One diagnostics row: the gradient range (pre-step) and the stale weights (now): the
        share of weight elements equal to their value at the previous row, in one read."""
        weights = [local(p).detach() for _, p in self.named_parameters]
        counts = torch.stack(
            [
                torch.stack([torch.tensor(w.numel(), device=w.device), (w == old).sum()]).double()
                for w, old in zip(weights, self._snapshot, strict=True)
            ]
        ).sum(dim=0)
        if self.shards is not None:
            counts = self.shards.sum(counts)
        total, unchanged = counts.tolist()
        self.stale_weight_frac = unchanged / total if total else None
        window = step - self._snapshot_step
        for w, old in zip(weights, self._snapshot, strict=True):
            old.copy_(w)
        self._snapshot_step = step
        row = {
            "kind": "diagnostics",
            "step": step,
            "samples": self.progress().samples,
            **{f"grad_{name}": None for name in FRACTIONS},
            **self._row,
            "stale_weight_frac": self.stale_weight_frac,
            "stale_window_steps": window,
        }
        self._row = {}
        self.emit(row)

    def summary(self) -> dict:
        """The figures summary.json gets: check results, underflow and the suggested scale,
        never above a scale fp16 backed off to after an overflow in this run (the largest
        gradient of the diagnostics steps says nothing of the step that overflowed)."""
        suggested = self.suggested_init_scale
        backed_off_to = (self.progress().first_overflow or {}).get("backed_off_to")
        if suggested is not None and backed_off_to is not None:
            suggested = min(suggested, backed_off_to)
        return {
            "checks": self.checks,
            "underflow": self.underflow,
            "suggested_init_scale": suggested,
            "stale_weight_frac": self.stale_weight_frac,
        }
