"""A pass through a model that leaves no trace: a check, a trial or a measurement before
training that must not change the run it precedes.

A training-mode forward draws dropout masks from torch's generators and moves BatchNorm's
running statistics; a loader drawn from seeds itself from torch's generator too. Any of these
would make the run differ from the same run without the check. ``leaves_no_trace`` forks every
random number generator (torch's on the CPU and on the modules' GPUs, Python's, NumPy's), and
puts back the modules' buffers and each submodule's training mode, however the pass ends.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from itertools import chain

import numpy
import torch
from torch import nn


def cuda_indices(*modules: nn.Module) -> list[int]:
    """The CUDA devices the modules' parameters and buffers live on."""
    tensors = chain.from_iterable(chain(m.parameters(), m.buffers()) for m in modules)
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


@contextlib.contextmanager
def leaves_no_trace(*modules: nn.Module) -> Iterator[None]:
    """Run the block, then restore the random number generators and the modules' buffers and
    training modes as they were before it."""
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    modes = [(sub, sub.training) for m in modules for sub in m.modules()]
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=cuda_indices(*modules)):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for sub, training in modes:
            sub.training = training
        random.setstate(python_state)
        numpy.random.set_state(numpy_state)
