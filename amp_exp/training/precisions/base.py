"""PrecisionPlugin: the base class of every precision, its facts, and the AMP step it drives.

A precision is one subclass in one module (this folder's built-ins, an installed package's entry
point in group ``amp_exp.precisions``, or a user's class named by ``precision._target_``): its
``spec`` is the precision's row of facts (config.precisions.PrecisionSpec), its hooks the training
behaviour, in the manner of Lightning Fabric's precision plugins: convert the model, the forward
context, backward, the optimizer step, the state a checkpoint keeps, inference and what
summary.json records. A hook a subclass defines is guarded (``__init_subclass__``): a fault of
its own code ends the run in one line naming the plugin (config.precisions.PluginHook).

Around the hooks the base drives what every precision shares, the pieces of the AMP step that
``Engine.train_step`` reads top to bottom: forward context -> scale -> backward -> unscale ->
clip -> step -> update. The GradScaler exists only where ``spec.grad_scaler`` (fp16: bf16 keeps
fp32's exponent range, so its gradients do not underflow). A step with non-finite gradients is
skipped on the device where the optimizer allows it (fused kernels take ``found_inf``), so no
step reads the device; the engine learns of skips at log steps.

A plugin module's top level imports no torch: the registry loads it to read the facts while the
config is validated, before torch loads. Methods import torch where they run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any, ClassVar

from amp_exp.config.plain import plain_run_config
from amp_exp.config.precisions import DType, Engagement, PluginHook, PrecisionSpec, get, options_of
from amp_exp.errors import require

if TYPE_CHECKING:
    import torch
    from torch import nn

    from amp_exp.config.schema import PrecisionConfig, TrainerConfig
    from amp_exp.training.linears import LinearConversion
    from amp_exp.training.stochastic_rounding import StochasticRoundingStep

log = logging.getLogger(__name__)

# The hooks a subclass may define that training calls, and of them those that hand back a context.
HOOKS = ("convert_module", "backward", "optimizer_step", "state_dict", "load_state_dict", "summary")
CONTEXTS = ("forward_context", "inference_context")


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
    import torch
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

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
    """A plugin's forward or inference context: a fault of the plugin's own in entering or
    leaving it is named as the plugin's (``PluginHook``); what the block raises passes through
    it as it is."""

    def __init__(self, plugin: PrecisionPlugin, hook: str, context: Any) -> None:
        self.plugin, self.hook, self.context = plugin, hook, context

    def __enter__(self) -> object:
        with PluginHook(self.plugin, self.hook):
            return self.context.__enter__()

    def __exit__(self, kind: type | None, error: BaseException | None, trace: object) -> bool:
        with PluginHook(self.plugin, self.hook, passing=error):
            return bool(self.context.__exit__(kind, error, trace))


def _guarded(method: Callable, hook: str) -> Callable:
    """``method``, a subclass's own ``hook``, with its faults (and those of a context it makes)
    named as the plugin's."""

    @functools.wraps(method)
    def guarded(self: PrecisionPlugin, *args: Any, **kwargs: Any) -> Any:
        with PluginHook(self, hook):
            made = method(self, *args, **kwargs)
        return PluginContext(self, hook, made) if hook in CONTEXTS else made

    return guarded


def create(
    name: str,
    cfg: PrecisionConfig,
    device: torch.device,
    *,
    keep_fp32: Sequence[str] = (),
    params_cast: bool = False,
    guard_nonfinite: bool = False,
) -> PrecisionPlugin:
    """The plugin of precision ``name`` for a run of ``cfg`` (whose options are its own only
    where ``cfg`` names it: sensitivity ranks other precisions from one run's config)."""
    plugin = get(name)
    with PluginHook(plugin, "__init__"):
        return plugin(cfg, device, keep_fp32, params_cast, guard_nonfinite)


