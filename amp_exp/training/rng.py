"""Every random number generator a run draws from, as a state that ``weights_only`` loads."""

from __future__ import annotations

import random
from typing import Any

import numpy
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    numpy.random.seed(seed)


def rng_state() -> dict[str, Any]:
    algorithm, keys, position, has_gauss, cached_gauss = numpy.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        # NumPy's key array is not a type weights_only accepts; a tensor of it is.
        "numpy": {
            "algorithm": algorithm,
            "keys": torch.from_numpy(keys.astype(numpy.int64)),
            "position": position,
            "has_gauss": has_gauss,
            "cached_gauss": cached_gauss,
        },
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    numpy.random.set_state(
        (
            np_state["algorithm"],
            np_state["keys"].numpy().astype(numpy.uint32),
            np_state["position"],
            np_state["has_gauss"],
            np_state["cached_gauss"],
        )
    )
