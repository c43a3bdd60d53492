"""Each module's error in a target precision, against the fp32 reference, on the same inputs.

For each recorded call (sensitivity/reference.py) a module runs three times on the call's fp32
inputs: as it is, in true fp32 (TF32 off); as the precision's plugin converts it
(``PrecisionPlugin.convert_module``: fp8's float8 linears, ``precision.keep_fp32``) under the
plugin's forward context; and in fp32 again with its floating inputs and parameters rounded to the
precision's format (the precision table's first matmul dtype: fp16, bf16, float8 e4m3, or a
block-scaled format such as mxfp8_e4m3 or nvfp4, rounded in its blocks by torchao's casts), which
is the error the format's rounding alone makes. Each is differentiated with the reference's
output gradient, so each error is the module's own:

- **SQNR** in dB, 10·log10(Σref² / Σ(ref - x)²), of the output and of the gradients of the
  module's parameters and of its inputs that need one, summed over calls. A non-finite output
  or gradient makes it -inf; an exact one, +inf.
- **The rounding floor**: the same SQNR of the rounded run, its output and gradients rounded
  too. fp8 rounds each tensor scaled to its largest value, as its casts do; fp16's gradients are
  rounded at the GradScaler's scale.
- **Sensitive** is a module whose error is well above the floor, more than ``SLACK_DB`` (10 dB:
  an error over 3 times the rounding's, in amplitude) below it in output or gradient, or whose
  output or gradient is not finite, or in which an op overflowed (sensitivity/ranges.py names
  the first). Its **margin** is min(output - (floor - 10), gradient - (floor - 10)) dB, -inf
  when not finite or overflowed.
- **Range**: the share of the reference's output and output-gradient elements outside the
  format: above its largest finite value, or non-zero below its smallest subnormal (2^-24 for
  fp16). fp16's gradients are taken as the GradScaler hands them over, times
  ``precision.init_scale``, and the target's backward gets that scaled gradient in its own dtype,
  as in training. fp8 scales each cast per tensor, so its range share says what an unscaled cast
  would lose; a block-scaled format scales each block, over fp32's range, which it is judged by.

Modules are ranked by margin, lowest first, except that a sensitive module with a sensitive
module inside it ranks after every module without one: its error is its child's, and the child
is the one to keep in fp32. Ties go to the larger out-of-range share, then the deeper module.
The end-to-end loss of the whole prepared model is compared with fp32's as well.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from amp_exp.config.precisions import DType
from amp_exp.sensitivity.ranges import OpFault, OpRangeWatch, subnormal
from amp_exp.sensitivity.reference import ModuleCall, Reference, measured_output, true_fp32
from amp_exp.tasks.base import Batch, Task
from amp_exp.training.precisions.base import PrecisionPlugin

# How far below the rounding floor a module's SQNR may fall before it is sensitive: 10 dB is an
# error about 3 times the rounding's in amplitude, more than a few ops' rounding compounds to.
SLACK_DB = 10.0


@dataclass
class Sqnr:
    """Signal and noise power summed over the calls of one module."""

    signal: float = 0.0
    noise: float = 0.0
    finite: bool = True

    def add(self, reference: torch.Tensor, target: torch.Tensor) -> None:
        reference, target = reference.detach(), target.detach().double()
        if not bool(torch.isfinite(target).all()):
            self.finite = False
            return
        reference = reference.double()
        self.signal += float(reference.square().sum())
        self.noise += float((reference - target).square().sum())

    @property
    def db(self) -> float:
        if not self.finite:
            return -math.inf
        if self.noise == 0:
            return math.inf
        if self.signal == 0:
            return -math.inf
        return 10 * math.log10(self.signal / self.noise)


@dataclass
class RangeShare:
    """How many elements lie above a format's largest value, or below its smallest subnormal."""

    largest: float
    smallest: float
    elements: int = 0
    over: int = 0
    under: int = 0

    @classmethod
    def of(cls, fmt: DType) -> RangeShare:
        dtype = torch.float32 if fmt.block_scaled else fmt.torch
        return cls(largest=torch.finfo(dtype).max, smallest=subnormal(dtype))

    def add(self, values: torch.Tensor) -> None:
        magnitude = values.detach().abs()
        self.elements += magnitude.numel()
        self.over += int((magnitude > self.largest).sum())
        self.under += int(((magnitude > 0) & (magnitude < self.smallest)).sum())

    def shares(self, prefix: str) -> dict[str, float | None]:
        total = self.elements or math.nan
        return {
            f"{prefix}_overflow_frac": self.over / total,
            f"{prefix}_underflow_frac": self.under / total,
        }