class PrecisionPlugin:
    """One precision: ``spec`` its facts, the hooks its behaviour (defaults: autocast in
    ``spec.autocast_dtype``, a plain backward and optimizer step, nothing of its own to save),
    the rest the AMP step every precision shares."""

    spec: ClassVar[PrecisionSpec]
    # A dataclass of this precision's own options (``precision.options.NAME``), or None.
    Options: ClassVar[type | None] = None
    # The ``precision.options`` keys that make a variant of it (its report label and cell name
    # them).
    variant_keys: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for hook in (*HOOKS, *CONTEXTS):
            if hook in vars(cls):
                setattr(cls, hook, _guarded(vars(cls)[hook], hook))

    def __init__(
        self,
        cfg: PrecisionConfig,
        device: torch.device,
        kept_fp32: Sequence[str] = (),
        params_cast: bool = False,
        guard_nonfinite: bool = False,
    ) -> None:
        """``kept_fp32``: the modules (outermost names, training.keep_fp32.match_keep_fp32) that
        compute in fp32 whatever the precision; ``convert_module`` makes them do so, but under
        FSDP2, whose policy per module does it (runtime.fsdp). The precision audit attributes
        fp32 FLOPs to them and all inside them.

        ``params_cast``: FSDP2's mixed-precision policy already gathers the parameters in this
        precision's dtype and casts the model's inputs to it, so the forward runs in that dtype
        and autocast stays off. On top of it autocast would be a second caster with other
        rules: its matmul casts would find bf16/fp16 weights already, and its fp32 list would
        upcast what the policy means to run in the low dtype. One caster, the policy, as in
        torchtitan; the GradScaler stays.

        ``guard_nonfinite``: without a scaler, skip steps whose gradients are inf or NaN.
        """
        import torch

        from amp_exp.training.skips import ScaleRecord

        self.cfg, self.device, self.kept_fp32 = cfg, device, list(kept_fp32)
        self.params_cast, self.guard_nonfinite = params_cast, guard_nonfinite
        self.options = self.options_for(cfg)
        self.scaler: torch.amp.GradScaler | None = None
        if self.spec.grad_scaler:
            # The precision.* keys of the same names.
            knobs = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
            self.scaler = torch.amp.GradScaler(device.type, **{k: getattr(cfg, k) for k in knobs})
        self.scale_record = None if self.scaler is None else ScaleRecord()
        # Set when the optimizer's own kernels cannot round bf16 updates stochastically.
        self.rounding: StochasticRoundingStep | None = None
        # The flag of a parameter without a gradient this step.
        self._finite = torch.zeros((), device=device)

    @classmethod
    def options_for(cls, cfg: PrecisionConfig) -> Any:
        """Its ``Options`` under ``cfg``: ``cfg``'s own where ``cfg`` names this precision, else
        the defaults (sensitivity and predict take other precisions than the run's)."""
        return options_of(cls, cfg.options if cfg.name == cls.spec.name else None)

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

    # --- the hooks ------------------------------------------------------------------------------

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

    # --- what every precision shares: the AMP step's pieces, in Engine.train_step's order -------

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward starts from: fp16's multiplied by the GradScaler's scale, so
        that small gradients do not underflow; any other precision's as it is."""
        return loss if self.scaler is None else self.scaler.scale(loss)

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
        import torch

        from amp_exp.runtime.fsdp import local, whole

        clip_to = self.cfg.clip_grad_norm
        skips = self.scaler is not None or self.guard_nonfinite
        if not (skips or want_grad_norm or clip_to is not None):
            return Gradients()
        with_grads = [p for p in parameters if p.grad is not None]
        norms = per_tensor_norms([p.grad for p in with_grads])
        if not norms:
            return Gradients()
        # Of FSDP2's gradient shards the norms are DTensors: whole() sums them over the ranks.
        total = whole(torch.linalg.vector_norm(torch.stack(norms)))
        if clip_to is not None:
            torch.nn.utils.clip_grads_with_norm_(with_grads, clip_to, total)
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
        # The stochastic rounding's step replaces the plugin's.
        step = self.optimizer_step if self.rounding is None else self.rounding.step
        if self.scaler is not None:
            self.scaler.step(optimizer)
        elif found_inf is None:
            step(optimizer)
        elif getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale, optimizer.found_inf = None, found_inf  # type: ignore[attr-defined]
            try:
                step(optimizer)
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        elif not found_inf:
            step(optimizer)

    def update(self) -> None:
        """fp16's GradScaler backs its scale off after a skipped step and grows it after
        ``growth_interval`` finite ones; on the device, no read."""
        if self.scaler is not None:
            self.scaler.update()
            self.scale_record.add(self.scaler)

    def scale(self) -> float | None:
        """The current loss scale; reads the device, so call it only at log intervals."""
        return None if self.scaler is None else self.scaler.get_scale()

    def scale_reading(self) -> tuple[float | None, float | None]:
        """The current loss scale and its geometric mean over the steps since the last reading
        (None, None without a scaler); one host read, so call it only at log intervals."""
        return (None, None) if self.scaler is None else self.scale_record.read(self.scaler)

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps of the precision: its name, the scaler's and its own state."""
        return {
            "precision": self.spec.name,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "scale_record": None if self.scale_record is None else self.scale_record.state_dict(),
            "plugin": self.state_dict(),
        }

    def load_checkpoint_state(self, state: dict) -> None:
        """Take the scaler's state; a checkpoint of another precision keeps what still applies."""
        if state["precision"] == self.spec.name:
            if self.scaler is not None:
                self.scaler.load_state_dict(state["scaler"])
                # A checkpoint from before the record keeps none: the interval starts anew.
                if state.get("scale_record") is not None:
                    self.scale_record.load_state_dict(state["scale_record"], self.device)
            self.load_state_dict(state.get("plugin", {}))
            return
        if self.scaler is not None:
            kept = "a fresh GradScaler starts at precision.init_scale"
        elif state["scaler"] is not None:
            kept = "its GradScaler state is dropped"
        else:
            kept = "model, optimizer and schedule carry over unchanged"
        log.warning("resuming a %s checkpoint in %s: %s", state["precision"], self.spec.name, kept)

    def summary_fields(self) -> dict:
        """What summary.json records: the modules kept in fp32, the plugin's facts as a report
        shows them, and the plugin's own fields."""
        knobs = plain_run_config(self.cfg)
        with PluginHook(self, "summary"):
            facts = {
                "label": self.variant_label(knobs),
                "order": self.spec.order,
                "colour": self.spec.colour,
                "grad_scaler": self.spec.grad_scaler,
                "stall_advice": self.stall_advice(knobs),
            }
        return {"keep_fp32_modules": self.kept_fp32, "precision_facts": facts, **self.summary()}


