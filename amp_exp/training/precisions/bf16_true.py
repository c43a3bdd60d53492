"""bf16_true: weights, gradients and optimizer state in bf16, no autocast and no fp32 master
copy; updates round to bf16 stochastically (precision.stochastic_rounding) so small ones still
move the weights on average."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from amp_exp.config.precisions import DType, Engagement, PrecisionSpec
from amp_exp.config.schema import Strategy
from amp_exp.training.precisions.base import PrecisionPlugin

if TYPE_CHECKING:
    from torch import nn

    from amp_exp.config.schema import PrecisionConfig


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

    variant_keys = ("stochastic_rounding",)

    @classmethod
    def variant_name(cls, cfg: PrecisionConfig) -> str:
        """Updates rounded to nearest are the bf16_true_nearest preset, however asked for."""
        if not cfg.stochastic_rounding:
            return "bf16_true_nearest (bf16_true, precision.stochastic_rounding=false)"
        return cls.spec.name

    @classmethod
    def variant_label(cls, knobs: dict[str, Any]) -> str:
        return "bf16_true (nearest)" if knobs.get("stochastic_rounding") is False else "bf16_true"

    @classmethod
    def stall_advice(cls, knobs: dict[str, Any]) -> str:
        if knobs.get("stochastic_rounding") is False:
            return "updates round away in bf16; use precision.stochastic_rounding=true"
        return super().stall_advice(knobs)

    @property
    def stochastic_rounding(self) -> bool:
        return self.cfg.stochastic_rounding

    def convert_module(self, model: nn.Module) -> nn.Module:
        from amp_exp.training.precision_modes import to_bf16_true

        return to_bf16_true(model, self.kept_fp32)


PLUGIN = Bf16True
