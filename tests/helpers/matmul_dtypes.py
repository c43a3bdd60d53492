"""What dtype each linear layer of a model computed in, seen by forward hooks.

A hook that runs before any other of the module's forward hooks sees the output the matmul made,
before a precision's own hooks cast it (bf16_true casts a kept module's output back to bf16,
FSDP2 to the forward's dtype). A Linear whose output is fp32 under autocast ran an fp32 matmul.
Stands in until the precision audit (training/audit.py) reports the dtype of every matmul.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def linear_dtypes(model: nn.Module) -> Iterator[dict[str, tuple[torch.dtype, torch.dtype, str]]]:
    """Each linear layer's first call while the context is open: (output dtype, weight dtype,
    class name), by module name; Float8Linear counts as a linear layer."""
    seen: dict[str, tuple[torch.dtype, torch.dtype, str]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def record(module, args, output, name=name) -> None:
                seen.setdefault(name, (output.dtype, module.weight.dtype, type(module).__name__))

            handles.append(module.register_forward_hook(record, prepend=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
