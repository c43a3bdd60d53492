"""The devices' published dense peaks, which model FLOPs utilization (MFU) is read against.

MFU = FLOPs per token x tokens/s of one device / that device's peak (training.meters.Meter does
the arithmetic). The peak depends on the device and on the math the
precision runs: bf16 and fp16 on Tensor Cores, fp32 as TF32 on Tensor Cores where TF32 is on
(Ampere and newer), else plain fp32. Every figure is the vendor's dense figure (no 2:4 sparsity),
for fp16/bf16 with fp32 accumulation, as autocast runs it. A device missing from the table (any
CPU) has no MFU; its TFLOP/s are still reported.
"""

from __future__ import annotations

import re

from amp_exp.config.precisions import spec_of
from amp_exp.config.schema import Precision

# (words of torch.cuda.get_device_name(), label, {math: dense TFLOP/s}, source). The first entry
# whose words all occur in the name wins, so variants come before their base model. Whole words:
# "L4" must not match an L40S, nor "H200" a GH200.
PEAKS: list[tuple[tuple[str, ...], str, dict[str, float], str]] = [
    (
        ("V100", "PCIE"),
        "V100 PCIe",
        {"fp16": 112, "fp32": 14},
        "NVIDIA V100 datasheet (fp16 Tensor Core; no bf16, no TF32)",
    ),
    (
        ("V100",),
        "V100 SXM2",
        {"fp16": 125, "fp32": 15.7},
        "NVIDIA V100 datasheet (fp16 Tensor Core; no bf16, no TF32)",
    ),
    (
        ("A100",),
        "A100",
        {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5},
        "NVIDIA A100 datasheet (SXM and PCIe alike)",
    ),
    (
        ("A10G",),
        "A10G",
        {"bf16": 70, "fp16": 70, "tf32": 35, "fp32": 35},
        "AWS's variant of the A10; NVIDIA publishes no sheet, figures as AWS and Baseten quote",
    ),
    (
        ("L4",),
        "L4",
        {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3},
        "NVIDIA L4 datasheet (its 242 and 120 are with sparsity)",
    ),
    (
        ("RTX 4090",),
        "GeForce RTX 4090",
        {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
        "NVIDIA Ada Lovelace architecture whitepaper, appendix (fp32 accumulate)",
    ),
    (
        ("H100", "PCIe"),
        "H100 PCIe",
        {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51},
        "NVIDIA H100 datasheet (its 1,513 and 756 are with sparsity); torchtitan's table",
    ),
    (
        ("H100", "NVL"),
        "H100 NVL",
        {"bf16": 835, "fp16": 835, "tf32": 417.5, "fp32": 60},
        "NVIDIA H100 NVL datasheet, per GPU (its 1,671 and 835 are with sparsity)",
    ),
    (
        ("H100",),
        "H100 SXM",
        {"bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67},
        "NVIDIA H100 datasheet (its 1,979 and 989 are with sparsity); torchtitan's table",
    ),
    (
        ("H200",),
        "H200",
        {"bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67},
        "NVIDIA H200 datasheet (SXM; same Tensor Cores as H100 SXM); torchtitan's table",
    ),
    (
        ("B200",),
        "B200",
        {"bf16": 2250, "fp16": 2250, "tf32": 1100, "fp32": 75},
        "NVIDIA HGX B200 datasheet, per GPU, sparsity halved; torchtitan's table",
    ),
]


def peak_math(precision: Precision, tf32: bool) -> str:
    """Which peak a run's matmuls can reach (the precision table's): fp32 runs as TF32 when TF32
    is allowed."""
    math = spec_of(precision).peak_math
    return "tf32" if math == "fp32" and tf32 else math


def peak_tflops(
    device_name: str, precision: Precision, tf32: bool
) -> tuple[float | None, str | None]:
    """(dense peak TFLOP/s, which peak and where it comes from), or (None, None) if unknown."""
    math = peak_math(precision, tf32)
    for needles, label, peaks, source in PEAKS:
        if all(re.search(rf"\b{re.escape(word)}\b", device_name, re.I) for word in needles):
            if math == "tf32" and "tf32" not in peaks:
                math = "fp32"  # before Ampere, allow_tf32 changes nothing
            if math not in peaks:
                return None, None
            return float(peaks[math]), f"{label} {math} dense {peaks[math]:g} TFLOP/s: {source}"
    return None, None
