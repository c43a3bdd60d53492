"""The precision table: every fact about a precision mode, in one frozen row per mode.

Everything that depends on which precision runs reads its row here: the policy (autocast, the
GradScaler, the weights' dtype), FSDP2's mixed-precision policy, the probe and ``precision=auto``,
the datasheet peak behind MFU, the validation of strategies, and what a run must show to count
as engaged. Adding a mode is one row here plus its policy code (training/precision_modes.py).

It sits beside the schema as a leaf, not in training/, because the config's validation and the
runtime's FSDP2 wrapper, which sit below training/, read it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from amp_exp.config.schema import Precision, Strategy

BOTH_STRATEGIES = frozenset({Strategy.ddp, Strategy.fsdp2})


@dataclass(frozen=True)
class Engagement:
    """What the precision audit of a run must find for the mode to count as having run."""

    # The smallest share of matmul FLOPs that must run in one of ``matmul_dtypes``.
    min_matmul_share: float
    matmul_dtypes: tuple[torch.dtype, ...]
    # Every converted linear must run float8 matmuls (fp8).
    fp8_matmuls: bool = False
    # The trained weights must be stored in this dtype (bf16_true), or None.
    weights: torch.dtype | None = None


@dataclass(frozen=True)
class PrecisionSpec:
    """One precision mode's facts."""

    name: Precision
    # The dtype of the matmuls outside fp8's converted linears, under autocast or (bf16_true) not.
    compute_dtype: torch.dtype
    # The dtype autocast runs in; None where the mode uses no autocast.
    autocast_dtype: torch.dtype | None
    # The dtype the optimizer updates (master weights) and keeps its state in.
    weight_dtype: torch.dtype
    optimizer_state_dtype: torch.dtype
    # Dynamic loss scaling with torch.amp.GradScaler.
    grad_scaler: bool
    # Which datasheet peak its matmuls can reach (runtime.flops): fp32 reads TF32 when allowed.
    peak_math: str
    # The probed kernels it runs: pure bf16 computes as bf16 autocast does; fp8 is not probed.
    probed_as: Precision | None
    # FSDP2: the dtype parameters are gathered in (None: as stored) and gradients reduced in.
    fsdp_param_dtype: torch.dtype | None
    fsdp_reduce_dtype: torch.dtype
    # The torchrun strategies it runs under.
    strategies: frozenset[Strategy]
    engaged: Engagement
    # A candidate of precision=auto's trial, in the order a tie is broken.
    auto_candidate: bool = False

    @property
    def is_low_precision(self) -> bool:
        return self.name is not Precision.fp32


SPECS: dict[Precision, PrecisionSpec] = {
    spec.name: spec
    for spec in (
        PrecisionSpec(
            name=Precision.fp32,
            compute_dtype=torch.float32,
            autocast_dtype=None,
            weight_dtype=torch.float32,
            optimizer_state_dtype=torch.float32,
            grad_scaler=False,
            peak_math="fp32",
            probed_as=Precision.fp32,
            fsdp_param_dtype=None,
            fsdp_reduce_dtype=torch.float32,
            strategies=BOTH_STRATEGIES,
            engaged=Engagement(1.0, (torch.float32,)),
            auto_candidate=True,
        ),
        PrecisionSpec(
            name=Precision.bf16,
            compute_dtype=torch.bfloat16,
            autocast_dtype=torch.bfloat16,
            weight_dtype=torch.float32,
            optimizer_state_dtype=torch.float32,
            grad_scaler=False,
            peak_math="bf16",
            probed_as=Precision.bf16,
            fsdp_param_dtype=torch.bfloat16,
            # A sum of many low-precision gradients loses their small parts.
            fsdp_reduce_dtype=torch.float32,
            strategies=BOTH_STRATEGIES,
            engaged=Engagement(0.5, (torch.bfloat16,)),
            auto_candidate=True,
        ),
        PrecisionSpec(
            name=Precision.fp16,
            compute_dtype=torch.float16,
            autocast_dtype=torch.float16,
            weight_dtype=torch.float32,
            optimizer_state_dtype=torch.float32,
            grad_scaler=True,
            peak_math="fp16",
            probed_as=Precision.fp16,
            fsdp_param_dtype=torch.float16,
            fsdp_reduce_dtype=torch.float32,
            strategies=BOTH_STRATEGIES,
            engaged=Engagement(0.5, (torch.float16,)),
            auto_candidate=True,
        ),
        PrecisionSpec(
            name=Precision.bf16_true,
            compute_dtype=torch.bfloat16,
            autocast_dtype=None,
            weight_dtype=torch.bfloat16,
            optimizer_state_dtype=torch.bfloat16,
            grad_scaler=False,
            peak_math="bf16",
            probed_as=Precision.bf16,
            fsdp_param_dtype=None,
            fsdp_reduce_dtype=torch.bfloat16,
            strategies=frozenset({Strategy.ddp}),
            engaged=Engagement(0.5, (torch.bfloat16,), weights=torch.bfloat16),
        ),
        PrecisionSpec(
            name=Precision.fp8,
            compute_dtype=torch.bfloat16,
            autocast_dtype=torch.bfloat16,
            weight_dtype=torch.float32,
            optimizer_state_dtype=torch.float32,
            grad_scaler=False,
            # fp8 matmuls peak at twice the bf16 rate, and its other ops run at bf16's.
            peak_math="fp8",
            probed_as=None,
            fsdp_param_dtype=None,
            fsdp_reduce_dtype=torch.float32,
            strategies=frozenset({Strategy.ddp}),
            engaged=Engagement(
                0.0,
                (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16),
                fp8_matmuls=True,
            ),
        ),
    )
}

AUTO_CANDIDATES = tuple(p for p, spec in SPECS.items() if spec.auto_candidate)
# The low precisions the probe times and precision=auto may choose, in tie-break order.
PROBED_LOW = tuple(p for p in AUTO_CANDIDATES if p is not Precision.fp32)


def spec_of(precision: Precision) -> PrecisionSpec:
    """The row of a resolved precision; precision=auto has none until it is decided."""
    if precision is Precision.auto:
        raise ValueError("resolve precision=auto first (training.auto_precision)")
    return SPECS[precision]


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as torch names it, without ``torch.``: float32, bfloat16, float8_e4m3fn."""
    return str(dtype).removeprefix("torch.")


SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
