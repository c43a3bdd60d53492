"""PrecisionPolicy: which precision runs, and the AMP sequence every training step follows.

One code path serves every precision. The GradScaler exists only for fp16 (bf16 keeps fp32's
exponent range, so its gradients do not underflow); everything else is the same call sequence,
which ``Engine.train_step`` (training/engine.py) reads top to bottom: autocast forward and loss
-> scale -> backward -> unscale -> clip -> step -> update. A step with non-finite gradients is
skipped on the device where the optimizer allows it (fused kernels take ``found_inf``), so no
step reads the device; the engine learns of skips at log steps. What differs between precisions
is their plugin's (training/precisions/: the model's conversion, the forward context, backward,
the optimizer step, their own state); the policy's pieces of the step call it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from amp_exp.config.plain import plain_run_config
from amp_exp.config.precisions import PluginHook, plugin_of
from amp_exp.config.schema import PrecisionConfig
from amp_exp.runtime.fsdp import local, whole
from amp_exp.training.precisions.base import PrecisionPlugin
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


class PluginContext:
    """A plugin's forward or inference context: a fault of the plugin's own in making,
    entering or leaving it is named as the plugin's (``PluginHook``); what the block raises
    passes through it as it is."""

    def __init__(self, plugin: PrecisionPlugin, hook: str) -> None:
        self.plugin, self.hook = plugin, hook
        with PluginHook(plugin, hook):
            self.context = getattr(plugin, hook)()

    def __enter__(self) -> object:
        with PluginHook(self.plugin, self.hook):
            return self.context.__enter__()

    def __exit__(self, kind: type | None, error: BaseException | None, trace: object) -> bool:
        with PluginHook(self.plugin, self.hook, passing=error):
            return bool(self.context.__exit__(kind, error, trace))


class PrecisionPolicy:
    """Autocast context, GradScaler and the pieces of the AMP step: scale, backward, unscale,
    clip, step, update."""

    def __init__(
        self,
        precision: str,
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
        plugin = plugin_of(str(getattr(precision, "value", precision)))
        with PluginHook(plugin, "__init__"):
            self.plugin: PrecisionPlugin = plugin(cfg, device, keep_fp32, params_cast)
        self.spec = self.plugin.spec
        self.precision = self.spec.name
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
        # Set when the optimizer's own kernels cannot round bf16 updates stochastically.
        self.rounding: StochasticRoundingStep | None = None
        # The flag of a parameter without a gradient this step.
        self._finite = torch.zeros((), device=device)

    @property
    def uses_autocast(self) -> bool:
        return self.plugin.uses_autocast

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the optimizer updates: fp32 master weights, except in bf16_true."""
        return self.spec.weight_dtype.torch

    @property
    def stochastic_rounding(self) -> bool:
        return self.plugin.stochastic_rounding

    @property
    def timed(self) -> bool:
        """An emulated format measures numerics, not speed: its throughput is never reported."""
        return self.plugin.timed

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The model as this precision trains it; call before the optimizer and any wrapper."""
        with PluginHook(self.plugin, "convert_module"):
            return self.plugin.convert_module(model)

    def autocast(self) -> contextlib.AbstractContextManager:
        return PluginContext(self.plugin, "forward_context")

    def inference(self) -> contextlib.AbstractContextManager:
        """The no-grad mode of evaluation."""
        return PluginContext(self.plugin, "inference_context")

    def summary(self) -> dict:
        """What summary.json records: the modules kept in fp32, the plugin's facts as a report
        shows them, and the plugin's own fields."""
        knobs = plain_run_config(self.cfg)
        with PluginHook(self.plugin, "summary"):
            facts = {
                "label": self.plugin.variant_label(knobs),
                "order": self.plugin.spec.order,
                "colour": self.plugin.spec.colour,
                "grad_scaler": self.plugin.spec.grad_scaler,
                "stall_advice": self.plugin.stall_advice(knobs),
            }
            own = self.plugin.summary()
        return {"keep_fp32_modules": self.kept_fp32, "precision_facts": facts, **own}

    # --- the AMP step's pieces, in the order Engine.train_step calls them -----------------------

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward starts from: fp16's multiplied by the GradScaler's scale, so
        that small gradients do not underflow; any other precision's as it is."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def backward(self, loss: torch.Tensor) -> None:
        """The plugin's ``backward`` of the (already scaled) loss."""
        with PluginHook(self.plugin, "backward"):
            self.plugin.backward(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide fp16's gradients by the scale in place (the GradScaler notes any inf or NaN
        for its step): clipping thresholds refer to true gradients."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def clip(self, parameters: list[torch.nn.Parameter], want_grad_norm: bool) -> Gradients:
        """Clip the gradients, and find on the device whether the step must skip.

        The gradient norm is computed when clipping needs it, when the caller asks for it (at
        log intervals), or when non-finite gradients must be found; it stays on the device.
        """
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

    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None) -> None:
        """Step the optimizer, or skip the step where ``found_inf`` is 1, without a host read
        where the optimizer can skip on the device.

        fp16's GradScaler skips by what its ``unscale`` found. A fused optimizer takes
        ``found_inf`` into its kernel, as it does from a GradScaler. Any other optimizer must be
        told on the host whether to step: one read per step, the price of
        ``trainer.on_nonfinite`` with a non-fused optimizer (and, inside GradScaler, of fp16
        with one).
        """
        if self.scaler is not None:
            self.scaler.step(optimizer)
        elif found_inf is None:
            self._optimizer_step(optimizer)
        elif getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale, optimizer.found_inf = None, found_inf  # type: ignore[attr-defined]
            try:
                self._optimizer_step(optimizer)
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        elif not found_inf:
            self._optimizer_step(optimizer)

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The plugin's ``optimizer_step``, or the stochastic rounding's, which replaces it."""
        if self.rounding is None:
            with PluginHook(self.plugin, "optimizer_step"):
                self.plugin.optimizer_step(optimizer)
        else:
            self.rounding.step(optimizer)

    def update(self) -> None:
        """fp16's GradScaler backs its scale off after a skipped step and grows it after
        ``growth_interval`` finite ones; on the device, no read."""
        if self.scaler is not None:
            self.scaler.update()

    def scale(self) -> float | None:
        """The current loss scale; reads the device, so call it only at log intervals."""
        return None if self.scaler is None else self.scaler.get_scale()

    def state_dict(self) -> dict:
        with PluginHook(self.plugin, "state_dict"):
            plugin_state = self.plugin.state_dict()
        return {
            "precision": self.precision,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "plugin": plugin_state,
        }

    def load_state_dict(self, state: dict) -> None:
        """Take the scaler's state; a checkpoint of another precision keeps what still applies."""
        if state["precision"] == self.precision:
            if self.scaler is not None:
                self.scaler.load_state_dict(state["scaler"])
            with PluginHook(self.plugin, "load_state_dict"):
                self.plugin.load_state_dict(state.get("plugin", {}))
            return
        if self.scaler is not None:
            kept = "a fresh GradScaler starts at precision.init_scale"
        elif state["scaler"] is not None:
            kept = "its GradScaler state is dropped"
        else:
            kept = "model, optimizer and schedule carry over unchanged"
        log.warning("resuming a %s checkpoint in %s: %s", state["precision"], self.precision, kept)