def _margin(sqnr: Sqnr, floor: Sqnr) -> float:
    if sqnr.db == math.inf:
        return math.inf
    return sqnr.db - (floor.db - SLACK_DB)


@dataclass
class ModuleError:
    """One module's measurements in one precision."""

    activations: RangeShare
    gradients: RangeShare
    output: Sqnr = field(default_factory=Sqnr)
    grad: Sqnr = field(default_factory=Sqnr)
    output_floor: Sqnr = field(default_factory=Sqnr)
    grad_floor: Sqnr = field(default_factory=Sqnr)
    has_grad: bool = False
    fault: OpFault | None = None

    @property
    def margin_db(self) -> float:
        if self.fault is not None:
            return -math.inf
        margins = [_margin(self.output, self.output_floor)]
        if self.has_grad:
            margins.append(_margin(self.grad, self.grad_floor))
        return min(margins)

    @property
    def sensitive(self) -> bool:
        return self.margin_db < 0

    @property
    def out_of_range(self) -> float:
        shares = (self.activations, self.gradients)
        elements = sum(share.elements for share in shares)
        outside = sum(share.over + share.under for share in shares)
        return outside / elements if elements else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "output_sqnr_db": self.output.db,
            "output_finite": self.output.finite,
            "output_floor_db": self.output_floor.db,
            "grad_sqnr_db": self.grad.db if self.has_grad else None,
            "grad_finite": self.grad.finite if self.has_grad else None,
            "grad_floor_db": self.grad_floor.db if self.has_grad else None,
            "margin_db": self.margin_db,
            "sensitive": self.sensitive,
            "out_of_range_op": None if self.fault is None else self.fault.text(),
            **self.activations.shares("activation"),
            **self.gradients.shares("gradient"),
        }


def rounded(value: Any, fmt: DType) -> Any:
    """``value``'s floating tensors rounded to ``fmt`` and back to fp32, clamped to its range
    (overflow is judged apart); float8 scaled per tensor to its largest value, as fp8 casts; a
    block-scaled format in its blocks along the last dimension, as its matmuls take it."""
    if not isinstance(value, torch.Tensor):  # the tensors inside a tuple, list or dict
        return tree_map_only(torch.Tensor, lambda leaf: rounded(leaf, fmt), value)
    if not value.is_floating_point():
        return value
    tensor = value.detach().float()
    if fmt.block_scaled:
        from amp_exp.training.microscaling.formats import quantized

        result = quantized(tensor.reshape(tensor.shape or (1,)), fmt).reshape(tensor.shape)
        return result.requires_grad_(value.requires_grad)
    dtype = fmt.torch
    largest = torch.finfo(dtype).max
    scale = 1.0
    if dtype.itemsize == 1:
        amax = float(tensor.abs().max()) if tensor.numel() else 0.0
        scale = largest / amax if amax > 0 else 1.0
    result = (tensor * scale).clamp(-largest, largest).to(dtype).float() / scale
    return result.requires_grad_(value.requires_grad)


@contextlib.contextmanager
def rounded_parameters(module: nn.Module, fmt: DType) -> Iterator[None]:
    """``module``'s floating parameters rounded to ``fmt`` while entered, restored after."""
    saved = [(p, p.detach().clone()) for p in module.parameters() if p.is_floating_point()]
    with torch.no_grad():
        for parameter, _ in saved:
            parameter.copy_(rounded(parameter, fmt))
    try:
        yield
    finally:
        with torch.no_grad():
            for parameter, original in saved:
                parameter.copy_(original)


def fresh(value: Any) -> Any:
    """Copies of the recorded inputs for one run: a module that works in place (ReLU(inplace=
    True)) may neither change the record nor write into a leaf that needs a gradient; the
    gradients still reach the recorded leaves through the copy."""
    return tree_map_only(torch.Tensor, torch.clone, value)


def _differentiable(module: nn.Module, call_args: Any) -> list[torch.Tensor]:
    """What a module's backward hands gradients to: its parameters, and its inputs that need
    one."""
    inputs = [
        leaf
        for leaf in tree_leaves(call_args)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]
    return [p for p in module.parameters() if p.requires_grad] + inputs


def _gradients(output: torch.Tensor, wrt: list, grad_output: torch.Tensor) -> torch.Tensor:
    """The gradients, flattened into one tensor (zeros for one the call left unused, so that
    the reference's and the target's line up)."""
    found = torch.autograd.grad(output, wrt, grad_output, allow_unused=True, materialize_grads=True)
    return torch.cat([g.flatten() for g in found])


