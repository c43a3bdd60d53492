"""fp8: torchao's float8 matmuls in the linear layers the filters admit (precision.options.skip,
skip_small, precision.keep_fp32), everything else under bf16 autocast, as in ``precision=bf16``;
emulated on any device with precision.emulate=true (numerics only, never timed).

A linear layer is an ``nn.Linear`` or transformers' ``Conv1D`` (GPT-2's: x @ W + b with W stored
[in, out], a Linear with its weight transposed), which becomes a ``Float8Conv1D`` that takes that
weight as it is stored, so its parameter, its name and its layout stay what the optimizer and
checkpoints know.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from amp_exp.config.precisions import DType
from amp_exp.config.schema import DeviceChoice, Strategy
from amp_exp.errors import ConfigError, require
from amp_exp.training.precisions.base import LinearFormatPlugin, LinearOptions, linear_format_spec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from amp_exp.config.schema import PrecisionConfig, TrainerConfig


class Fp8Recipe(str, Enum):
    """torchao's Float8LinearConfig recipes, fastest to most accurate."""

    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_with_gw_hp = "rowwise_with_gw_hp"


@dataclass
class Fp8Options(LinearOptions):
    # torchao's recipe (Float8LinearConfig.from_recipe_name).
    recipe: Fp8Recipe = Fp8Recipe.tensorwise
    # Also keep the linears too small to gain, by torchao's H100 thresholds for the recipe
    # (torchtitan's auto_filter_small_kn); tensorwise and rowwise only.
    skip_small: bool = False


def require_fp8_hardware(device: torch.device, emulate: bool) -> None:
    """fp8 matmuls need compute capability 8.9+ (Ada, Hopper and newer) unless emulated."""
    import torch

    if emulate or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)):
        return
    where = "the CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    raise ConfigError(
        f"precision=fp8 needs a CUDA GPU with compute capability 8.9+, not {where}; " + Fp8.EMULATE
    )


class Fp8(LinearFormatPlugin):
    spec = linear_format_spec(
        "fp8",
        (DType.float8_e4m3fn, DType.float8_e5m2),
        peak_math="fp8",
        order=4,
        colour="#c44e52",
        strategies=frozenset({Strategy.ddp}),
        compile_on_cuda=True,
    )
    Options = Fp8Options
    variant_keys = ("emulate",)

    @classmethod
    def variant_label(cls, knobs: dict[str, Any]) -> str:
        options = knobs.get("options") or {}
        details = [str(options.get("recipe", Fp8Recipe.tensorwise.value))]
        if options.get("skip") == []:
            details.append("all linears")
        if options.get("skip_small"):
            details.append("large linears")
        if knobs.get("emulate"):
            details.append("emulated")
        return f"fp8 ({', '.join(details)})"

    @classmethod
    def check_config(cls, cfg: PrecisionConfig, trainer: TrainerConfig) -> None:
        """What fp8 needs that the config alone shows; the GPU's capability is checked at build."""
        super().check_config(cfg, trainer)
        require(
            trainer.device is not DeviceChoice.cpu or cfg.emulate,
            "precision=fp8 needs a CUDA GPU with compute capability 8.9+ (trainer.device=cpu); "
            + cls.EMULATE,
        )
        options: Fp8Options = cls.options_for(cfg)
        # torchao measured no size thresholds for this recipe (its _auto_filter_for_recipe).
        require(
            not options.skip_small or options.recipe is not Fp8Recipe.rowwise_with_gw_hp,
            "precision.options.skip_small=true has no size thresholds for "
            "precision.options.recipe=rowwise_with_gw_hp; valid recipes: tensorwise, rowwise",
        )

    @classmethod
    def check_device(cls, device: torch.device, cfg: PrecisionConfig) -> None:
        require_fp8_hardware(device, cfg.emulate)

    def convert_module(self, model: nn.Module) -> nn.Module:
        """Swap the planned linears for torchao ``Float8Linear`` (in place, weights kept)."""
        import torch
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from amp_exp.training.keep_fp32 import cast_floats
        from amp_exp.training.linears import is_conv1d, plan_linears, swap_linears

        def cast_to_cpu_autocast(module: nn.Module, args: tuple) -> tuple:
            """Float8Linear casts its input to the autocast dtype under CUDA's autocast only;
            emulated on the CPU it would take a first layer's fp32 input as it comes."""
            if not torch.is_autocast_enabled("cpu"):
                return args
            return cast_floats(args, torch.get_autocast_dtype("cpu"))

        model = super().convert_module(model)
        options: Fp8Options = self.options
        recipe = options.recipe.value
        skip_small_for = recipe if options.skip_small else None
        conversion = plan_linears(model, options.skip, skip_small_for, self.kept_fp32)
        self.adopt(conversion, f"fp8 ({recipe}{', emulated' if self.cfg.emulate else ''})")
        config = Float8LinearConfig.from_recipe_name(recipe)
        config = dataclasses.replace(config, emulate=self.cfg.emulate)
        chosen = set(conversion.converted)
        model = convert_to_float8_training(
            model, module_filter_fn=lambda _, name: name in chosen, config=config
        )
        conv1d = [name for name in chosen if is_conv1d(model.get_submodule(name))]
        swap_linears(model, conv1d, float8_conv1d_class(), config=config)
        for name in chosen:
            model.get_submodule(name).register_forward_pre_hook(cast_to_cpu_autocast)
        return model

    def inference_context(self) -> contextlib.AbstractContextManager:
        """torchao's Float8Linear fails under inference_mode (pytorch/ao#643): no_grad."""
        import torch

        return torch.no_grad()


@functools.cache
def float8_conv1d_class() -> type[nn.Module]:
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    class Float8Conv1D(Float8Linear):
        """``Float8Linear`` holding a ``Conv1D``'s weight as stored, [in, out]: the operand
        ``Float8Linear.forward`` makes of its own [out, in] weight by transposing it."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            import torch

            # As Float8Linear.forward (torchao 0.18), with the weight untransposed.
            if torch.is_autocast_enabled():
                input = input.to(torch.get_autocast_gpu_dtype())
            output = matmul_with_hp_or_float8_args.apply(
                input, self.weight, self.linear_mm_config, self.config
            )
            return output if self.bias is None else output + self.bias.to(output.dtype)

    return Float8Conv1D


PLUGIN = Fp8
