"""The op that went out of range: seen at the dispatch level, named by the module that ran it.

``OpRangeWatch`` is a ``TorchDispatchMode``: it sees every aten op after autocast chose its
dtypes, so an op that overflows in fp16 is seen as the op it is (``bmm``, ``mm``, ``exp``), inside
whichever module's forward ran it (``training.audit.modules.ModuleOps``), be it a Linear or a
plain function in an attention module's forward. An op overflowed when a low-precision output
(fewer than 4 bytes an element) holds an inf or nan that its inputs did not: the op is run again
with its floating inputs in fp32, and if that result is finite, its largest magnitude is what
the format could not hold. Ops that make an inf on purpose (a mask filled with -inf) make it in
fp32 too, and are not counted.

Only values an op computed are read: an allocation (``empty_like``, which dropout fills with its
mask afterwards) returns whatever the memory held, and is never checked. A fault is said to
exceed the format only where its fp32 value lies above the format's largest; one below the
format's smallest subnormal is an underflow, and one in between overflowed inside the op (an
intermediate the output does not show).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map

from amp_exp.config.precisions import DType
from amp_exp.predict.trace import ALLOCATIONS
from amp_exp.training.audit.modules import FORWARD, OUTSIDE, ModuleOps


@dataclass(frozen=True)
class OpFault:
    """The first op whose output went out of its format's range."""

    module: str
    op: str
    phase: str
    value: float
    dtype: str
    limit: float

    def text(self) -> str:
        where = self.module if self.phase == FORWARD else f"{self.module} ({self.phase})"
        fmt = DType(self.dtype).short
        found = f"{where}: {self.op} output {self.value:.1e}"
        if self.value > self.limit:
            return f"{found} exceeds {fmt}'s {self.limit:g}"
        smallest = subnormal(DType(self.dtype).torch)
        if self.value < smallest:
            return f"{found} underflows {fmt}'s smallest {smallest:.1e}"
        return f"{found} is within {fmt}'s range, but not finite in {fmt}: it overflowed inside"


def subnormal(dtype: torch.dtype) -> float:
    """The smallest positive value ``dtype`` holds."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def _low_precision(tensor: object) -> bool:
    return (
        isinstance(tensor, torch.Tensor)
        and not is_traceable_wrapper_subclass(tensor)
        and tensor.is_floating_point()
        and tensor.element_size() < 4
    )


def _finite(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            return True
        # float8 has no isfinite kernel; its values are exact in fp32.
        values = value.float() if value.element_size() == 1 else value
        return bool(torch.isfinite(values).all())
    return not isinstance(value, float) or math.isfinite(value)


def _in_fp32(value: object) -> object:
    """An op's argument for its fp32 rerun: floating tensors in fp32, and a low-precision dtype
    it was asked to cast to (autocast's casts are ``_to_copy`` ops) fp32."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, torch.dtype) and value.is_floating_point and value.itemsize < 4:
        return torch.float32
    return value


class OpRangeWatch(TorchDispatchMode):
    """Keeps the first op that overflowed while it is entered, named ``prefix`` + the module.

    ``model`` is the module being run; its own ops are named ``prefix``, its children's by
    their paths below it.
    """

    def __init__(self, model: nn.Module, prefix: str) -> None:
        super().__init__()
        self.modules = ModuleOps(model)
        self.prefix = prefix
        self.fault: OpFault | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.fault is None and func._overloadpacket not in ALLOCATIONS:
            self._check(func, args, kwargs, out)
        return out

    def _check(self, func, args: tuple, kwargs: dict, out: object) -> None:
        broken = [t for t in tree_leaves(out) if _low_precision(t) and not _finite(t)]
        if not broken or not all(_finite(value) for value in tree_leaves((args, kwargs))):
            return
        exact = func(*tree_map(_in_fp32, args), **tree_map(_in_fp32, kwargs))
        values = [t for t in tree_leaves(exact) if isinstance(t, torch.Tensor)]
        if not values or not all(_finite(t) for t in values):
            return
        module, phase = self.modules.current()
        if module in ("", OUTSIDE):
            module = self.prefix or "(outside the model)"
        elif self.prefix:
            module = f"{self.prefix}.{module}"
        dtype = broken[0].dtype
        self.fault = OpFault(
            module,
            func._overloadpacket.__name__,
            phase,
            max(float(t.detach().abs().max()) for t in values if t.numel()),
            DType.of(dtype).value,
            torch.finfo(dtype).max,
        )

    def __enter__(self) -> OpRangeWatch:
        self.modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.modules.__exit__(*exc)
