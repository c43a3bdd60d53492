"""What the three block-scaled precisions (mxfp8, mxfp4, nvfp4) share as plugins: the device
check, the model's conversion, the audit's expectations and what summary.json records.

Emulated (``precision.emulate=true``), they run on any device as torchao's casts followed by an
fp32 matmul (microscaling.linear), never timed. With the kernels, which only torchao's MXFP8
training has (compute capability 10.0+, Blackwell), mxfp8 runs torchao's ``MXFP8Linear`` and is
timed. torchao trains in neither MXFP4 nor NVFP4 (its NVFP4 is for inference), so those two are
always emulated. Like every plugin module, this one imports no torch at its top.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from enum import Enum
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any, ClassVar

from amp_exp.config.precisions import DType
from amp_exp.errors import require
from amp_exp.training.precisions.base import LinearFormatPlugin, linear_format_spec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from amp_exp.config.schema import PrecisionConfig, TrainerConfig
    from amp_exp.training.microscaling.linear import Recipe


QUOTE = '"'
# torchao's MXFP8 kernels: cuBLAS's block-scaled matmuls need compute capability 10.0.
KERNEL_CAPABILITY = (10, 0)


class ScaleMode(str, Enum):
    """How an MX block's power-of-two scale is rounded (torchao's ``ScaleCalculationMode``):
    floor is the OCP spec's; rceil (torchao's training default) never overflows an element."""

    floor = "floor"
    rceil = "rceil"
    ceil = "ceil"
    even = "even"


# A block-scaled precision's facts: its formats in the converted linears, bf16 autocast
# elsewhere; unlike fp8, whose emulation is checked on older GPUs, it needs native bf16.
microscaling_spec = functools.partial(linear_format_spec, needs_native_bf16=True)


class MicroscalingPlugin(LinearFormatPlugin):
    """A block-scaled format in the linears fp8 converts; the rest under bf16 autocast."""

    # The format of activations and weights (and, unless the options say otherwise, gradients).
    elements: ClassVar[DType]
    variant_keys = ("emulate",)

    @classmethod
    def lacks(cls, device: torch.device | None) -> str | None:
        """What ``device`` (None: any device) lacks to run this format for real, or None."""
        if cls.elements is not DType.mxfp8_e4m3:
            return "torchao has no MXFP4 or NVFP4 training kernels on any device"
        if device is not None and device.type == "cuda":
            import torch

            capable = torch.cuda.get_device_capability(device) >= KERNEL_CAPABILITY
            if capable and find_spec("triton") is not None:
                return None
        return "MXFP8 kernels need a CUDA GPU with compute capability 10.0+ (Blackwell) and Triton"

    @classmethod
    def variant_label(cls, knobs: dict[str, Any]) -> str:
        """ "nvfp4 (hadamard_wgrad=false, emulated)": the options set away from their defaults."""
        given = knobs.get("options") or {}
        defaults = json.loads(json.dumps(dataclasses.asdict(cls.Options())))
        details = [
            f"{key}={json.dumps(value).strip(QUOTE)}"
            for key, value in sorted(given.items())
            if key in defaults and value != defaults[key]
        ]
        if knobs.get("emulate"):
            details.append("emulated")
        return f"{cls.spec.name} ({', '.join(details)})" if details else cls.spec.name

    @classmethod
    def check_config(cls, cfg: PrecisionConfig, trainer: TrainerConfig) -> None:
        """Before torch loads: torchao, and precision.emulate=true where the config alone shows
        there can be no kernels (the CPU; MXFP4 and NVFP4 on any device)."""
        from amp_exp.config.schema import DeviceChoice

        super().check_config(cfg, trainer)
        if cls.elements is DType.mxfp8_e4m3 and trainer.device is not DeviceChoice.cpu:
            return
        where = "" if cls.elements is not DType.mxfp8_e4m3 else " (trainer.device=cpu)"
        require(
            cfg.emulate,
            f"precision={cls.spec.name} cannot run for real here{where}: {cls.lacks(None)}; "
            + cls.EMULATE,
        )

    @classmethod
    def check_device(cls, device: torch.device, cfg: PrecisionConfig) -> None:
        lacking = cls.lacks(device)
        require(
            lacking is None or cfg.emulate,
            f"precision={cls.spec.name} cannot run for real here: {lacking}; " + cls.EMULATE,
        )

    @property
    def emulated(self) -> bool:
        return self.cfg.emulate or self.lacks(self.device) is not None

    def gradients(self) -> DType:
        """The format of gradients: the elements', unless an option says otherwise."""
        return self.elements

    def recipe(self) -> Recipe:
        """The quantization of each matmul operand: the options named as ``Recipe``'s fields go
        to it as they are (a scale mode as torchao's)."""
        from torchao.prototype.mx_formats.config import ScaleCalculationMode

        from amp_exp.training.microscaling.linear import Recipe

        fields = [field.name for field in dataclasses.fields(Recipe)]
        given = {key: getattr(self.options, key) for key in fields if hasattr(self.options, key)}
        if "scale_mode" in given:
            given["scale_mode"] = ScaleCalculationMode(given["scale_mode"].value)
        return Recipe(self.elements, self.gradients(), **given)

    def convert_module(self, model: nn.Module) -> nn.Module:
        from amp_exp.training.linears import swap_linears
        from amp_exp.training.microscaling.convert import plan, with_kernels
        from amp_exp.training.microscaling.linear import MicroscalingLinear

        model = super().convert_module(model)
        # NVIDIA's recipe keeps the last blocks in bf16 (nvfp4's option).
        last_blocks = getattr(self.options, "bf16_last_blocks", 0)
        conversion = plan(model, self.options.skip, self.kept_fp32, last_blocks)
        self.adopt(conversion, f"{self.spec.name}{' (emulated)' if self.emulated else ''}")
        if not self.emulated:
            return with_kernels(model, conversion.converted, self.recipe())
        return swap_linears(model, conversion.converted, MicroscalingLinear, recipe=self.recipe())
