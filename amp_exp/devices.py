"""The accelerators' published figures: dense TFLOP/s per math, HBM bandwidth and capacity.

One table, read by MFU (training/flops.py: the peak a run's measured TFLOP/s is divided by) and by
the roofline prediction (amp_exp/predict/: what a step would cost on a GPU not at hand). Every
TFLOP/s figure is the vendor's dense one (no 2:4 sparsity; a datasheet that lists only sparse
figures is halved, as its footnote says), for fp16/bf16/fp8 with fp32 accumulation. A leaf like
the precision table: it imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    # Words of torch.cuda.get_device_name() that name it (whole words, case-insensitive).
    words: tuple[str, ...]
    label: str
    # Math ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4") -> dense TFLOP/s; a math the device
    # lacks has no entry.
    tflops: dict[str, float]
    source: str
    # python -m amp_exp.predict's name for it (predict.devices), or None: not predicted for.
    key: str | None = None
    hbm_tb_per_s: float | None = None
    memory_gb: float | None = None
    memory_source: str | None = None
    # Tensor Cores that multiply block-scaled formats (MXFP8, MXFP4, NVFP4) with their scales:
    # Blackwell's fifth generation; Hopper's multiply fp8 with one scale per tensor only.
    block_scaled: bool = False
    # Streaming multiprocessors: how many GEMM tiles run at once (the roofline's wave
    # quantization, predict/roofline.py), with where the count is published.
    sms: int | None = None
    sms_source: str | None = None


H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet, SXM column"
B200_SHEET = "NVIDIA DGX B200 / HGX B200 datasheet, 8 GPUs divided by 8"

# The first entry whose words all occur in a device's name wins, so variants come before their
# base model. Whole words: "L4" must not match an L40S, nor "H200" a GH200.
DEVICES: tuple[Device, ...] = (
    Device(
        ("V100", "PCIE"),
        "V100 PCIe",
        {"fp16": 112, "fp32": 14},
        "NVIDIA V100 datasheet (fp16 Tensor Core; no bf16, no TF32)",
    ),
    Device(
        ("V100",),
        "V100 SXM2",
        {"fp16": 125, "fp32": 15.7},
        "NVIDIA V100 datasheet (fp16 Tensor Core; no bf16, no TF32)",
    ),
    Device(
        ("A100",),
        "A100",
        {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5},
        "NVIDIA A100 datasheet (SXM and PCIe alike; its 624 and 312 are with sparsity; no fp8)",
        key="a100",
        hbm_tb_per_s=2.039,
        memory_gb=80,
        memory_source="NVIDIA A100 datasheet, A100 80GB SXM: 80 GB HBM2e at 2,039 GB/s",
        sms=108,
        sms_source="NVIDIA A100 Tensor Core GPU architecture whitepaper: 108 SMs",
    ),
    Device(
        ("A10G",),
        "A10G",
        {"bf16": 70, "fp16": 70, "tf32": 35, "fp32": 35},
        "AWS's variant of the A10; NVIDIA publishes no sheet, figures as AWS and Baseten quote",
    ),
    Device(
        ("L4",),
        "L4",
        {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3},
        "NVIDIA L4 datasheet (its 242 and 120 are with sparsity)",
    ),
    Device(
        ("RTX 4090",),
        "GeForce RTX 4090",
        {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
        "NVIDIA Ada Lovelace architecture whitepaper, appendix (fp32 accumulate)",
    ),
    Device(
        ("H100", "PCIe"),
        "H100 PCIe",
        {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51},
        "NVIDIA H100 datasheet (its 1,513 and 756 are with sparsity); torchtitan's table",
    ),
    Device(
        ("H100", "NVL"),
        "H100 NVL",
        {"bf16": 835, "fp16": 835, "tf32": 417.5, "fp32": 60},
        "NVIDIA H100 NVL datasheet, per GPU (its 1,671 and 835 are with sparsity)",
    ),
    Device(
        ("H100",),
        "H100 SXM",
        {"bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67, "fp8": 1979},
        f"{H100_SHEET} (its 3,958, 1,979 and 989 are with sparsity); torchtitan's table",
        key="h100",
        hbm_tb_per_s=3.35,
        memory_gb=80,
        memory_source=f"{H100_SHEET}: 80 GB HBM3 at 3.35 TB/s",
        sms=132,
        sms_source="NVIDIA H100 Tensor Core GPU architecture whitepaper: 132 SMs (SXM5)",
    ),
    Device(
        ("H200",),
        "H200",
        {"bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67, "fp8": 1979},
        "NVIDIA H200 datasheet (SXM; same Tensor Cores as H100 SXM, figures with sparsity "
        "halved); torchtitan's table",
        key="h200",
        hbm_tb_per_s=4.8,
        memory_gb=141,
        memory_source="NVIDIA H200 datasheet, SXM: 141 GB HBM3e at 4.8 TB/s",
        sms=132,
        sms_source="the H100 SXM5's GH100 configuration (H200 changes the memory only)",
    ),
    Device(
        ("B200",),
        "B200",
        {"bf16": 2250, "fp16": 2250, "tf32": 1100, "fp32": 75, "fp8": 4500, "fp4": 9000},
        f"{B200_SHEET}, sparsity halved (FP4 144 PF, FP8 72 PF, FP16/BF16 36 PF, TF32 18 PF "
        "sparse; FP32 600 TF); torchtitan's table",
        key="b200",
        hbm_tb_per_s=8.0,
        memory_gb=180,
        memory_source=f"{B200_SHEET}: 1,440 GB HBM3e at 64 TB/s",
        block_scaled=True,
        sms=148,
        sms_source="cudaGetDeviceProperties on a B200, quoted in pytorch/ao PR 4002",
    ),
)

PREDICTABLE = {device.key: device for device in DEVICES if device.key is not None}


def find_device(device_name: str) -> Device | None:
    """The table's entry for ``torch.cuda.get_device_name()``'s name, or None."""
    return next(
        (
            device
            for device in DEVICES
            if all(re.search(rf"\b{re.escape(w)}\b", device_name, re.I) for w in device.words)
        ),
        None,
    )
