"""The precision registry: every precision's facts, found from its plugin, by name, and the
plugin's own options (``options_of``); the precision section's other rules are config/values.py's
and config/cross_checks.py's.

A precision is one plugin (a module of amp_exp/training/precisions/, a class subclassing
``PrecisionPlugin``): its ``spec`` is the frozen row of facts defined here, read by everything
that depends on which precision runs (the AMP step, FSDP2's mixed-precision policy, the probe and
``precision=auto``, the datasheet peak behind MFU, the validation of strategies, what a run must
show to count as engaged, the report's order, labels and colours); its methods are the
behaviour, which only training calls. The registry finds the built-in plugins in that folder,
those of installed packages (entry point group ``amp_exp.precisions``), and a user's own named by
``precision._target_`` (``register``); ``get`` and ``names`` are how every other module asks.
It is the only place that knows which precisions exist.

It sits beside the schema as a leaf because the config's validation and the runtime's FSDP2
wrapper, which sit below training/, read the facts. It loads plugin modules by name, as it does a
user's, and a plugin module's top level imports only this module and the plugin base, never
torch (tests/test_precision_registry.py), so a bad value is still refused before torch loads.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import pkgutil
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any

from amp_exp.config.schema import (
    SensitivityConfig,
    Strategy,
)
from amp_exp.errors import (
    EXPECTED_ERRORS,
    ConfigError,
    RuntimeFault,
    first_line,
    require_choice,
)


class DType(str, Enum):
    """A torch dtype by torch's own name, without ``torch.``."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float8_e4m3fn = "float8_e4m3fn"
    float8_e5m2 = "float8_e5m2"
    # Block-scaled formats (training/microscaling), named as the audit counts their matmuls:
    # small elements with a scale per block, which no torch dtype holds.
    mxfp8_e4m3 = "mxfp8_e4m3"
    mxfp8_e5m2 = "mxfp8_e5m2"
    mxfp4 = "mxfp4"
    nvfp4 = "nvfp4"

    @property
    def torch(self) -> Any:
        """The ``torch.dtype`` (imports torch); a block-scaled format has none."""
        import torch

        if self.block_scaled:
            raise ValueError(f"{self.value} is a block-scaled format, not a torch dtype")
        return getattr(torch, self.value)

    @property
    def block_scaled(self) -> bool:
        return self in BLOCK_FORMATS

    @property
    def block(self) -> BlockFormat:
        """A block-scaled format's layout (raises for a torch dtype)."""
        return BLOCK_FORMATS[self]

    @property
    def itemsize(self) -> float:
        """Bytes per element (a block-scaled format's elements, without their scales)."""
        if self.block_scaled:
            return self.block.bits / 8
        return self.torch.itemsize

    @property
    def short(self) -> str:
        """The config's name for it: fp32, bf16, fp16, fp8_e4m3fn."""
        return SHORT_NAMES.get(self, self.value.replace("float8", "fp8"))

    @classmethod
    def of(cls, dtype: Any) -> DType:
        """The member naming a ``DType``."""
        return cls(str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class BlockFormat:
    """How a block-scaled format stores a tensor: ``bits`` per element, one scale per ``size``
    consecutive elements of a row, and ``scale_range``, the largest block scale over the smallest
    positive one. A block's scale follows its own maximum, so no element runs out of the
    element format's range; the scales can: a tensor whose blocks' maxima spread wider than
    ``scale_range`` flushes its smallest blocks to zero."""

    bits: int
    size: int
    scale_range: float


# MX (OCP Microscaling v1.0): 32-element blocks, E8M0 scales 2^-127 to 2^127. NVFP4: 16-element
# blocks, E4M3 scales under a tensor scale that puts the largest at E4M3's 448, the smallest
# positive being its subnormal 2^-9.
_MX_SCALES, _NVFP4_SCALES = 2.0**254, 448 * 2.0**9
BLOCK_FORMATS = {
    DType.mxfp8_e4m3: BlockFormat(8, 32, _MX_SCALES),
    DType.mxfp8_e5m2: BlockFormat(8, 32, _MX_SCALES),
    DType.mxfp4: BlockFormat(4, 32, _MX_SCALES),
    DType.nvfp4: BlockFormat(4, 16, _NVFP4_SCALES),
}
SHORT_NAMES = {DType.float32: "fp32", DType.bfloat16: "bf16", DType.float16: "fp16"}


@dataclass(frozen=True)
class Engagement:
    """What the precision audit of a run must find for the mode to count as having run."""

    # The smallest share of matmul FLOPs that must run in one of ``matmul_dtypes``.
    min_matmul_share: float
    matmul_dtypes: tuple[DType, ...]
    # Every linear the plugin converted (``converted_linears()``) must run matmuls in one of
    # these (fp8's float8 dtypes); () checks none.
    converted_dtypes: tuple[DType, ...] = ()
    # Most weight elements must be stored in this dtype (bf16_true; its norm layers keep fp32
    # by design, a tiny share), or None.
    weights: DType | None = None


@dataclass(frozen=True)
class PrecisionSpec:
    """One precision's facts; the defaults are fp32's, so a plugin states only what differs."""

    # Its name in the config (precision=NAME) and in every record of a run.
    name: str
    # Where it comes in the report and, among auto's candidates, in the order a tie is broken.
    order: int
    # The report's and the plots' colour (matplotlib colour string).
    colour: str
    # The dtype of the matmuls outside fp8's converted linears, under autocast or (bf16_true) not.
    compute_dtype: DType = DType.float32
    # The dtype autocast runs in; None where the mode uses no autocast.
    autocast_dtype: DType | None = None
    # The dtype the optimizer updates (master weights) and keeps its state in.
    weight_dtype: DType = DType.float32
    optimizer_state_dtype: DType = DType.float32
    # Dynamic loss scaling with torch.amp.GradScaler.
    grad_scaler: bool = False
    # Which datasheet peak its matmuls can reach (training.flops): fp32 reads TF32 when allowed.
    peak_math: str = "fp32"
    # The probed kernels it runs (the name of a precision the probe times: fp32 or one with an
    # autocast dtype); pure bf16 computes as bf16 autocast does; None: not probed.
    probed_as: str | None = None
    # The dtype gradients are summed over the ranks in, under DDP and FSDP2 alike (a sum of many
    # low-precision gradients loses their small parts).
    reduce_dtype: DType = DType.float32
    # FSDP2 under precision.fsdp_cast_params: the dtype its policy gathers parameters in, to run
    # the forward without autocast (None: the mode has nothing to cast to). Off by default, FSDP2
    # gathers the stored weights and autocasts, the computation of DDP and of one process.
    fsdp_param_dtype: DType | None = None
    # The torchrun strategies it runs under.
    strategies: frozenset[Strategy] = frozenset(Strategy)
    engaged: Engagement = Engagement(1.0, (DType.float32,))
    # A candidate of precision=auto's trial.
    auto_candidate: bool = False
    # A precision sensitivity ranks layers under, and the one its repair moves a layer up to
    # when keeping it in fp32 is not needed (None: fp32).
    rankable: bool = False
    repair_to: str | None = None
    # A checkpoint moves between the precisions of this family (results/resume.py): fp32
    # master weights and state, and a model they do not convert (bf16_true's bf16 weights and
    # fp8's Float8Linear layers are families of their own).
    autocast_family: bool = False
    # Its matmuls need a GPU with native bf16 (compute capability 8.0+).
    needs_native_bf16: bool = False
    # Fast on CUDA only under torch.compile (trainer.compile=auto compiles it there).
    compile_on_cuda: bool = False


# The precision everything is measured against: the baseline of verdicts, the reference of
# sensitivity and repairs, and the fallback of precision=auto.
REFERENCE = "fp32"
# Not a precision: the selector that times the candidates and picks one (capability/auto.py).
AUTO = "auto"
BUILTIN_PACKAGE = "amp_exp.training.precisions"
ENTRY_POINT_GROUP = "amp_exp.precisions"
# Modules of the built-in folder that are not plugins.
NOT_PLUGINS = frozenset({"base"})
# Where the base classes live: their code is amp_exp's, whichever plugin it runs for.
BASE_MODULE = f"{BUILTIN_PACKAGE}.base"

# name -> plugin class (``spec`` its facts); filled on first use.
_plugins: dict[str, Any] = {}
_found: set[str] = set()
# The plugins of amp_exp's own folder, whose names no other plugin may take.
_builtin_plugins: set[Any] = set()


def _add(plugin: Any, source: str, named: str | None = None) -> PrecisionSpec:
    """Register ``plugin`` (from ``source``; ``named``: the name its entry point gives it). A
    plugin from outside amp_exp never takes a built-in's name: the built-in would silently run
    in its place, or it in the built-in's, in every run and report that names it."""
    spec = getattr(plugin, "spec", None)
    if not isinstance(spec, PrecisionSpec):
        raise ConfigError(f"{source} is not a precision plugin: it has no PrecisionSpec `spec`")
    if spec.name == AUTO:
        raise ConfigError(f"{source}: `auto` is the selector, not a precision name")
    for name in dict.fromkeys([named or spec.name, spec.name]):
        if plugin not in _builtin_plugins and name in _builtin_names():
            raise ConfigError(
                f"{source} takes the name {name!r} of a built-in precision; give it a name of its "
                "own (its spec.name, and its entry point's name)"
            )
    if named is not None and named != spec.name:
        raise ConfigError(
            f"{source} is named {named!r} but defines precision {spec.name!r}; name the entry "
            "point as its spec.name"
        )
    known = _plugins.get(spec.name)
    if known is not None and known is not plugin:
        raise ConfigError(
            f"{source} defines precision {spec.name!r}, which {known.__module__} already defines"
        )
    _plugins[spec.name] = plugin
    return spec


def _builtins() -> None:
    if "builtins" in _found:
        return
    _found.add("builtins")
    folder = Path(__file__).resolve().parent.parent / "training" / "precisions"
    for module in pkgutil.iter_modules([str(folder)]):
        if module.name not in NOT_PLUGINS:
            loaded = importlib.import_module(f"{BUILTIN_PACKAGE}.{module.name}")
            _builtin_plugins.add(loaded.PLUGIN)
            _add(loaded.PLUGIN, f"{BUILTIN_PACKAGE}.{module.name}")


def _builtin_names() -> set[str]:
    _builtins()
    return {name for name, plugin in _plugins.items() if plugin in _builtin_plugins}


def _entry_points() -> None:
    if "entry_points" in _found:
        return
    _found.add("entry_points")
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        _add(entry.load(), f"entry point {entry.name} ({entry.value})", named=entry.name)


def register(target: str) -> PrecisionSpec:
    """Add the plugin class at dotted path ``target`` (``precision._target_``); its facts."""
    module_name, _, attr = target.rpartition(".")
    try:
        plugin = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"precision._target_={target} cannot be imported: {error}") from None
    return _add(plugin, f"precision._target_={target}")


