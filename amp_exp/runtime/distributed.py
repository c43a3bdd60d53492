"""Data-parallel training under torchrun: the process group and the few collectives a run needs.

Gradients are averaged by DistributedDataParallel during backward, before the GradScaler looks
for inf, so every rank skips the same steps and keeps the same scale. Everything else here runs
only at log intervals, checkpoints and the end of a run, never per step, so the hot loop gains no
host sync beyond DDP's own gradient all-reduce.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amp_exp.config.schema import DeviceChoice
from amp_exp.runtime.hardware import resolve_device
from amp_exp.runtime.ranks import WorkerRank, torchrun_store, worker_rank

log = logging.getLogger("amp_exp")


class Distributed:
    """This process's share of a data-parallel run: its rank, device and model replica."""

    def __init__(self, rank: WorkerRank, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.world_size = rank.world_size
        self.is_main = rank.is_main
        self.replica: DistributedDataParallel | None = None

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        """DDP broadcasts rank 0's parameters and buffers here, so all replicas start equal."""
        device_ids = [self.device] if self.device.type == "cuda" else None
        self.replica = DistributedDataParallel(model, device_ids=device_ids)
        return self.replica

    def no_sync(self) -> contextlib.AbstractContextManager:
        """For all but the last micro-batch of an accumulated step: no gradient all-reduce."""
        assert self.replica is not None, "wrap() the model first"
        return self.replica.no_sync()

    def broadcast_buffers(self, module: nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics), as a DDP forward does."""
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def max(self, value: float) -> float:
        """The largest of the ranks' values, on every rank (reads the device)."""
        largest = torch.tensor(float(value), device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return largest.item()

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on one (reads the device: log intervals only)."""
        return self.max(flag) > 0

    def replicas_identical(self, tensors: list[torch.Tensor]) -> bool:
        """Whether every rank holds bit for bit what rank 0 holds in ``tensors``."""
        local = torch.cat([t.detach().reshape(-1).to(self.device, torch.float64) for t in tensors])
        reference = local.clone()
        dist.broadcast(reference, src=0)
        # NaN != NaN, so compare bits: a replica that diverged to NaN still counts as equal to
        # another that holds the same NaNs.
        mismatch = not torch.equal(local.view(torch.int64), reference.view(torch.int64))
        return not self.any(mismatch)


def unwrap(model: nn.Module) -> nn.Module:
    """The module the user built, inside the wrappers of torch.compile and DDP."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


# Process groups this process has opened: a multirun opens one per job.
_groups_opened = itertools.count()


def agent_store() -> dist.Store | None:
    """A fresh corner of torchrun's store for the next process group; None outside torchrun.

    torchrun's store outlives a worker group it restarts, and a multirun opens one process group
    per job. The default env:// rendezvous uses the same keys every time, so a new group can read
    the previous one's stale addresses and fail or hang; the restart count and this process's
    group count, the same on every rank, give each group keys of its own.
    """
    store = torchrun_store()
    if store is None:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"amp_exp/process_group/{attempt}/{next(_groups_opened)}", store)


@contextlib.contextmanager
def process_group(choice: DeviceChoice) -> Iterator[Distributed | None]:
    """Join torchrun's process group for the length of a run; None outside torchrun.

    NCCL on CUDA, with each rank pinned to its local GPU; gloo on the CPU. A group the caller
    already initialized is used as it is and left open.
    """
    rank = worker_rank()
    if rank is None:
        yield None
        return
    device = resolve_device(choice, rank.local_rank)
    owned = not dist.is_initialized()
    if owned and "MASTER_ADDR" not in os.environ:
        # submitit's tasks: torch's env:// rendezvous needs the first node's address and a port.
        import submitit

        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    if owned:
        store = agent_store()
        placement = {}
        if store is not None:
            placement = {"store": store, "rank": rank.rank, "world_size": rank.world_size}
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, **placement)
        else:
            dist.init_process_group("gloo", **placement)
    if not rank.is_main:
        # Rank 0 speaks for the job; the other ranks report only errors.
        log.setLevel(logging.ERROR)
    try:
        yield Distributed(rank, device)
    finally:
        if owned:
            dist.destroy_process_group()
