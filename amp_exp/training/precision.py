"""PrecisionPolicy: which precision runs, and the AMP sequence every training step follows.

One code path serves every precision. The GradScaler exists only for fp16 (bf16 keeps fp32's
exponent range, so its gradients do not underflow); everything else is the same call sequence:
autocast forward and loss -> scaled backward -> unscale_ -> clip -> step -> update.
bf16_true has no autocast: the model itself is bf16 (``prepare_model``). fp8 runs torchao's
float8 linears under bf16 autocast.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from amp_exp.config.precisions import spec_of
from amp_exp.config.schema import Precision, PrecisionConfig
from amp_exp.errors import ConfigError
from amp_exp.runtime.fsdp import whole
from amp_exp.training.precision_modes import Fp8Conversion, convert_to_fp8, to_bf16_true

log = logging.getLogger(__name__)


class PrecisionPolicy:
    """Autocast context, GradScaler and the backward/unscale/clip/step/update sequence."""

    def __init__(
        self,
        precision: Precision,
        cfg: PrecisionConfig,
        device: torch.device,
        guard_nonfinite: bool = False,
        params_cast: bool = False,
    ) -> None:
        """``guard_nonfinite``: without a scaler, skip steps whose gradients are inf or NaN.

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
        self._optimizer_stepped = False
        self.fp8: Fp8Conversion | None = None

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
            return to_bf16_true(model)
        if self.precision is Precision.fp8:
            model, self.fp8 = convert_to_fp8(model, self.cfg)
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

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Learn whether the scaler ran ``optimizer.step()`` without reading found_inf.

        GradScaler calls ``optimizer.step()`` only when the gradients are finite, so a post-step
        hook tells a skipped step from a real one with no extra device sync.
        """
        optimizer.register_step_post_hook(self._on_optimizer_step)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._optimizer_stepped = True

    def summary(self) -> dict:
        """What summary.json records about an fp8 run's conversion (nothing for other modes)."""
        if self.fp8 is None:
            return {}
        return {
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

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        parameters: list[torch.nn.Parameter],
        want_grad_norm: bool,
    ) -> tuple[bool, torch.Tensor | None]:
        """Unscale, clip, step and update. Returns (stepped, grad_norm tensor or None).

        The gradient norm is computed when clipping needs it or when the caller asks for it (at
        log intervals), so a step without clipping reads its gradients only once.
        """
        if self.scaler is not None:
            # Clipping thresholds refer to true gradients, so unscale before measuring them.
            self.scaler.unscale_(optimizer)
        # A fused optimizer under a scaler hides its skip inside the kernel, and without a scaler
        # only the guard can skip: both must read the norm on the host (one sync per step).
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        checks_on_host = self.guard_nonfinite if self.scaler is None else fused
        grad_norm = None
        if self.clip_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, self.clip_grad_norm)
        elif want_grad_norm or checks_on_host:
            grad_norm = torch.nn.utils.get_total_norm(
                [p.grad for p in parameters if p.grad is not None]
            )
        if grad_norm is not None:
            # Of FSDP2's gradient shards the norm is a DTensor already summed over the ranks.
            grad_norm = whole(grad_norm)
        finite = bool(torch.isfinite(grad_norm)) if checks_on_host else True
        if self.scaler is None:
            if finite:
                optimizer.step()
            return finite, grad_norm
        self._optimizer_stepped = False
        self.scaler.step(optimizer)
        self.scaler.update()
        return (finite if fused else self._optimizer_stepped), grad_norm

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
