"""Every random number generator a run draws from, as a state that ``weights_only`` loads.

Each rank of a torchrun job draws from its own generators: the CPU's, and its own device's
(cuda:<local rank>; dropout and stochastic rounding draw from it on a GPU). A checkpoint holds
every rank's state, by rank, and each rank restores its own, onto the device it trains on now,
whatever other GPUs the host has.
"""

from __future__ import annotations

import random
from typing import Any

import numpy
import torch

# The fields of numpy.random.get_state(), in its order.
NUMPY_STATE = ("algorithm", "keys", "position", "has_gauss", "cached_gauss")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    numpy.random.seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's generators: the CPU's, ``device``'s (None on the CPU), Python's, NumPy's."""
    numpy_state = dict(zip(NUMPY_STATE, numpy.random.get_state(), strict=True))
    # As a tensor: a safe load (weights_only) takes tensors, not NumPy arrays.
    numpy_state["keys"] = torch.from_numpy(numpy_state["keys"].astype(numpy.int64))
    return {
        "torch": torch.get_rng_state(),
        "device": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
        "numpy": numpy_state,
    }


def own_rng_state(states: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """This rank's state among every rank's. A rank the checkpoint has none for (an FSDP2 run
    resumed on more ranks) takes rank 0's: every rank started from the same seed."""
    return states[rank] if rank < len(states) else states[0]


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Put ``state`` back; its device generator goes to ``device`` (a CUDA state is dropped on
    the CPU, and a CPU run's resume on a GPU keeps the seeded device generator)."""
    torch.set_rng_state(state["torch"])
    if state["device"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["device"], device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = {**state["numpy"], "keys": state["numpy"]["keys"].numpy().astype(numpy.uint32)}
    numpy.random.set_state(tuple(numpy_state[name] for name in NUMPY_STATE))
