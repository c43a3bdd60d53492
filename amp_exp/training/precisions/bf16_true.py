"""bf16_true: weights, gradients and optimizer state in bf16, no autocast and no fp32 master
copy; updates round to bf16 stochastically (precision.options.stochastic_rounding) so small ones
still move the weights on average.

The model is stored in bf16, apart from normalization layers (and modules that set
``keep_in_fp32 = True`` or that ``precision.keep_fp32`` names), which keep fp32 parameters,
buffers and arithmetic (training.keep_fp32.NORM_LAYERS says why). The model takes float inputs in
bf16 and hands back fp32 outputs, so the loss is computed from fp32 logits (cross-entropy's
log-sum-exp over many classes loses digits in bf16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from amp_exp.config.precisions import DType, Engagement, PrecisionSpec
from amp_exp.config.schema import Strategy
from amp_exp.training.precisions.base import PrecisionPlugin

if TYPE_CHECKING:
    from torch import nn

    from amp_exp.config.schema import PrecisionConfig


@dataclass
class Bf16TrueOptions:
    # Round each update to bf16 stochastically, so updates smaller than half a bf16 step still
    # move the weights on average; false rounds to nearest, and they are lost.
    stochastic_rounding: bool = True


def nearest(knobs: dict[str, Any]) -> bool:
    """Whether a run's ``precision.*`` values round its updates to nearest."""
    return (knobs.get("options") or {}).get("stochastic_rounding") is False


class Bf16True(PrecisionPlugin):
    spec = PrecisionSpec(
        name="bf16_true",
        order=3,
        colour="#8172b3",
        compute_dtype=DType.bfloat16,
        weight_dtype=DType.bfloat16,
        optimizer_state_dtype=DType.bfloat16,
        peak_math="bf16",
        probed_as="bf16",
        # Its gradients are bf16; DDP sums them in fp32 (the default) and rounds once
        # (runtime/distributed).
        strategies=frozenset({Strategy.ddp}),
        engaged=Engagement(0.5, (DType.bfloat16,), weights=DType.bfloat16),
        needs_native_bf16=True,
    )

    Options = Bf16TrueOptions

    @classmethod
    def variant_name(cls, cfg: PrecisionConfig) -> str:
        """Updates rounded to nearest are the bf16_true_nearest preset, however asked for."""
        if not cls.options_for(cfg).stochastic_rounding:
            return "bf16_true_nearest (bf16_true, precision.options.stochastic_rounding=false)"
        return cls.spec.name

    @classmethod
    def variant_label(cls, knobs: dict[str, Any]) -> str:
        return "bf16_true (nearest)" if nearest(knobs) else "bf16_true"

    @classmethod
    def stall_advice(cls, knobs: dict[str, Any]) -> str:
        if nearest(knobs):
            return "updates round away in bf16; use precision.options.stochastic_rounding=true"
        return super().stall_advice(knobs)

    @property
    def stochastic_rounding(self) -> bool:
        return self.options.stochastic_rounding

    def convert_module(self, model: nn.Module) -> nn.Module:
        """The model in bf16, its norm layers and the ``keep_fp32`` modules in fp32, taking bf16
        inputs and giving fp32 outputs.

        Only the outermost fp32 modules are hooked: a norm inside a kept module takes fp32 from
        the layer before it and must hand fp32 to the layer after it.
        """
        import torch

        from amp_exp.training.keep_fp32 import cast_floats, is_within, keeps_fp32, outermost

        def cast_inputs(dtype: torch.dtype):
            return lambda module, args, kwargs: cast_floats((args, kwargs), dtype)

        def cast_output(dtype: torch.dtype):
            return lambda module, args, output: cast_floats(output, dtype)

        fp32_names = [name for name, module in model.named_modules() if name and keeps_fp32(module)]
        kept = outermost([*fp32_names, *self.kept_fp32])
        for name, module in model.named_modules():
            if not is_within(name, kept):
                # Only the module's own tensors: a kept module is never rounded through bf16,
                # which would lose digits of loaded weights and of buffers such as rotary
                # frequencies.
                module._apply(functools.partial(cast_floats, dtype=torch.bfloat16), recurse=False)
        for name in kept:
            module = model.get_submodule(name).float()
            module.register_forward_pre_hook(cast_inputs(torch.float32), with_kwargs=True)
            # Back to bf16 for the layer after it, whose weights are bf16.
            module.register_forward_hook(cast_output(torch.bfloat16))
        model.register_forward_pre_hook(cast_inputs(torch.bfloat16), with_kwargs=True)
        model.register_forward_hook(cast_output(torch.float32))
        return model


PLUGIN = Bf16True
