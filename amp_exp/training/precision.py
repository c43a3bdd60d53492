"""PrecisionPolicy: which precision runs, and the AMP sequence every training step follows.

One code path serves fp32, bf16 and fp16. The GradScaler exists only for fp16 (bf16 keeps fp32's
exponent range, so its gradients do not underflow); everything else is the same call sequence:
autocast forward and loss -> scaled backward -> unscale_ -> clip -> step -> update.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from amp_exp.config.schema import Precision, PrecisionConfig
from amp_exp.runtime.fsdp import whole

log = logging.getLogger(__name__)

DTYPES = {
    Precision.fp32: torch.float32,
    Precision.fp16: torch.float16,
    Precision.bf16: torch.bfloat16,
}


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
        if precision is Precision.auto:
            raise ValueError("resolve precision=auto first (runtime.hardware.resolve_precision)")
        self.precision = precision
        self.device = device
        self.clip_grad_norm = cfg.clip_grad_norm
        self.dtype = DTYPES[precision]
        self.scaler: torch.amp.GradScaler | None = None
        if precision is Precision.fp16:
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

    @property
    def uses_autocast(self) -> bool:
        return self.precision is not Precision.fp32 and not self.params_cast

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Learn whether the scaler ran ``optimizer.step()`` without reading found_inf.

        GradScaler calls ``optimizer.step()`` only when the gradients are finite, so a post-step
        hook tells a skipped step from a real one with no extra device sync.
        """
        optimizer.register_step_post_hook(self._on_optimizer_step)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._optimizer_stepped = True

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
