"""The fp32 reference: what every measured module took in and was handed back, batch by batch.

One fp32 forward and backward per batch, with hooks on the measured modules: a forward pre-hook
keeps a copy of each call's inputs, and a hook on its output keeps the gradient of the loss with
respect to that output. Each module is then run again on exactly those inputs in the target
precision (sensitivity/measure.py), so its error is its own and does not compound from the
modules before it.

Measured is every module but the model itself: those that own parameters (linears,
convolutions, embeddings, norms) and those that only compute (an attention core, a softmax, an
activation, a norm without weights, a block, a user's module whose forward is plain functions).
A module that returns a tuple is measured by its first floating tensor: ``nn.MultiheadAttention``
and transformers' attention classes return (output, attention weights or None), and compute
through functional calls (``F.multi_head_attention_forward``, ``F.scaled_dot_product_attention``)
that no child module sees, so their own boundary is the only place their math is measured.
An input that needed a gradient in the reference is recorded as needing one, so that a module's
error in backward covers the gradients it hands back to its inputs, not only its parameters'.
FLOPs are the precision audit's (training/audit/matmuls.py: ``torch.utils.flop_counter``'s
formulas, the CPU's fused attention included), forward and backward of the first batch, each op
the module's whose forward ran it, in the backward too (torch's ``ModuleTracker`` loses some of
an attention module's backward to its parent); a container's include its children's.

The reference is true fp32: TF32 is off while it runs (``true_fp32``), whatever
``trainer.tf32`` says for the run, since TF32's 10-bit mantissa would hide most of fp16's error
and all of bf16's below it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from amp_exp.runtime.no_trace import leaves_no_trace
from amp_exp.tasks.base import Batch, Task
from amp_exp.training.audit.matmuls import MatmulRecorder


@dataclass
class ModuleCall:
    """One call of a module in the fp32 reference: its inputs and its output's gradient."""

    args: tuple
    kwargs: dict[str, Any]
    batch: int
    # dLoss/dOutput; None where the output got no gradient (or is not a tensor).
    grad_output: torch.Tensor | None = None
    # Whether the output holds a floating tensor to measure (``measured_output``).
    output_is_tensor: bool = True


@dataclass
class Reference:
    """The fp32 reference of ``batches``: the loss of each, every measured module's calls, and
    the FLOPs of every module by name ("" the whole model)."""

    losses: list[float]
    calls: dict[str, list[ModuleCall]]
    flops: dict[str, int] = field(default_factory=dict)

    @property
    def total_flops(self) -> int:
        return self.flops.get("", 0)

    def flop_share(self, names: Sequence[str]) -> float | None:
        """The share of the model's FLOPs spent inside the modules ``names`` (outermost ones)."""
        if not self.total_flops:
            return None
        return sum(self.flops.get(name, 0) for name in names) / self.total_flops


@contextlib.contextmanager
def true_fp32() -> Iterator[None]:
    """fp32 matmuls and convolutions in IEEE fp32, not TF32, restored afterwards."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def measured_output(output: Any) -> torch.Tensor | None:
    """What a module's output is measured by: the output, or a tuple's first floating tensor
    (an attention module's output before its weights)."""
    if isinstance(output, (tuple, list)):
        output = next(
            (o for o in output if isinstance(o, torch.Tensor) and o.is_floating_point()), None
        )
    return output if isinstance(output, torch.Tensor) else None


def detached(leaf: torch.Tensor) -> torch.Tensor:
    """A copy of ``leaf`` cut from the graph (and safe from in-place ops), a leaf that needs a
    gradient if it needed one."""
    return leaf.detach().clone().requires_grad_(leaf.requires_grad)


def _recording_hooks(model: nn.Module, names: list[str], calls: dict, batch: int) -> list:
    handles = []
    for name in names:

        def before(module, args, kwargs, name=name):
            args, kwargs = tree_map_only(torch.Tensor, detached, (args, kwargs))
            calls[name].append(ModuleCall(args, kwargs, batch))

        def after(module, args, kwargs, output, name=name):
            call = calls[name][-1]
            output = measured_output(output)
            if output is None:
                call.output_is_tensor = False
            elif output.requires_grad:

                def keep_gradient(grad: torch.Tensor, call: ModuleCall = call) -> None:
                    call.grad_output = grad.detach().clone()

                output.register_hook(keep_gradient)

        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    return handles


def capture_reference(
    model: nn.Module, task: Task, batches: Sequence[Batch], seed: int
) -> Reference:
    """Forward and backward of each batch in fp32, recording every measured module's calls.

    Leaves the model's gradients as they were (none), and its buffers as they were: BatchNorm
    statistics would otherwise move with each pass.
    """
    # Every module, in definition order; never the root (the end-to-end loss is its).
    names = [name for name, _ in model.named_modules() if name]
    calls: dict[str, list[ModuleCall]] = {name: [] for name in names}
    losses, flops = [], {}
    with leaves_no_trace(model):
        model.train()
        for index, batch in enumerate(batches):
            handles = _recording_hooks(model, names, calls, index)
            recorder = MatmulRecorder(model, model) if index == 0 else None
            try:
                # The same random numbers (dropout) as each target precision's run of it.
                torch.manual_seed(seed + index)
                with true_fp32(), recorder or contextlib.nullcontext():
                    loss = task.loss(model, batch)
                    loss.backward()
            finally:
                for handle in handles:
                    handle.remove()
            losses.append(float(loss.detach()))
            if recorder is not None:
                # Each module's matmul FLOPs with its children's; "" the whole program's.
                by_module = recorder.flops.by_module().items()
                own = {module: sum(dtypes.values()) for module, dtypes in by_module}
                flops = {"": recorder.flops.total}
                for name in names:
                    inside = (m for m in own if m == name or m.startswith(name + "."))
                    flops[name] = sum(own[m] for m in inside)
    model.zero_grad(set_to_none=True)
    return Reference(losses, calls, flops)
