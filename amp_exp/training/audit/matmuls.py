"""The dtype every matmul of a training step ran in, its FLOPs, and the module it ran in.

``MatmulRecorder`` is a ``TorchDispatchMode``: it sees each aten op after autocast, the
FSDP2 casts and a model's own casts have chosen its inputs, so what it records is what ran,
not what was asked for. A matmul-class op is one that ``torch.utils.flop_counter`` has a FLOP
formula for (mm, addmm, bmm, baddbmm, ``_scaled_mm``, convolutions and their backward,
scaled-dot-product, flash and memory-efficient attention); its FLOPs are that formula's. The
module is the one whose forward ran it, and the phase forward, backward or recompute
(activation checkpointing's second forward), as ``audit.modules.ModuleOps`` tells them.

torchao's float8 linears hand the mode ``aten.mm`` on ``Float8TrainingTensor`` operands (a
wrapper subclass, whose dtype is the original one): an operand's dtype is that of the largest
tensor it wraps (its float8 data, not its fp32 scale). The subclass's own inner ops (the
dequantized fp32 mm of torchao's emulation, or ``_scaled_mm`` on a GPU) run inside the
subclass, where the mode does not see them, so a float8 matmul counts once, as float8.

An emulated block-scaled matmul (training/microscaling) multiplies dequantized fp32 values that
stand for a narrower format's; it runs under ``computed_as``, and counts as that format.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.flop_counter import flop_registry

from amp_exp.training.audit.modules import BACKWARD, FORWARD, RECOMPUTE, ModuleOps

aten = torch.ops.aten

# The CPU's fused attention kernels have no formula of their own in torch 2.14: they take and
# return what the flash kernels do, so the flash formulas count them.
CPU_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu": aten._scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        aten._scaled_dot_product_flash_attention_backward
    ),
}
FORMULAS: dict[Any, Any] = {
    **{getattr(aten, name): flop_registry[like] for name, like in CPU_ATTENTION.items()},
    **flop_registry,
}
# Which arguments are the multiplied operands, where they are not the first two: addmm's first
# is the added term; convolution_backward's first is the incoming gradient (of the same dtype).
OPERANDS = {aten.addmm: (1, 2), aten.baddbmm: (1, 2), aten.convolution_backward: (1, 2)}
PHASES = (FORWARD, BACKWARD, RECOMPUTE)
_COMPUTED_AS: ContextVar[str | None] = ContextVar("computed_as", default=None)


@contextmanager
def computed_as(fmt: str) -> Iterator[None]:
    """The matmuls run inside count as computed in ``fmt`` (an emulated format's name)."""
    token = _COMPUTED_AS.set(fmt)
    try:
        yield
    finally:
        _COMPUTED_AS.reset(token)


def dtype_name(dtype: torch.dtype) -> str:
    """As torch names it, without ``torch.``: bfloat16, float8_e4m3fn."""
    return str(dtype).removeprefix("torch.")


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold a tensor's values: itself, or those a wrapper subclass wraps."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return [plain for name in names for plain in plain_tensors(getattr(tensor, name))]


def operand_dtype(packet: Any, args: tuple) -> torch.dtype:
    """The dtype a matmul computed in: that of its widest operand (float8 e5m2 gradients meet
    e4m3 weights in torchao's backward; the first operand names such a tie). An operand's dtype
    is the one its values are held in: for a wrapper subclass (torchao's float8 tensors), that of
    the largest tensor it wraps (its data, not its scale)."""
    operands = [plain_tensors(args[i]) for i in OPERANDS.get(packet, (0, 1)) if i < len(args)]
    dtypes = [max(plains, key=lambda plain: plain.numel()).dtype for plains in operands]
    return max(dtypes, key=lambda dtype: dtype.itemsize)


@dataclass
class MatmulFlops:
    """FLOPs by (module, phase, dtype). Modules are named as in the model's
    ``named_modules()`` less the wrappers; "" is the model itself, "Global" code outside it
    (the loss); the phase is forward, backward or recompute."""

    flops: Counter[tuple[str, str, str]] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.flops.values())

    def by_dtype(self, phase: str | None = None) -> dict[str, int]:
        found: Counter[str] = Counter()
        for (_, in_phase, dtype), flops in self.flops.items():
            if phase in (None, in_phase):
                found[dtype] += flops
        return dict(found)

    def by_module(self) -> dict[str, dict[str, int]]:
        """Module -> dtype -> FLOPs, forward and backward together."""
        found: dict[str, Counter[str]] = {}
        for (module, _, dtype), flops in self.flops.items():
            found.setdefault(module, Counter())[dtype] += flops
        return {module: dict(dtypes) for module, dtypes in found.items()}

    def where(self, keep: Callable[[str, str], bool]) -> MatmulFlops:
        """The FLOPs of the (module, phase) pairs ``keep`` admits."""
        return MatmulFlops(Counter({k: f for k, f in self.flops.items() if keep(k[0], k[1])}))

    def as_rows(self) -> list[list[Any]]:
        return [[*key, flops] for key, flops in sorted(self.flops.items())]

    @classmethod
    def from_rows(cls, rows: Iterable[list[Any]]) -> MatmulFlops:
        """The FLOPs of ``as_rows`` rows (of one rank or of many: a key's rows add up)."""
        flops: Counter[tuple[str, str, str]] = Counter()
        for module, phase, dtype, count in rows:
            flops[(module, phase, dtype)] += count
        return cls(flops)


class MatmulRecorder(TorchDispatchMode):
    """Records every matmul-class op run while it is entered: its FLOPs, dtype and module.

    ``model`` is what trains (maybe wrapped by DDP); ``inner`` is the module inside the
    wrappers, whose ``named_modules()`` names the records (without checkpoint or compile
    wrappers' parts).
    """

    def __init__(self, model: nn.Module, inner: nn.Module) -> None:
        super().__init__()
        self.modules = ModuleOps(inner)
        self.flops = MatmulFlops()
        # Whether any op of a backward has run yet (the saved-tensor count stops there).
        self.backward_started = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        in_backward = torch._C._current_autograd_node() is not None
        self.backward_started = self.backward_started or in_backward
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        formula = FORMULAS.get(packet)
        if formula is not None:
            module, phase = self.modules.current()
            dtype = _COMPUTED_AS.get() or dtype_name(operand_dtype(packet, args))
            self.flops.flops[(module, phase, dtype)] += formula(*args, **kwargs, out_val=out)
        return out

    def __enter__(self) -> MatmulRecorder:
        self.modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.modules.__exit__(*exc)


def flops_by_module(
    model: nn.Module, inner: nn.Module, step: Callable[[], object]
) -> dict[str, dict[str, int]]:
    """Module -> dtype -> matmul FLOPs of what ``step()`` runs through ``model`` (forward and
    backward): the split a per-module precision choice is judged by."""
    with MatmulRecorder(model, inner) as recorder:
        step()
    return recorder.flops.by_module()