def autocast_spec(name: str, dtype: DType, order: int, colour: str, **facts: Any) -> PrecisionSpec:
    """An autocast precision's facts: its matmuls in ``dtype`` over fp32 master weights and
    state, probed, a candidate of precision=auto, and one checkpoint family with fp32."""
    return PrecisionSpec(
        name=name,
        order=order,
        colour=colour,
        compute_dtype=dtype,
        autocast_dtype=dtype,
        peak_math=dtype.short,
        probed_as=dtype.short,
        fsdp_param_dtype=dtype,
        engaged=Engagement(0.5, (dtype,)),
        auto_candidate=True,
        autocast_family=True,
        rankable=True,
        **facts,
    )


def linear_format_spec(
    name: str, formats: tuple[DType, ...], peak_math: str, order: int, colour: str, **facts: Any
) -> PrecisionSpec:
    """The facts of a precision that runs converted linears in ``formats``: bf16 autocast
    elsewhere, fp32 master weights and state, no loss scaling (fp8 scales its tensors, the
    block-scaled formats every block)."""
    return PrecisionSpec(
        name=name,
        order=order,
        colour=colour,
        compute_dtype=DType.bfloat16,
        autocast_dtype=DType.bfloat16,
        # Its matmuls peak at its format's rate (fp8 or fp4), its other ops at bf16's; emulated,
        # it is never timed.
        peak_math=peak_math,
        # As bf16 outside the converted linears: with autocast lost, the rest would run in fp32
        # (emulated gpt_tiny, measured: 74% float8, 26% bf16, so 100% in these).
        engaged=Engagement(0.5, (*formats, DType.bfloat16), converted_dtypes=formats),
        rankable=True,
        repair_to="bf16",
        **facts,
    )


@dataclass
class LinearOptions:
    """The options of every precision that converts linears."""

    # Linears kept in bf16 by fully qualified name (fnmatch): the output layers of the built-in,
    # torchvision, timm and Hugging Face models (torchtitan keeps "output"); [] converts them all.
    skip: list[str] = field(
        default_factory=lambda: [
            *("lm_head", "head", "head.*", "fc", "classifier*", "output"),
            *("hf.lm_head", "hf.score", "hf.classifier*"),
        ]
    )


class LinearFormatPlugin(PrecisionPlugin):
    """A precision that runs the matmuls of some linears in a format of its own (fp8, the
    block-scaled formats), the rest under bf16 autocast: ``conversion`` records which, and why
    the others stay, for the audit, the log and summary.json."""

    # How a refusal of a format the device cannot run ends.
    EMULATE = "add precision.emulate=true to emulate it (slow, not timed)"
    conversion: LinearConversion | None = None

    @classmethod
    def check_config(cls, cfg: PrecisionConfig, trainer: TrainerConfig) -> None:
        """torchao, whose casts or matmuls every such format runs."""
        require(
            find_spec("torchao") is not None,
            f"precision={cls.spec.name} needs torchao, which is not installed: "
            "pip install 'amp_exp[fp8]'",
        )

    @property
    def emulated(self) -> bool:
        return self.cfg.emulate

    @property
    def timed(self) -> bool:
        """An emulated format measures numerics, not speed: its throughput is never reported."""
        return not self.emulated

    def adopt(self, conversion: LinearConversion, what: str) -> None:
        """Take ``conversion`` and say what it converted and what it kept in bf16. Stop in one
        line where the filters left no linear to convert: no matmul would run in the format,
        and the run would measure bf16 under this precision's name."""
        self.conversion = conversion
        conversion.emulated = self.emulated
        skipped = ", ".join(f"{name}: {why}" for name, why in conversion.skipped.items())
        require(
            bool(conversion.converted),
            f"precision={self.spec.name} converted no linear layer ("
            f"{skipped or 'the model has none'}), so no matmul would run in "
            f"{self.spec.name}; use precision=bf16",
        )
        if self.emulated:
            log.warning(
                "%s is emulated (precision.emulate=true): slow, so not timed", self.spec.name
            )
        log.info(
            "%s: %d linear layers converted, %d kept in bf16 (%s)",
            what,
            len(conversion.converted),
            len(conversion.skipped),
            skipped or "none",
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
