"""PrecisionPolicy: which precision runs, and the AMP sequence every training step follows.

One code path serves every precision. The GradScaler exists only for fp16 (bf16 keeps fp32's
exponent range, so its gradients do not underflow); everything else is the same call sequence:
autocast forward and loss -> scaled backward -> unscale_ -> clip -> step -> update. A step with
non-finite gradients is skipped on the device where the optimizer allows it (fused kernels take
``found_inf``), so no step reads the device; the engine learns of skips at log steps.
bf16_true has no autocast: the model itself is bf16 (``prepare_model``). fp8 runs torchao's
float8 linears under bf16 autocast.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from amp_exp.config.precisions import spec_of
from amp_exp.config.schema import Precision, PrecisionConfig
from amp_exp.errors import ConfigError
from amp_exp.runtime.fsdp import local, whole
from amp_exp.training.keep_fp32 import run_without_autocast
from amp_exp.training.precision_modes import Fp8Conversion, convert_to_fp8, to_bf16_true
from amp_exp.training.stochastic_rounding import StochasticRoundingStep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gradients:
    """What a step learned of its gradients, all on the device: the total norm (None when not
    computed), and where steps can skip, ``found_inf`` (1.0: skip) and a non-finite flag per
    parameter."""

    norm: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    nonfinite: torch.Tensor | None = None


def per_tensor_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor, in order: one foreach kernel per device and dtype, as
    ``torch.nn.utils.get_total_norm`` computes them before it sums them."""
    norms: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    grouped = _group_tensors_by_device_and_dtype([tensors], with_indices=True)
    for (device, _), ((group,), indices) in grouped.items():
        if _has_foreach_support(group, device):
            group_norms = torch._foreach_norm(group)
        else:  # FSDP2's DTensors
            group_norms = [torch.linalg.vector_norm(tensor) for tensor in group]
        for index, norm in zip(indices, group_norms, strict=True):
            norms[index] = norm
    return norms