def names() -> tuple[str, ...]:
    """Every known precision, in the report's order."""
    _builtins()
    _entry_points()
    return tuple(sorted(_plugins, key=lambda name: (_plugins[name].spec.order, name)))


def get(name: str) -> Any:
    """The plugin class of a resolved precision (``spec`` its facts); ConfigError naming the
    valid ones."""
    if name == AUTO:
        raise ValueError("resolve precision=auto first (capability.auto)")
    # Every source, also for a built-in's name: an installed plugin that takes it is refused
    # (``_add``), never passed over because the built-in was found first.
    require_choice(name, (AUTO, *names()), f"precision={name} is not a precision")
    return _plugins[name]


def auto_candidates() -> tuple[str, ...]:
    """precision=auto's candidates, in the order a tie is broken."""
    return tuple(name for name in names() if get(name).spec.auto_candidate)


def probed_low() -> tuple[str, ...]:
    """The low precisions the probe times and precision=auto may choose, in tie-break order."""
    return tuple(p for p in auto_candidates() if p != REFERENCE)


def rankable() -> list[str]:
    """The precisions whose per-module error against fp32 sensitivity measures (their facts)."""
    return [name for name in names() if get(name).spec.rankable]


def target_precisions(sensitivity: SensitivityConfig, precision: str) -> list[str]:
    """The precisions sensitivity ranks, in order: the first is the one repair targets. Unless
    sensitivity.precisions or a rankable ``precision`` says which: the rankable ones
    precision=auto may choose, those with a GradScaler (the narrowest range, where most layers
    fail) first."""
    if sensitivity.precisions:
        return list(dict.fromkeys(sensitivity.precisions))
    if precision in rankable():
        return [precision]
    chosen = [name for name in rankable() if get(name).spec.auto_candidate]
    return sorted(chosen, key=lambda name: not get(name).spec.grad_scaler)


