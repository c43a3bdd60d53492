"""PrecisionPlugin: the base class of every precision, its facts and its behaviour.

A precision is one subclass in one module (this folder's built-ins, an installed package's entry
point in group ``amp_exp.precisions``, or a user's class named by ``precision._target_``): its
``spec`` is the precision's row of facts (config.precisions.PrecisionSpec), its methods the
training behaviour, in the manner of Lightning Fabric's precision plugins: convert the model,
the forward context, backward, the optimizer step, the state a checkpoint keeps, inference and
what summary.json records. ``training.precision.PrecisionPolicy`` drives them around what every
precision shares (the GradScaler, unscale, clip, skipped steps).

A plugin module's top level imports no torch: the registry loads it to read the facts while the
config is validated, before torch loads. Methods import torch where they run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from amp_exp.config.precisions import PrecisionSpec, options_of

if TYPE_CHECKING:
    import torch
    from torch import nn

    from amp_exp.config.schema import PrecisionConfig, TrainerConfig
    from amp_exp.training.precision_modes import LinearConversion

log = logging.getLogger(__name__)


class PrecisionPlugin:
    """One precision: ``spec`` its facts, the methods its behaviour (defaults: autocast in
    ``spec.autocast_dtype``, a plain backward and optimizer step, nothing of its own to save)."""

    spec: ClassVar[PrecisionSpec]
    # A dataclass of this precision's own options (``precision.options.NAME``), or None.
    Options: ClassVar[type | None] = None
    # The ``precision.*`` keys that make a variant of it (its report label and cell name them).
    variant_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        cfg: PrecisionConfig,
        device: torch.device,
        kept_fp32: Sequence[str] = (),
        params_cast: bool = False,
    ) -> None:
        """``kept_fp32``: the modules that compute in fp32 whatever the precision.
        ``params_cast``: FSDP2's policy gathers the parameters in the compute dtype, so the
        forward runs in it without autocast (training.precision.PrecisionPolicy)."""
        self.cfg = cfg
        self.device = device
        self.kept_fp32 = list(kept_fp32)
        self.params_cast = params_cast
        self.options = options_of(type(self), getattr(cfg, "options", None))

    @property
    def uses_autocast(self) -> bool:
        return self.spec.autocast_dtype is not None and not self.params_cast

    @property
    def timed(self) -> bool:
        """Whether its throughput measures the precision (an emulated format's does not)."""
        return True

    @property
    def stochastic_rounding(self) -> bool:
        """Whether the optimizer must round its updates to bf16 stochastically."""
        return False

    @classmethod
    def variant_name(cls, cfg: PrecisionConfig) -> str:
        """The run's precision as conf/precision/ names it (a preset of its options)."""
        return cls.spec.name

    @classmethod
    def variant_label(cls, knobs: dict[str, Any]) -> str:
        """The report's label of a run from its ``precision.*`` values (its config's, as saved):
        the name and, in parentheses, what makes it a variant."""
        return cls.spec.name

    @classmethod
    def stall_advice(cls, knobs: dict[str, Any]) -> str:
        """Why a run of this variant (its ``precision.*`` values) whose weights stopped moving
        may have stalled, and what to do, in the report's words."""
        return "the learning rate may be too small for the weights' precision"

    @classmethod
    def check_config(cls, cfg: PrecisionConfig, trainer: TrainerConfig) -> None:
        """Refuse, in one ConfigError, what the config alone shows this precision cannot run;
        called while the config is validated, so it must not import torch."""

    @classmethod
    def check_device(cls, device: torch.device, cfg: PrecisionConfig) -> None:
        """Refuse, in one ConfigError, a device that cannot run this precision at all (a GPU
        without native bf16 is refused for ``spec.needs_native_bf16`` already)."""

    def convert_module(self, model: nn.Module) -> nn.Module:
        """The model as this precision trains it; called before the optimizer and any wrapper."""
        if self.uses_autocast:
            from amp_exp.training.keep_fp32 import run_without_autocast

            run_without_autocast(model, self.kept_fp32, self.device.type)
        return model

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Where the forward and the loss run."""
        if not self.uses_autocast:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=self.device.type, dtype=self.spec.autocast_dtype.torch)

    def inference_context(self) -> contextlib.AbstractContextManager:
        """The no-grad mode of evaluation."""
        import torch

        return torch.inference_mode()

    def backward(self, loss: torch.Tensor) -> None:
        """The backward of the (already loss-scaled) loss."""
        loss.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def converted_linears(self) -> list[str] | None:
        """The linears whose matmuls the audit expects in ``spec.engaged.converted_dtypes``, or
        None where the precision converts none."""
        return None

    def summary(self) -> dict[str, Any]:
        """summary.json fields this precision fills (results.summary.FIELDS): its
        ``precision_details``, a dict of whatever it records of its run."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this precision's own state (random streams, scales)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back ``state_dict()``'s state on resume."""


class LinearFormatPlugin(PrecisionPlugin):
    """A precision that runs the matmuls of some linears in a format of its own (fp8, the
    block-scaled formats), the rest under bf16 autocast: ``conversion`` records which, and why
    the others stay, for the audit, the log and summary.json."""

    conversion: LinearConversion | None = None

    def skipped_text(self) -> str:
        assert self.conversion is not None
        return ", ".join(f"{name}: {why}" for name, why in self.conversion.skipped.items())

    def refuse_if_nothing_converts(self) -> None:
        """Stop in one line where the filters left no linear to convert: no matmul would run
        in the format, and the run would measure bf16 under this precision's name."""
        from amp_exp.errors import ConfigError

        assert self.conversion is not None
        if not self.conversion.converted:
            raise ConfigError(
                f"precision={self.spec.name} converted no linear layer ("
                f"{self.skipped_text() or 'the model has none'}), so no matmul would run in "
                f"{self.spec.name}; use precision=bf16"
            )

    def announce(self, what: str) -> None:
        """Say what the conversion converted, and what it kept in bf16."""
        assert self.conversion is not None
        if self.conversion.emulated:
            log.warning(
                "%s is emulated (precision.emulate=true): slow, so not timed", self.spec.name
            )
        log.info(
            "%s: %d linear layers converted, %d kept in bf16 (%s)",
            what,
            len(self.conversion.converted),
            len(self.conversion.skipped),
            self.skipped_text() or "none",
        )

    def converted_linears(self) -> list[str] | None:
        return None if self.conversion is None else self.conversion.converted

    def summary(self) -> dict[str, Any]:
        if self.conversion is None:
            return {}
        return {
            "precision_details": {
                "emulated": self.conversion.emulated,
                "converted_linears": self.conversion.converted,
                "skipped_linears": self.conversion.skipped,
            }
        }
