"""AMP health: the checklist of the mixed-precision guides, run automatically.

Diagnostics ride on optimizer hooks, so the engine's loop stays as it is: a pre-step hook sees
the gradients after ``unscale_`` and clipping, a post-step hook sees the updated parameters.
They read the device only on the few steps they examine.

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
from amp_exp.runtime.fsdp import local
from amp_exp.training.loop import Progress

log = logging.getLogger("amp_exp")

FP16_SMALLEST_SUBNORMAL = 2.0**-24
FP16_MAX = 65504.0
WORST_LAYERS = 5


def gradient_ranges(
    named_grads: list[tuple[str, torch.Tensor]], scale: float
) -> tuple[dict[str, float], list[dict], float]:
    """How fp16 would treat these unscaled fp32 gradients, with and without ``scale`` applied.

    Fractions are of all elements, and zeros count as lost: a gradient that already flushed to
    zero in the fp16 backward cannot be told apart from an exact zero. Returns the totals, the
    worst layers and the largest magnitude; every statistic comes back in one host read.
    """
    stats = torch.stack(
        [
            torch.stack(
                [
                    torch.tensor(g.numel(), device=g.device),
                    (g.abs() < FP16_SMALLEST_SUBNORMAL).sum(),
                    (g.abs() * scale < FP16_SMALLEST_SUBNORMAL).sum(),
                    (g.abs() * scale > FP16_MAX).sum(),
                    g.abs().max(),
                ]
            ).double()
            for _, g in named_grads
        ]
    )
    rows = [row[:4] for row in stats.tolist()]
    max_abs = float(stats[:, 4].max())
    layers = [
        {
            "layer": name,
            "underflow_frac": underflow / elements,
            "underflow_frac_scaled": scaled / elements,
            "overflow_frac_scaled": overflow / elements,
        }
        for (name, _), (elements, underflow, scaled, overflow) in zip(
            named_grads, rows, strict=True
        )
    ]
    elements, underflow, scaled, overflow = (sum(column) for column in zip(*rows, strict=True))
    totals = {
        "underflow_frac": underflow / elements,
        "underflow_frac_scaled": scaled / elements,
        "overflow_frac_scaled": overflow / elements,
    }
    worst = sorted(layers, key=lambda layer: layer["underflow_frac_scaled"], reverse=True)
    return totals, worst[:WORST_LAYERS], max_abs


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


class Diagnostics:
    """Runs the checks and the underflow measurement on the steps that call for them."""

    def __init__(
        self,
        cfg: DiagnosticsConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        progress: Callable[[], Progress],
        current_scale: Callable[[], float | None],
        emit: Callable[[dict], None],
        weight_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``progress`` is the engine's; optimizer hooks run inside the step it is about to
        record, so the step being examined is ``progress().step + 1``. ``weight_dtype`` is what
        the precision stores weights in: bf16 weights and gradients are by design in bf16_true.
        """
        self.cfg = cfg
        self.named_parameters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.progress, self.current_scale, self.emit = progress, current_scale, emit
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
            self._snapshot = [p.detach().clone() for _, p in self.named_parameters]
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)

    def _checking(self) -> bool:
        return self.cfg.checks and self.steps_checked < self.cfg.check_steps

    def _fail(self, check: str, offenders: list[str], what: str) -> None:
        result = self.checks[check]
        new = [name for name in offenders if name not in result["offenders"]]
        if new:
            result["passed"] = False
            result["offenders"] += new
            log.warning("AMP check failed: %s: %s", what, ", ".join(new))

    def _before_step(self, optimizer, args, kwargs) -> None:
        # Under FSDP2 each rank examines its own shard of every gradient (gathering them all
        # would hold the whole model's gradients on one rank, which sharding exists to avoid);
        # a parameter smaller than the world size leaves some ranks an empty shard.
        grads = [
            (n, local(p.grad))
            for n, p in self.named_parameters
            if p.grad is not None and local(p.grad).numel() > 0
        ]
        if self._checking() and grads:
            finite = torch.stack([torch.isfinite(grad).all() for _, grad in grads]).tolist()
            wrong_dtype = self.fp32_weights
            bad = [
                name
                for (name, grad), ok in zip(grads, finite, strict=True)
                if (wrong_dtype and grad.dtype != torch.float32) or not ok
            ]
            self._fail(
                "unscaled_grads_fp32_finite", bad, "gradients after unscale_ not fp32 and finite"
            )
        if self._is_diagnostics_step() and grads:
            self._measure_underflow(grads)

    def _is_diagnostics_step(self) -> bool:
        every = self.cfg.underflow_every
        return bool(every) and (self.progress().step + 1) % every == 0

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self._is_diagnostics_step():
            self._emit_row()
        if not self._checking():
            return
        self.steps_checked += 1
        if self.fp32_weights:
            bad = [name for name, p in self.named_parameters if p.dtype != torch.float32]
            self._fail("master_weights_fp32", bad, "master parameters not fp32 after step")

    def _measure_underflow(self, grads: list[tuple[str, torch.Tensor]]) -> None:
        scale = self.current_scale() or 1.0
        totals, worst, max_abs = gradient_ranges(grads, scale)
        suggestion = largest_safe_scale(max_abs)
        if suggestion is not None and suggestion < (self.suggested_init_scale or math.inf):
            self.suggested_init_scale = suggestion
        step = self.progress().step + 1
        self.underflow = {"step": step, "scale": scale, **totals, "worst": worst}
        self._row = {f"grad_{name}": value for name, value in totals.items()}

    def _measure_stale_weights(self, step: int) -> dict:
        """The share of weight elements equal to their value at the previous row; one read."""
        weights = [p.detach() for _, p in self.named_parameters]
        unchanged = torch.stack(
            [(w == old).sum() for w, old in zip(weights, self._snapshot, strict=True)]
        ).sum()
        total = sum(w.numel() for w in weights)
        self.stale_weight_frac = unchanged.item() / total if total else None
        window = step - self._snapshot_step
        for w, old in zip(weights, self._snapshot, strict=True):
            old.copy_(w)
        self._snapshot_step = step
        return {"stale_weight_frac": self.stale_weight_frac, "stale_window_steps": window}

    def _emit_row(self) -> None:
        """One diagnostics row: the gradient range (pre-step) and the stale weights (now)."""
        progress = self.progress()
        step = progress.step + 1
        row = {
            "kind": "diagnostics",
            "step": step,
            "samples": progress.samples,
            "grad_underflow_frac": None,
            "grad_underflow_frac_scaled": None,
            "grad_overflow_frac_scaled": None,
            **self._row,
            **self._measure_stale_weights(step),
        }
        self._row = {}
        self.emit(row)

    def summary(self) -> dict:
        """The figures summary.json gets: check results, underflow and the suggested scale."""
        return {
            "checks": self.checks,
            "underflow": self.underflow,
            "suggested_init_scale": self.suggested_init_scale,
            "stale_weight_frac": self.stale_weight_frac,
        }
