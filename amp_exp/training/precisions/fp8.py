"""fp8: torchao's float8 matmuls in the linear layers the filters admit (precision.fp8_skip,
fp8_skip_small, keep_fp32), everything else under bf16 autocast; emulated on any device with
precision.emulate=true (numerics only, never timed)."""

from __future__ import annotations

import contextlib
import logging
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

from amp_exp.config.precisions import DType, Engagement, PrecisionSpec
from amp_exp.config.schema import DeviceChoice, Fp8Recipe, Strategy
from amp_exp.errors import ConfigError, require
from amp_exp.training.precisions.base import PrecisionPlugin

if TYPE_CHECKING:
    import torch
    from torch import nn

    from amp_exp.config.schema import PrecisionConfig, TrainerConfig
    from amp_exp.training.precision_modes import LinearConversion

log = logging.getLogger(__name__)


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


class Fp8(PrecisionPlugin):
    spec = PrecisionSpec(
        name="fp8",
        compute_dtype=DType.bfloat16,
        autocast_dtype=DType.bfloat16,
        weight_dtype=DType.float32,
        optimizer_state_dtype=DType.float32,
        grad_scaler=False,
        # fp8 matmuls peak at twice the bf16 rate, and its other ops run at bf16's.
        peak_math="fp8",
        probed_as=None,
        reduce_dtype=DType.float32,
        fsdp_param_dtype=None,
        strategies=frozenset({Strategy.ddp}),
        # As bf16 outside the converted linears: with autocast lost, the rest would run in
        # fp32 (emulated gpt_tiny, measured: 74% float8, 26% bf16, so 100% in these).
        engaged=Engagement(
            0.5,
            (DType.float8_e4m3fn, DType.float8_e5m2, DType.bfloat16),
            converted_dtypes=(DType.float8_e4m3fn, DType.float8_e5m2),
        ),
        order=4,
        colour="#c44e52",
        rankable=True,
        repair_to="bf16",
        compile_on_cuda=True,
    )

    variant_keys = ("emulate", "fp8_recipe", "fp8_skip", "fp8_skip_small")
    conversion: LinearConversion | None = None

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
        if not self.conversion.converted:
            raise ConfigError(self._converted_nothing())
        if self.conversion.emulated:
            log.warning("fp8 is emulated (precision.emulate=true): slow, so not timed")
        log.info(
            "fp8 (%s%s): %d linear layers converted, %d kept in bf16 (%s)",
            self.cfg.fp8_recipe.value,
            ", emulated" if self.conversion.emulated else "",
            len(self.conversion.converted),
            len(self.conversion.skipped),
            ", ".join(f"{name}: {why}" for name, why in self.conversion.skipped.items()) or "none",
        )
        return model

    def _converted_nothing(self) -> str:
        skipped = self.conversion.skipped if self.conversion else {}
        why = ", ".join(f"{name}: {reason}" for name, reason in skipped.items())
        first_last = any(reason in ("first layer", "last layer") for reason in skipped.values())
        return (
            f"precision=fp8 converted no linear layer ({why or 'the model has none'}), so no "
            "matmul would run in float8; use precision=bf16"
            + (" or precision.fp8_skip_first_last=false" if first_last else "")
        )

    def inference_context(self) -> contextlib.AbstractContextManager:
        """torchao's Float8Linear fails under inference_mode (pytorch/ao#643): no_grad."""
        import torch

        return torch.no_grad()

    def converted_linears(self) -> list[str] | None:
        return None if self.conversion is None else self.conversion.converted

    def summary(self) -> dict[str, Any]:
        if self.conversion is None:
            return {}
        emulated = self.conversion.emulated
        return {
            "fp8_emulated": emulated,
            "fp8_converted": self.conversion.converted,
            "fp8_skipped": self.conversion.skipped,
            "fp8_mfu_peak_source": (
                "null: emulated fp8 is not timed"
                if emulated
                else "null: fp8 matmuls peak at twice the bf16 rate, so MFU against a bf16 "
                "peak would overstate utilization"
            ),
        }


PLUGIN = Fp8
