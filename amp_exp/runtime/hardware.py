"""The machine a run lands on: device choice, backend switches, seeds and provenance."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from amp_exp.config.schema import DeviceChoice, Precision
from amp_exp.errors import ConfigError

REPO_DIR = Path(__file__).resolve().parents[2]


def resolve_device(choice: DeviceChoice, local_rank: int | None = None) -> torch.device:
    """The device to train on; ``local_rank`` pins a torchrun worker to its own GPU."""
    if choice is DeviceChoice.cpu:
        return torch.device("cpu")
    if torch.cuda.is_available():
        if local_rank is None:
            return torch.device("cuda", torch.cuda.current_device())
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={local_rank}, but this node has {torch.cuda.device_count()} GPUs; "
                "start at most that many processes per node (torchrun --nproc_per_node)"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if choice is DeviceChoice.cuda:
        raise ConfigError(
            f"trainer.device=cuda, but no CUDA device is available to torch {torch.__version__}; "
            "use trainer.device=auto or trainer.device=cpu"
        )
    return torch.device("cpu")


@dataclass(frozen=True)
class ResolvedPrecision:
    precision: Precision
    reason: str


def cuda_has_tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (7, 0)


def resolve_precision(requested: Precision, device: torch.device) -> ResolvedPrecision:
    """Pick the precision for ``auto`` and reject requests the hardware cannot run."""
    if requested is Precision.auto:
        if device.type == "cuda" and cuda_has_tensor_cores(device):
            return ResolvedPrecision(
                Precision.fp16,
                "auto: CUDA GPU with Tensor Cores, so fp16 autocast with dynamic loss scaling",
            )
        if device.type == "cuda":
            return ResolvedPrecision(
                Precision.fp32, "auto: this CUDA GPU has no Tensor Cores, so fp32 is fastest"
            )
        return ResolvedPrecision(
            Precision.fp32,
            "auto: on the CPU autocast rarely pays and fp16 has no fast kernels, so fp32",
        )
    if (
        requested in (Precision.bf16, Precision.bf16_true)
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise ConfigError(
            f"precision={requested.value} needs a GPU with native bf16 (compute capability "
            f"8.0+), but {torch.cuda.get_device_name(device)} lacks it; use precision=fp16 or "
            "precision=fp32"
        )
    return ResolvedPrecision(requested, f"requested: precision={requested.value}")


def require_fp8_hardware(device: torch.device, emulate: bool) -> None:
    """fp8 matmuls need compute capability 8.9+ (Ada, Hopper and newer) unless emulated."""
    if emulate or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)):
        return
    where = "the CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    raise ConfigError(
        f"precision=fp8 needs a CUDA GPU with compute capability 8.9+, not {where}; "
        "add precision.fp8_emulate=true to emulate it (slow, not timed)"
    )


def configure_backends(device: torch.device, deterministic: bool, tf32: bool) -> None:
    # TF32 runs fp32 matmuls and convolutions on Tensor Cores (Ampere+): the "fp32" baseline
    # NVIDIA publishes. tf32=false gives true IEEE fp32 for a strict comparison.
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if deterministic:
        # cuBLAS needs this before its first call to make reductions reproducible.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not deterministic
        torch.backends.cudnn.deterministic = deterministic


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def git_sha() -> str | None:
    """The code version that produced a result, with ``-dirty`` for uncommitted changes."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True, text=True, timeout=5
        )
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_DIR,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


CPU_FLAGS_OF_INTEREST = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16")


def cpu_flags() -> set[str]:
    """The CPU's instruction-set flags that matter for bf16 and fp16 (Linux /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split()) & set(CPU_FLAGS_OF_INTEREST)
    return set()


def inspect_hardware(device: torch.device) -> dict:
    """What the device offers for low precision: the facts a precision choice rests on."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        return {
            "device": "cuda",
            "name": torch.cuda.get_device_name(device),
            "compute_capability": f"{capability[0]}.{capability[1]}",
            "tensor_cores": capability >= (7, 0),
            "native_bf16": capability >= (8, 0),
        }
    flags = cpu_flags()
    return {
        "device": "cpu",
        "name": device_name(device),
        "cpu_flags": sorted(flags),
        "fast_bf16": bool(flags & {"avx512_bf16", "amx_bf16"}),
        "fast_fp16": bool(flags & {"avx512_fp16", "amx_fp16"}),
    }


def precision_advice(precision: str, hardware: dict) -> list[str]:
    """Why ``precision`` cannot be fast on ``hardware``, and what to use instead."""
    if hardware["device"] == "cuda":
        if precision == "fp16" and not hardware["tensor_cores"]:
            return [
                f"fp16 on {hardware['name']} (compute capability {hardware['compute_capability']})"
                ": no Tensor Cores, so fp16 saves memory but little time; fp32 is the safe choice"
            ]
        return []
    if precision == "fp16" and not hardware["fast_fp16"]:
        instead = "bf16" if hardware["fast_bf16"] else "fp32"
        return [
            "fp16 on this CPU: no avx512_fp16/AMX-FP16, so there are no fast fp16 kernels and "
            f"training runs about 20-60x slower than fp32 (measured); use precision={instead}"
        ]
    if precision == "bf16" and not hardware["fast_bf16"]:
        return [
            "bf16 on this CPU: no avx512_bf16/AMX-BF16, so bf16 math is emulated and is unlikely "
            "to beat fp32; use precision=fp32 for speed"
        ]
    return []


def recommend_precision(hardware: dict) -> tuple[str, str]:
    """The precision to pick on this hardware, and why."""
    if hardware["device"] == "cuda":
        if hardware["native_bf16"]:
            return "bf16", "native bf16 Tensor Cores: fp16 speed with fp32 range, no loss scaling"
        if hardware["tensor_cores"]:
            return "fp16", "Tensor Cores without bf16: fp16 with dynamic loss scaling"
        return "fp32", "no Tensor Cores: low precision saves memory, not time"
    if hardware["fast_bf16"]:
        return "bf16", "the CPU has bf16 instructions (avx512_bf16/AMX)"
    return "fp32", "the CPU has no fast bf16 or fp16 instructions"