class PrecisionPolicy:
    """Autocast context, GradScaler and the backward/unscale/clip/step/update sequence."""

    def __init__(
        self,
        precision: Precision,
        cfg: PrecisionConfig,
        device: torch.device,
        guard_nonfinite: bool = False,
        params_cast: bool = False,
        keep_fp32: Sequence[str] = (),
    ) -> None:
        """``guard_nonfinite``: without a scaler, skip steps whose gradients are inf or NaN.

        ``keep_fp32``: the modules (outermost names, training.keep_fp32.match_keep_fp32) that
        compute in fp32 whatever the precision; ``prepare_model`` makes them do so, but under
        FSDP2, whose policy per module does it (runtime.fsdp).

        ``params_cast``: FSDP2's mixed-precision policy already gathers the parameters in this
        precision's dtype and casts the model's inputs to it, so the forward runs in that dtype
        and autocast stays off. On top of it autocast would be a second caster with other
        rules: its matmul casts would find bf16/fp16 weights already, and its fp32 list would
        upcast what the policy means to run in the low dtype. One caster, the policy, as in
        torchtitan; the GradScaler stays.
        """
        self.spec = spec_of(precision)
        self.precision = precision
        self.cfg = cfg
        self.device = device
        self.clip_grad_norm = cfg.clip_grad_norm
        self.dtype = self.spec.compute_dtype.torch
        self.scaler: torch.amp.GradScaler | None = None
        if self.spec.grad_scaler:
            self.scaler = torch.amp.GradScaler(
                device.type,
                init_scale=cfg.init_scale,
                growth_factor=cfg.growth_factor,
                backoff_factor=cfg.backoff_factor,
                growth_interval=cfg.growth_interval,
            )
        self.guard_nonfinite = guard_nonfinite
        self.params_cast = params_cast
        # What a precision audit attributes fp32 FLOPs to: these modules and all inside them.
        self.kept_fp32 = list(keep_fp32)
        self.fp8: Fp8Conversion | None = None
        # Set when the optimizer's own kernels cannot round bf16 updates stochastically.
        self.rounding: StochasticRoundingStep | None = None
        # The flag of a parameter without a gradient this step.
        self._finite = torch.zeros((), device=device)

    @property
    def uses_autocast(self) -> bool:
        return self.spec.autocast_dtype is not None and not self.params_cast

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the optimizer updates: fp32 master weights, except in bf16_true."""
        return self.spec.weight_dtype.torch

    @property
    def stochastic_rounding(self) -> bool:
        return self.precision is Precision.bf16_true and self.cfg.stochastic_rounding

    @property
    def timed(self) -> bool:
        """Emulated fp8 measures numerics, not speed: its throughput is never reported."""
        return not (self.precision is Precision.fp8 and self.cfg.fp8_emulate)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The model as this precision trains it; call before the optimizer and any wrapper."""
        if self.precision is Precision.bf16_true:
            return to_bf16_true(model, self.kept_fp32)
        if self.uses_autocast:
            run_without_autocast(model, self.kept_fp32, self.device.type)
        if self.precision is Precision.fp8:
            model, self.fp8 = convert_to_fp8(model, self.cfg, self.kept_fp32)
            if not self.fp8.converted:
                raise ConfigError(self._fp8_converted_nothing())
            if self.fp8.emulated:
                log.warning("fp8 is emulated (precision.fp8_emulate=true): slow, so not timed")
            log.info(
                "fp8 (%s%s): %d linear layers converted, %d kept in bf16 (%s)",
                self.cfg.fp8_recipe.value,
                ", emulated" if self.fp8.emulated else "",
                len(self.fp8.converted),
                len(self.fp8.skipped),
                ", ".join(f"{name}: {why}" for name, why in self.fp8.skipped.items()) or "none",
            )
        return model

    def _fp8_converted_nothing(self) -> str:
        skipped = self.fp8.skipped if self.fp8 else {}
        why = ", ".join(f"{name}: {reason}" for name, reason in skipped.items())
        first_last = any(reason in ("first layer", "last layer") for reason in skipped.values())
        return (
            f"precision=fp8 converted no linear layer ({why or 'the model has none'}), so no "
            "matmul would run in float8; use precision=bf16"
            + (" or precision.fp8_skip_first_last=false" if first_last else "")
        )

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.spec.autocast_dtype.torch)

    def inference(self) -> contextlib.AbstractContextManager:
        """The no-grad mode of evaluation. torchao's Float8Linear fails under inference_mode
        (pytorch/ao#643), so fp8 evaluates under no_grad."""
        return torch.no_grad() if self.precision is Precision.fp8 else torch.inference_mode()

    def summary(self) -> dict:
        """What summary.json records: the modules kept in fp32, and an fp8 run's conversion."""
        kept = {"keep_fp32_modules": self.kept_fp32}
        if self.fp8 is None:
            return kept
        return {
            **kept,
            "fp8_emulated": self.fp8.emulated,
            "fp8_converted": self.fp8.converted,
            "fp8_skipped": self.fp8.skipped,
            "fp8_mfu_peak_source": (
                "null: emulated fp8 is not timed"
                if self.fp8.emulated
                else "null: fp8 matmuls peak at twice the bf16 rate, so MFU against a bf16 "
                "peak would overstate utilization"
            ),
        }

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is None:
            loss.backward()
        else:
            self.scaler.scale(loss).backward()

    def unscale_and_clip(
        self,
        optimizer: torch.optim.Optimizer,
        parameters: list[torch.nn.Parameter],
        want_grad_norm: bool,
    ) -> Gradients:
        """Unscale and clip the gradients, and find on the device whether the step must skip.

        The gradient norm is computed when clipping needs it, when the caller asks for it (at
        log intervals), or when non-finite gradients must be found; it stays on the device.
        """
        if self.scaler is not None:
            # Clipping thresholds refer to true gradients, so unscale before measuring them.
            self.scaler.unscale_(optimizer)
        skips = self.scaler is not None or self.guard_nonfinite
        if not (skips or want_grad_norm or self.clip_grad_norm is not None):
            return Gradients()
        with_grads = [p for p in parameters if p.grad is not None]
        norms = per_tensor_norms([p.grad for p in with_grads])
        if not norms:
            return Gradients()
        # Of FSDP2's gradient shards the norms are DTensors: whole() sums them over the ranks.
        total = torch.linalg.vector_norm(torch.stack(norms))
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(with_grads, self.clip_grad_norm, whole(total))
        total = whole(total)
        if not skips:
            return Gradients(total)
        # This rank's share of each parameter's norm: an inf or NaN anywhere in a shard shows.
        local_norms = iter(torch.stack([local(norm) for norm in norms]).float())
        nonfinite = torch.stack(
            [next(local_norms) if p.grad is not None else self._finite for p in parameters]
        )
        return Gradients(total, (~torch.isfinite(total)).float(), ~torch.isfinite(nonfinite))

    def update(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None) -> None:
        """Step the optimizer, or skip the step where ``found_inf`` is 1, without a host read
        where the optimizer can skip on the device.

        A fused optimizer takes ``found_inf`` into its kernel, as it does from a GradScaler.
        Any other optimizer must be told on the host whether to step: one read per step, the
        price of ``trainer.on_nonfinite`` with a non-fused optimizer (and, inside GradScaler,
        of fp16 with one).
        """
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        elif found_inf is None:
            self._step(optimizer)
        elif getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale, optimizer.found_inf = None, found_inf  # type: ignore[attr-defined]
            try:
                self._step(optimizer)
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        elif not found_inf:
            self._step(optimizer)

    def _step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.rounding is None:
            optimizer.step()
        else:
            self.rounding.step(optimizer)

    def scale(self) -> float | None:
        """The current loss scale; reads the device, so call it only at log intervals."""
        return None if self.scaler is None else self.scaler.get_scale()

    def state_dict(self) -> dict:
        return {
            "precision": self.precision.value,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take the scaler's state; a checkpoint of another precision keeps what still applies."""
        if state["precision"] == self.precision.value:
            if self.scaler is not None:
                self.scaler.load_state_dict(state["scaler"])
            return
        if self.scaler is not None:
            kept = "a fresh GradScaler starts at precision.init_scale"
        elif state["scaler"] is not None:
            kept = "its GradScaler state is dropped"
        else:
            kept = "model, optimizer and schedule carry over unchanged"
        log.warning(
            "resuming a %s checkpoint in %s: %s", state["precision"], self.precision.value, kept
        )
