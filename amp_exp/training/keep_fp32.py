"""``precision.keep_fp32``: the modules, named by globs, that run in fp32 whatever the precision.

The globs (``fnmatch``, case-sensitive, ``*`` crossing dots) are matched against the model's
``named_modules()`` once the model is built, before anything else is done with it: a pattern that
matches nothing stops the run with one line naming the nearest module names. A match keeps its
whole subtree, so only the outermost matches are acted on.

How each mode keeps them (the plugin's ``convert_module`` and ``runtime.fsdp``):

- under autocast (fp16, bf16, and fp8 outside its float8 linears) the module runs with autocast
  off, its float inputs cast to fp32. Its output stays fp32: the next op under autocast casts it
  as autocast would cast any fp32 tensor (a matmul to the low dtype, the ops on its fp32 list not
  at all, an addition promotes to fp32), whereas casting it back here would undo the range the
  module was kept for: an activation above 65504 kept in fp32 to be normalized next would be inf
  again in fp16.
- bf16_true keeps its parameters fp32, as it does the norm layers (its plugin's
  ``convert_module``); there the output goes back to bf16, which the next layer's bf16 weights
  need, and bf16 has fp32's range.
- fp8 leaves its linears unconverted (and runs it without autocast, as above).
- FSDP2 gives it a mixed-precision policy of its own: fp32 parameters, inputs cast to fp32, the
  output cast back to the forward's dtype (the next layer's gathered parameters are in it).

The outermost names kept are ``PrecisionPlugin.kept_fp32`` and summary.json's
``keep_fp32_modules``: what a precision audit attributes fp32 FLOPs to (every module within one,
``is_within``), and what the sensitivity command's repair reports the FLOP share of.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from amp_exp.errors import ConfigError

# Nearest names a refused pattern lists.
NEAREST = 3
# Kept in fp32 by bf16_true (and as the roofline predicts it): BatchNorm's running statistics are
# moving averages whose small increments round away in bf16, as weight updates do, and reductions
# over a whole batch or feature dimension lose digits in bf16; their parameters are a tiny share
# of any model, so bf16 would save almost nothing. PyTorch does run BatchNorm in bf16; keeping it
# fp32 is the safer of two working choices.
NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def cast_floats(value, dtype: torch.dtype):
    """``value`` with each floating-point tensor in it (nested in tuples, lists and dicts) cast."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def keeps_fp32(module: nn.Module) -> bool:
    """A norm layer, or a module that sets ``keep_in_fp32 = True``."""
    return isinstance(module, NORM_LAYERS) or getattr(module, "keep_in_fp32", False)


def outermost(names: Iterable[str]) -> list[str]:
    """``names`` without those inside another of them (``a.b`` goes when ``a`` is there)."""
    kept: list[str] = []
    for name in sorted(set(names)):
        if not any(name.startswith(outer + ".") for outer in kept):
            kept.append(name)
    return kept


def is_within(name: str, kept: Iterable[str]) -> bool:
    """Whether module ``name`` is one of ``kept`` or lies inside one."""
    return any(name == outer or name.startswith(outer + ".") for outer in kept)


def match_keep_fp32(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The outermost modules of ``model`` the globs match, or ``ConfigError`` naming the first
    pattern that matches none and the nearest names. The root is never matched: a model kept
    whole in fp32 is ``precision=fp32``."""
    names = [name for name, _ in model.named_modules() if name]
    matched: list[str] = []
    for pattern in patterns:
        found = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not found:
            nearest = difflib.get_close_matches(pattern, names, n=NEAREST, cutoff=0.0)
            raise ConfigError(
                f"precision.keep_fp32: {pattern!r} matches no module of the model; nearest "
                f"names: {', '.join(nearest) or 'none (the model has no submodules)'}"
            )
        matched += found
    return outermost(matched)


class AutocastOff:
    """Forward hooks that run one module with autocast off and its float inputs in fp32.

    Hooks rather than a replaced ``forward``: they survive ``copy.deepcopy`` of the model (a
    copied closure would still call the original module), and ``always_call`` restores the
    autocast state however the forward ends.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        # One entry per forward in progress (a module may be called inside itself).
        self.enabled_before: list[bool] = []

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.enabled_before.append(torch.is_autocast_enabled(self.device_type))
        torch.set_autocast_enabled(self.device_type, False)
        return cast_floats((args, kwargs), torch.float32)

    def leave(self, module: nn.Module, args: tuple, output) -> None:
        torch.set_autocast_enabled(self.device_type, self.enabled_before.pop())


def run_without_autocast(model: nn.Module, kept: Sequence[str], device_type: str) -> None:
    """Make each kept module of ``model`` compute in fp32 under autocast (output left fp32)."""
    for name in kept:
        module, hooks = model.get_submodule(name), AutocastOff(device_type)
        module.register_forward_pre_hook(hooks.enter, with_kwargs=True)
        module.register_forward_hook(hooks.leave, always_call=True)
