"""The machine a run lands on: device choice, backend switches, what it is, and provenance."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from amp_exp.config.cross_checks import require_cuda
from amp_exp.config.schema import DeviceChoice
from amp_exp.errors import ConfigError


def resolve_device(choice: DeviceChoice, local_rank: int | None = None) -> torch.device:
    """The device to train on; ``local_rank`` pins a torchrun worker to its own GPU."""
    if choice is DeviceChoice.cpu:
        return torch.device("cpu")
    if choice is DeviceChoice.cuda:
        require_cuda()
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
    return torch.device("cpu")


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
    return cpu_info().get("model name") or platform.processor() or platform.machine()


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (Linux; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    return info


def cpu_flags() -> set[str]:
    """The CPU's instruction-set flags (``Features`` on ARM)."""
    info = cpu_info()
    return set((info.get("flags") or info.get("Features") or "").split())
