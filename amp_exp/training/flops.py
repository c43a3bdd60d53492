"""The devices' published dense peaks, which model FLOPs utilization (MFU) is read against.

MFU = FLOPs per token x tokens/s of one device / that device's peak (training.meters.Meter does
the arithmetic). The peak depends on the device and on the math the
precision runs: bf16 and fp16 on Tensor Cores, fp32 as TF32 on Tensor Cores where TF32 is on
(Ampere and newer), else plain fp32. Every figure is the vendor's dense figure (no 2:4 sparsity),
for fp16/bf16 with fp32 accumulation, as autocast runs it. A device missing from the table (any
CPU) has no MFU; its TFLOP/s are still reported. The table is devices.py, which the
roofline prediction (amp_exp/predict/) reads too.
"""

from __future__ import annotations

from amp_exp.config.precisions import get
from amp_exp.devices import find_device


def peak_math(precision: str, tf32: bool) -> str:
    """Which peak a run's matmuls can reach (the precision table's): fp32 runs as TF32 when TF32
    is allowed."""
    math = get(precision).spec.peak_math
    return "tf32" if math == "fp32" and tf32 else math


def peak_tflops(device_name: str, precision: str, tf32: bool) -> tuple[float | None, str | None]:
    """(dense peak TFLOP/s, which peak and where it comes from), or (None, None) if unknown."""
    math = peak_math(precision, tf32)
    device = find_device(device_name)
    if device is None:
        return None, None
    label, peaks, source = device.label, device.tflops, device.source
    if math == "tf32" and "tf32" not in peaks:
        math = "fp32"  # before Ampere, allow_tf32 changes nothing
    if math not in peaks:
        return None, None
    return float(peaks[math]), f"{label} {math} dense {peaks[math]:g} TFLOP/s: {source}"
