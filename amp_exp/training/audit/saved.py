"""The bytes autograd keeps for backward: what a precision's activation memory really is.

``SavedActivations`` counts, through ``torch.autograd.graph.saved_tensors_hooks``, every tensor
the forward saves for backward, once per storage (views and tensors saved by several ops share
one), by dtype. The parameters are left out: they stay in memory whether saved or not, while the
copies autocast makes of them to multiply in low precision are new memory and count. The count
is exact on every device, where the CPU's resident set size says nothing about precision.

Only the first forward is counted: with gradient accumulation every micro-batch saves the same
and frees it in its backward, whose storages the next forward reuses.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from amp_exp.training.audit.matmuls import dtype_name, plain_tensors


class SavedActivations:
    """Counts the storages the forward saves for backward while it is entered.

    ``stopped()`` says when to stop counting: once the first backward has run.
    """

    def __init__(self, stopped: Callable[[], bool]) -> None:
        self.stopped = stopped
        self.by_dtype: Counter[str] = Counter()
        self._seen: set[int] = set()
        self._hooks = saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # A parameter, or a view of one (not a copy autocast made).
        parameter = isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)
        if self.stopped() or parameter:
            return tensor
        for plain in plain_tensors(tensor):
            storage = plain.untyped_storage()
            if storage.data_ptr() not in self._seen:
                self._seen.add(storage.data_ptr())
                self.by_dtype[dtype_name(plain.dtype)] += storage.nbytes()
        return tensor

    def summary(self) -> dict:
        return {"total": sum(self.by_dtype.values()), "by_dtype": dict(self.by_dtype)}

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
