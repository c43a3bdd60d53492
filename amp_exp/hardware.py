"""The machine a run lands on: device choice, backend switches, seeds and provenance."""

from __future__ import annotations

import os
import platform
import random
import subprocess
from pathlib import Path

import numpy
import torch

from amp_exp.config import ConfigError, DeviceChoice

REPO_DIR = Path(__file__).resolve().parent.parent


def resolve_device(choice: DeviceChoice) -> torch.device:
    if choice is DeviceChoice.cpu:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if choice is DeviceChoice.cuda:
        raise ConfigError(
            f"trainer.device=cuda, but no CUDA device is available to torch {torch.__version__}; "
            "use trainer.device=auto or trainer.device=cpu"
        )
    return torch.device("cpu")


def configure_backends(device: torch.device, deterministic: bool) -> None:
    if deterministic:
        # cuBLAS needs this before its first call to make reductions reproducible.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not deterministic
        torch.backends.cudnn.deterministic = deterministic


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    numpy.random.seed(seed)


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
