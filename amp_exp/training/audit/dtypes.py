"""The dtypes a run keeps between steps and communicates in, read from the tensors and the
wrappers themselves rather than from what the configuration asked for.

State: the bytes of the weights, the gradients and the optimizer's state, by dtype (under
FSDP2 this rank's shards). Communication: under DDP, the dtype its buckets all-reduce the
gradients in (the gradients' own, unless a communication hook or DDP's mixed precision casts
them); under FSDP2, the param and reduce dtypes of the mixed-precision policy of each sharded
module, as ``fully_shard`` keeps it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amp_exp.runtime.distributed import Distributed
from amp_exp.runtime.fsdp import local, policies_in_force
from amp_exp.training.audit.matmuls import dtype_name
from amp_exp.training.audit.modules import unwrapped_name


def bytes_by_dtype(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    found: Counter[str] = Counter()
    for tensor in tensors:
        shard = local(tensor)
        found[dtype_name(shard.dtype)] += shard.numel() * shard.element_size()
    return dict(found)


def parameter_elements(model: nn.Module) -> dict[str, dict[str, int]]:
    """Module -> dtype -> elements of the parameters it owns (this rank's shards), by the names
    the FLOPs are recorded under (no wrapper's part)."""
    found: dict[str, Counter[str]] = {}
    for name, parameter in model.named_parameters():
        owner = unwrapped_name(name.rpartition(".")[0])
        found.setdefault(owner, Counter())[dtype_name(parameter.dtype)] += local(parameter).numel()
    return {module: dict(dtypes) for module, dtypes in found.items()}


def communication(
    trained: nn.Module, distributed: Distributed | None, grad_dtypes: Iterable[str]
) -> dict[str, Any] | None:
    """The dtypes gradients cross the ranks in; None in a single process."""
    if distributed is None:
        return None
    if distributed.shards:
        policies: dict[tuple[str, str], list[str]] = {}
        for name, param_dtype, reduce_dtype in policies_in_force(trained):
            key = (dtype_name(param_dtype), dtype_name(reduce_dtype))
            policies.setdefault(key, []).append(name)
        return {
            "strategy": "fsdp2",
            "policies": [
                {"param_dtype": param, "reduce_dtype": reduce, "modules": modules}
                for (param, reduce), modules in policies.items()
            ],
        }
    ddp = next(m for m in trained.modules() if isinstance(m, DistributedDataParallel))
    hooks = [getattr(hook, "__name__", repr(hook)) for hook, _ in ddp._comm_hooks]
    mixed = ddp.mixed_precision
    return {
        "strategy": "ddp",
        # DDP's buckets hold gradients in their own dtype; a hook may compress them on the way.
        "allreduce_dtypes": (
            [dtype_name(mixed.reduce_dtype)] if mixed is not None else sorted(set(grad_dtypes))
        ),
        "comm_hooks": hooks,
    }
