"""Each module's error in a target precision, against the fp32 reference, on the same inputs.

For each recorded call (sensitivity/reference.py) a module runs twice on the call's fp32 inputs:
as it is, in fp32, and as the precision's policy prepares it (``PrecisionPolicy.prepare_model``:
fp8's float8 linears, ``precision.keep_fp32``) under the policy's autocast. Both are
differentiated with the reference's output gradient, so each error is the module's own:

- **SQNR** in dB, 10·log10(Σref² / Σ(ref - target)²), of the output and of the gradients of the
  module's own parameters, summed over calls: torchao's float8 tests require 18 dB on outputs and
  17 dB on gradients, the reference points here. A non-finite target output or gradient makes it
  -inf; an exact one, +inf.
- **Range**: the share of the reference's output elements and output-gradient elements outside
  the precision's narrowest format (the precision table's first matmul dtype: fp16, bf16, float8
  e4m3): above its largest finite value, or non-zero below its smallest subnormal (2^-24 for
  fp16). fp16's gradients are taken as the GradScaler hands them over, times
  ``precision.init_scale``, and the target's backward gets that scaled gradient in its own dtype,
  as in training. fp8 scales each cast per tensor, so its range share says what an unscaled cast
  would lose.

A module's **margin** is how far it stays above the reference points, min(output - 18,
gradient - 17) dB; modules are ranked by it, lowest first (ties: the larger out-of-range share
first). The end-to-end loss of the whole prepared model is compared with fp32's as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from amp_exp.sensitivity.reference import ModuleCall, Reference, seeded
from amp_exp.tasks.base import Batch, Task
from amp_exp.training.precision import PrecisionPolicy

# torchao's float8 test thresholds (test/float8): outputs, then gradients.
OUTPUT_SQNR_DB = 18.0
GRAD_SQNR_DB = 17.0


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
    def of(cls, dtype: torch.dtype) -> RangeShare:
        info = torch.finfo(dtype)
        return cls(largest=info.max, smallest=info.smallest_normal * info.eps)

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


@dataclass
class ModuleError:
    """One module's measurements in one precision."""

    activations: RangeShare
    gradients: RangeShare
    output: Sqnr = field(default_factory=Sqnr)
    grad: Sqnr = field(default_factory=Sqnr)
    has_grad: bool = False

    @classmethod
    def of(cls, dtype: torch.dtype) -> ModuleError:
        return cls(RangeShare.of(dtype), RangeShare.of(dtype))

    @property
    def margin_db(self) -> float:
        margins = [self.output.db - OUTPUT_SQNR_DB]
        if self.has_grad:
            margins.append(self.grad.db - GRAD_SQNR_DB)
        return min(margins)

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
            "grad_sqnr_db": self.grad.db if self.has_grad else None,
            "grad_finite": self.grad.finite if self.has_grad else None,
            "margin_db": self.margin_db,
            "meets_reference_points": self.margin_db >= 0,
            **self.activations.shares("activation"),
            **self.gradients.shares("gradient"),
        }


def format_dtype(policy: PrecisionPolicy) -> torch.dtype:
    """The narrowest format the precision's matmuls take, whose range values must fit."""
    return policy.spec.engaged.matmul_dtypes[0].torch


def _gradients(output: torch.Tensor, parameters: list, grad_output: torch.Tensor) -> torch.Tensor:
    """The parameters' gradients, flattened into one tensor (zeros for one the call left unused,
    so that the reference's and the target's line up)."""
    found = torch.autograd.grad(
        output, parameters, grad_output, allow_unused=True, materialize_grads=True
    )
    return torch.cat([g.flatten() for g in found])


def measure_module(
    reference: nn.Module,
    target: nn.Module,
    calls: list[ModuleCall],
    policy: PrecisionPolicy,
    grad_scale: float,
    seed: int,
) -> ModuleError:
    """The error ``target`` (the module prepared for ``policy``) makes on ``calls``."""
    error = ModuleError.of(format_dtype(policy))
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    target_params = [p for p in target.parameters() if p.requires_grad]
    for call in calls:
        seeded(seed + call.batch)
        expected = reference(*call.args, **call.kwargs)
        seeded(seed + call.batch)
        with policy.autocast():
            got = target(*call.args, **call.kwargs)
        error.output.add(expected, got.float())
        error.activations.add(expected)
        if call.grad_output is None or not ref_params:
            continue
        error.has_grad = True
        scaled = call.grad_output * grad_scale
        error.gradients.add(scaled)
        expected_grads = _gradients(expected, ref_params, call.grad_output)
        got_grads = _gradients(got, target_params, scaled.to(got.dtype))
        error.grad.add(expected_grads, got_grads / grad_scale)
    return error


def end_to_end_losses(
    model: nn.Module, task: Task, batches: list[Batch], policy: PrecisionPolicy, seed: int
) -> list[float]:
    """The whole prepared model's loss on each batch, as training computes it."""
    model.train()
    losses = []
    for index, batch in enumerate(batches):
        seeded(seed + index)
        with torch.no_grad(), policy.autocast():
            losses.append(float(task.loss(model, batch)))
    return losses


def measure_precision(
    model: nn.Module,
    target_model: nn.Module,
    task: Task,
    batches: list[Batch],
    reference: Reference,
    policy: PrecisionPolicy,
    seed: int,
) -> tuple[dict[str, ModuleError], list[float]]:
    """Every measured module's error in ``policy``'s precision, and the end-to-end losses.

    ``target_model`` is a copy of ``model`` that ``policy.prepare_model`` prepared.
    """
    grad_scale = policy.cfg.init_scale if policy.spec.grad_scaler else 1.0
    errors = {
        name: measure_module(
            model.get_submodule(name),
            target_model.get_submodule(name),
            calls,
            policy,
            grad_scale,
            seed,
        )
        for name, calls in reference.calls.items()
        if calls and all(call.output_is_tensor for call in calls)
    }
    return errors, end_to_end_losses(target_model, task, batches, policy, seed)


def ranking(errors: dict[str, ModuleError]) -> list[str]:
    """Module names, most sensitive first: the lowest margin, then the most out of range."""
    return sorted(errors, key=lambda name: (errors[name].margin_db, -errors[name].out_of_range))
