"""The precision table: every fact about a precision mode, in one frozen row per mode.

Everything that depends on which precision runs reads its row here: the policy (autocast, the
GradScaler, the weights' dtype), FSDP2's mixed-precision policy, the probe and ``precision=auto``,
the datasheet peak behind MFU, the validation of strategies, and what a run must show to count
as engaged. Adding a mode is one row here plus its policy code (training/precision_modes.py).

It sits beside the schema as a leaf, not in training/, because the config's validation and the
runtime's FSDP2 wrapper, which sit below training/, read it too. Like the schema it imports no
torch (a bad value is refused before torch loads): dtypes are named as torch names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from amp_exp.config.schema import Precision, Strategy


class DType(str, Enum):
    """A torch dtype by torch's own name, without ``torch.``."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float8_e4m3fn = "float8_e4m3fn"
    float8_e5m2 = "float8_e5m2"

    @property
    def torch(self) -> Any:
        """The ``torch.dtype`` (imports torch)."""
        import torch

        return getattr(torch, self.value)

    @property
    def short(self) -> str:
        """The config's name for it: fp32, bf16, fp16, fp8_e4m3fn."""
        return SHORT_NAMES.get(self, self.value.replace("float8", "fp8"))

    @classmethod
    def of(cls, dtype: Any) -> DType:
        """The member naming a ``DType``."""
        return cls(str(dtype).removeprefix("torch."))


SHORT_NAMES = {DType.float32: "fp32", DType.bfloat16: "bf16", DType.float16: "fp16"}

BOTH_STRATEGIES = frozenset({Strategy.ddp, Strategy.fsdp2})


@dataclass(frozen=True)
class Engagement:
    """What the precision audit of a run must find for the mode to count as having run."""

    # The smallest share of matmul FLOPs that must run in one of ``matmul_dtypes``.
    min_matmul_share: float
    matmul_dtypes: tuple[DType, ...]
    # Every converted linear must run float8 matmuls (fp8).
    fp8_matmuls: bool = False
    # Most weight elements must be stored in this dtype (bf16_true; its norm layers keep fp32
    # by design, a tiny share), or None.
    weights: DType | None = None


@dataclass(frozen=True)
class PrecisionSpec:
    """One precision mode's facts."""

    name: Precision
    # The dtype of the matmuls outside fp8's converted linears, under autocast or (bf16_true) not.
    compute_dtype: DType
    # The dtype autocast runs in; None where the mode uses no autocast.
    autocast_dtype: DType | None
    # The dtype the optimizer updates (master weights) and keeps its state in.
    weight_dtype: DType
    optimizer_state_dtype: DType
    # Dynamic loss scaling with torch.amp.GradScaler.
    grad_scaler: bool
    # Which datasheet peak its matmuls can reach (training.flops): fp32 reads TF32 when allowed.
    peak_math: str
    # The probed kernels it runs: pure bf16 computes as bf16 autocast does; fp8 is not probed.
    probed_as: Precision | None
    # The dtype gradients are summed over the ranks in, under DDP and FSDP2 alike.
    reduce_dtype: DType
    # FSDP2 under precision.fsdp_cast_params: the dtype its policy gathers parameters in, to run
    # the forward without autocast (None: the mode has nothing to cast to). Off by default, FSDP2
    # gathers the stored weights and autocasts, the computation of DDP and of one process.
    fsdp_param_dtype: DType | None
    # The torchrun strategies it runs under.
    strategies: frozenset[Strategy]
    engaged: Engagement
    # A candidate of precision=auto's trial, in the order a tie is broken.
    auto_candidate: bool = False
    # Needs torch.compile to be fast on CUDA (trainer.compile=auto compiles it there): torchao's
    # float8 fuses its casts only when compiled, and eager fp8 is commonly slower than bf16.
    compile_on_cuda: bool = False

    @property
    def is_low_precision(self) -> bool:
        return self.name is not Precision.fp32


SPECS: dict[Precision, PrecisionSpec] = {
    spec.name: spec
    for spec in (
        PrecisionSpec(
            name=Precision.fp32,
            compute_dtype=DType.float32,
            autocast_dtype=None,
            weight_dtype=DType.float32,
            optimizer_state_dtype=DType.float32,
            grad_scaler=False,
            peak_math="fp32",
            probed_as=Precision.fp32,
            reduce_dtype=DType.float32,
            fsdp_param_dtype=None,
            strategies=BOTH_STRATEGIES,
            engaged=Engagement(1.0, (DType.float32,)),
            auto_candidate=True,
        ),
        PrecisionSpec(
            name=Precision.bf16,
            compute_dtype=DType.bfloat16,
            autocast_dtype=DType.bfloat16,
            weight_dtype=DType.float32,
            optimizer_state_dtype=DType.float32,
            grad_scaler=False,
            peak_math="bf16",
            probed_as=Precision.bf16,
            # A sum of many low-precision gradients loses their small parts.
            reduce_dtype=DType.float32,
            fsdp_param_dtype=DType.bfloat16,
            strategies=BOTH_STRATEGIES,
            engaged=Engagement(0.5, (DType.bfloat16,)),
            auto_candidate=True,
        ),
        PrecisionSpec(
            name=Precision.fp16,
            compute_dtype=DType.float16,
            autocast_dtype=DType.float16,
            weight_dtype=DType.float32,
            optimizer_state_dtype=DType.float32,
            grad_scaler=True,
            peak_math="fp16",
            probed_as=Precision.fp16,
            reduce_dtype=DType.float32,
            fsdp_param_dtype=DType.float16,
            strategies=BOTH_STRATEGIES,
            engaged=Engagement(0.5, (DType.float16,)),
            auto_candidate=True,
        ),
        PrecisionSpec(
            name=Precision.bf16_true,
            compute_dtype=DType.bfloat16,
            autocast_dtype=None,
            weight_dtype=DType.bfloat16,
            optimizer_state_dtype=DType.bfloat16,
            grad_scaler=False,
            peak_math="bf16",
            probed_as=Precision.bf16,
            # Its gradients are bf16; DDP sums them in fp32 and rounds once (runtime/distributed).
            reduce_dtype=DType.float32,
            fsdp_param_dtype=None,
            strategies=frozenset({Strategy.ddp}),
            engaged=Engagement(0.5, (DType.bfloat16,), weights=DType.bfloat16),
        ),
        PrecisionSpec(
            name=Precision.fp8,
            compute_dtype=DType.bfloat16,
            autocast_dtype=DType.bfloat16,
            weight_dtype=DType.float32,
            optimizer_state_dtype=DType.float32,
            grad_scaler=False,
            # fp8 matmuls peak at twice the bf16 rate, and its other ops run at bf16's.
            peak_math="fp8",
            probed_as=None,
            reduce_dtype=DType.float32,
            fsdp_param_dtype=None,
            strategies=frozenset({Strategy.ddp}),
            # As bf16 outside the converted linears: with autocast lost, the rest would run in
            # fp32 (emulated gpt_tiny, measured: 74% float8, 26% bf16, so 100% in these).
            engaged=Engagement(
                0.5,
                (DType.float8_e4m3fn, DType.float8_e5m2, DType.bfloat16),
                fp8_matmuls=True,
            ),
            compile_on_cuda=True,
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
