"""fp8: torchao's float8 matmuls in the linear layers the filters admit (precision.fp8_skip,
fp8_skip_small, keep_fp32), everything else under bf16 autocast; emulated on any device with
precision.emulate=true (numerics only, never timed)."""

from __future__ import annotations

import contextlib
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

from amp_exp.config.precisions import DType, Engagement, PrecisionSpec
from amp_exp.config.schema import DeviceChoice, Fp8Recipe, Strategy
from amp_exp.errors import ConfigError, require
from amp_exp.training.precisions.base import LinearFormatPlugin

if TYPE_CHECKING:
    import torch
    from torch import nn

    from amp_exp.config.schema import PrecisionConfig, TrainerConfig


def require_fp8_hardware(device: torch.device, emulate: bool) -> None:
    """fp8 matmuls need compute capability 8.9+ (Ada, Hopper and newer) unless emulated."""
    import torch

    if emulate or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)):
        return
    where = "the CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    raise ConfigError(
        f"precision=fp8 needs a CUDA GPU with compute capability 8.9+, not {where}; "
        "add precision.emulate=true to emulate it (slow, not timed)"
    )


class Fp8(LinearFormatPlugin):
    spec = PrecisionSpec(
        name="fp8",
        order=4,
        colour="#c44e52",
        compute_dtype=DType.bfloat16,
        autocast_dtype=DType.bfloat16,
        # fp8 matmuls peak at twice the bf16 rate, and its other ops run at bf16's.
        peak_math="fp8",
        strategies=frozenset({Strategy.ddp}),
        # As bf16 outside the converted linears: with autocast lost, the rest would run in
        # fp32 (emulated gpt_tiny, measured: 74% float8, 26% bf16, so 100% in these).
        engaged=Engagement(
            0.5,
            (DType.float8_e4m3fn, DType.float8_e5m2, DType.bfloat16),
            converted_dtypes=(DType.float8_e4m3fn, DType.float8_e5m2),
        ),
        rankable=True,
        repair_to="bf16",
        compile_on_cuda=True,
    )

    variant_keys = ("emulate", "fp8_recipe", "fp8_skip", "fp8_skip_small")

    @property
    def timed(self) -> bool:
        """Emulated fp8 measures numerics, not speed: its throughput is never reported."""
        return not self.cfg.emulate

    @classmethod
    def variant_label(cls, knobs: dict[str, Any]) -> str:
        details = [str(knobs.get("fp8_recipe", "tensorwise"))]
        if knobs.get("fp8_skip") == []:
            details.append("all linears")
        if knobs.get("fp8_skip_small"):
            details.append("large linears")
        if knobs.get("emulate"):
            details.append("emulated")
        return f"fp8 ({', '.join(details)})"

    @classmethod
    def check_config(cls, cfg: PrecisionConfig, trainer: TrainerConfig) -> None:
        """What fp8 needs that the config alone shows; the GPU's capability is checked at build."""
        require(
            find_spec("torchao") is not None,
            "precision=fp8 needs torchao, which is not installed: pip install 'amp_exp[fp8]'",
        )
        require(
            trainer.device is not DeviceChoice.cpu or cfg.emulate,
            "precision=fp8 needs a CUDA GPU with compute capability 8.9+ (trainer.device=cpu); "
            "add precision.emulate=true to emulate it (slow, not timed)",
        )
        # torchao measured no size thresholds for this recipe (its _auto_filter_for_recipe).
        require(
            not cfg.fp8_skip_small or cfg.fp8_recipe is not Fp8Recipe.rowwise_with_gw_hp,
            "precision.fp8_skip_small=true has no size thresholds for "
            "precision.fp8_recipe=rowwise_with_gw_hp; valid recipes: tensorwise, rowwise",
        )

    @classmethod
    def check_device(cls, device: torch.device, cfg: PrecisionConfig) -> None:
        require_fp8_hardware(device, cfg.emulate)

    def convert_module(self, model: nn.Module) -> nn.Module:
        from amp_exp.training.precision_modes import convert_to_fp8

        model = super().convert_module(model)
        model, self.conversion = convert_to_fp8(model, self.cfg, self.kept_fp32)
        self.refuse_if_nothing_converts()
        emulated = ", emulated" if self.conversion.emulated else ""
        self.announce(f"fp8 ({self.cfg.fp8_recipe.value}{emulated})")
        return model

    def inference_context(self) -> contextlib.AbstractContextManager:
        """torchao's Float8Linear fails under inference_mode (pytorch/ao#643): no_grad."""
        import torch

        return torch.no_grad()


PLUGIN = Fp8