def measure_module(
    name: str,
    reference: nn.Module,
    target: nn.Module,
    calls: list[ModuleCall],
    plugin: PrecisionPlugin,
    grad_scale: float,
    seed: int,
) -> ModuleError:
    """The error ``target`` (the module prepared for ``plugin``) makes on ``calls``."""
    # The narrowest format the precision's matmuls take, whose range values must fit.
    dtype = plugin.spec.engaged.matmul_dtypes[0]
    error = ModuleError(RangeShare.of(dtype), RangeShare.of(dtype))
    for call in calls:
        inputs = (call.args, call.kwargs)
        wrt = _differentiable(reference, inputs)
        # Only a call whose output got a gradient, into something that takes one, has a backward.
        backward = call.grad_output is not None and bool(wrt)
        scaled = call.grad_output * grad_scale if backward else None
        # The reference's backward comes before the rounding, which writes to its parameters.
        torch.manual_seed(seed + call.batch)
        with true_fp32():
            expected = measured_output(reference(*fresh(call.args), **fresh(call.kwargs)))
            expected_grads = _gradients(expected, wrt, call.grad_output) if backward else None
        floor_inputs = rounded(inputs, dtype)
        torch.manual_seed(seed + call.batch)
        with true_fp32(), rounded_parameters(reference, dtype):
            floor = measured_output(reference(*fresh(floor_inputs[0]), **fresh(floor_inputs[1])))
            if backward:
                floor_wrt = _differentiable(reference, floor_inputs)
                floor_grads = _gradients(floor, floor_wrt, rounded(scaled, dtype) / grad_scale)
                floor_grads = rounded(floor_grads * grad_scale, dtype) / grad_scale
        # The format rounds what a module hands on as well as what it takes.
        floor = rounded(floor, dtype)
        watch = OpRangeWatch(target, name)
        torch.manual_seed(seed + call.batch)
        with watch, plugin.forward_context():
            got = measured_output(target(*fresh(call.args), **fresh(call.kwargs)))
        error.output.add(expected, got.float())
        error.output_floor.add(expected, floor)
        error.activations.add(expected)
        if backward:
            error.has_grad = True
            error.gradients.add(scaled)
            with watch:
                got_grads = _gradients(got, _differentiable(target, inputs), scaled.to(got.dtype))
            error.grad.add(expected_grads, got_grads / grad_scale)
            error.grad_floor.add(expected_grads, floor_grads)
        error.fault = error.fault or watch.fault
    return error


def measure_precision(
    model: nn.Module,
    target_model: nn.Module,
    task: Task,
    batches: list[Batch],
    reference: Reference,
    plugin: PrecisionPlugin,
    seed: int,
) -> tuple[dict[str, ModuleError], list[float], OpFault | None]:
    """Every measured module's error in ``plugin``'s precision, the end-to-end losses, and the
    first op that overflowed in them.

    ``target_model`` is a copy of ``model`` that ``plugin.convert_module`` converted.
    """
    grad_scale = plugin.cfg.init_scale if plugin.spec.grad_scaler else 1.0
    errors = {
        name: measure_module(
            name,
            model.get_submodule(name),
            target_model.get_submodule(name),
            calls,
            plugin,
            grad_scale,
            seed,
        )
        for name, calls in reference.calls.items()
        if calls and all(call.output_is_tensor for call in calls)
    }
    # The whole prepared model's loss on each batch, as training computes it.
    target_model.train()
    losses = []
    watch = OpRangeWatch(target_model, "")
    for index, batch in enumerate(batches):
        torch.manual_seed(seed + index)
        with torch.no_grad(), watch, plugin.forward_context():
            losses.append(float(task.loss(target_model, batch)))
    return errors, losses, watch.fault


def _explained(name: str, errors: dict[str, ModuleError]) -> bool:
    """Whether a sensitive module holds a sensitive module: its error is its child's."""
    return errors[name].sensitive and any(
        other.startswith(name + ".") and error.sensitive for other, error in errors.items()
    )


def ranking(errors: dict[str, ModuleError]) -> list[str]:
    """Module names, the ones to blame first: see the module's docstring."""
    return sorted(
        errors,
        key=lambda name: (
            _explained(name, errors),
            errors[name].margin_db,
            -errors[name].out_of_range,
            -name.count("."),
        ),
    )