def options_of(plugin: Any, given: Any) -> Any:
    """``precision.options`` as the plugin's ``Options`` dataclass; ConfigError on a key it does
    not declare or a value of the wrong type (checked at config time, before torch loads)."""
    given = dict(given or {})
    if plugin.Options is None:
        if given:
            raise ConfigError(
                f"precision={plugin.spec.name} takes no precision.options, got {sorted(given)}"
            )
        return None
    fields = {f.name: f for f in dataclasses.fields(plugin.Options)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ConfigError(
            f"precision.options.{unknown[0]} is not an option of precision={plugin.spec.name}; "
            f"valid options: {', '.join(fields) or 'none'}"
        )
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    try:
        merged = OmegaConf.merge(OmegaConf.structured(plugin.Options), given)
    except ValidationError as error:
        where = f"precision.options.{error.full_key}" if error.full_key else "precision.options"
        raise ConfigError(
            f"{where} of precision={plugin.spec.name}: {str(error).splitlines()[0]}"
        ) from None
    return OmegaConf.to_object(merged)


class PluginHook:
    """A call into one of a plugin's hooks (``with PluginHook(plugin, "backward"): ...``): an
    exception the plugin's own code raised ends the command as a runtime fault (exit 4) in one
    line naming the plugin's class and module, not a traceback and exit 1. What the plugin
    raises on purpose (``ConfigError``, ``NumericalFault``...) passes as it is, and so does what
    the code a hook only calls into raised by itself (the model's forward or backward, torch):
    the plugin is named only when one of its own files is on the failing call's stack.
    ``passing`` is never blamed: the block's exception going through a context's ``__exit__``."""

    def __init__(self, plugin: Any, hook: str, passing: BaseException | None = None) -> None:
        self.plugin = plugin if isinstance(plugin, type) else type(plugin)
        self.hook, self.passing = hook, passing

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type | None, error: BaseException | None, trace: TracebackType | None
    ) -> bool:
        if (
            isinstance(error, Exception)
            and not isinstance(error, EXPECTED_ERRORS)
            and error is not self.passing
            and _raised_in(self.plugin, trace)
        ):
            raise RuntimeFault(
                f"precision plugin {self.plugin.__qualname__} ({self.plugin.__module__}) raised "
                f"{type(error).__name__} in {self.hook}: {first_line(str(error))}"
            ) from error
        return False


def _raised_in(plugin: type, trace: TracebackType | None) -> bool:
    """Whether a file of ``plugin``'s own classes (not amp_exp's base classes) is on ``trace``."""
    own = {
        getattr(sys.modules.get(cls.__module__), "__file__", None)
        for cls in plugin.__mro__
        if cls.__module__ not in (BASE_MODULE, "builtins")
    }
    return any(frame.f_code.co_filename in own for frame, _ in traceback.walk_tb(trace))


@dataclass(frozen=True)
class ResolvedPrecision:
    """The precision a run trains in, and why: as requested, chosen by precision=auto
    (capability/auto.py), or kept from a checkpoint (results/resume.py)."""

    precision: str
    reason: str
    # precision=auto timed the run's own model in this precision: that timing, not the probe's
    # generic kernels, speaks for its speed, so the probe's warning about it is not given.
    timed_on_model: bool = False
    # The speed trial's speedups over fp32 that chose it (speed.json's form), by precision.
    speedups: Mapping[str, Any] = field(default_factory=dict)
