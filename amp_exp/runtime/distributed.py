"""Data-parallel training under torchrun: the process group, the strategy that spreads the model
over it (DDP or FSDP2), and the few collectives a run needs.

Under DDP gradients are averaged during backward, before the GradScaler looks for inf, so every
rank skips the same steps and keeps the same scale. Under FSDP2 each rank's GradScaler sees only
its shard of the gradients, and DTensor's own handler of the inf check takes the MAX of the
ranks' found-inf flags, so there too all ranks skip together (tests/test_fsdp.py injects an inf
into one rank's shard). Everything else here runs only at log intervals, evaluations, checkpoints
and the end of a run, never per step.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amp_exp.config.schema import DeviceChoice, Strategy
from amp_exp.errors import RuntimeFault
from amp_exp.launch import (
    ALONE,
    WorkerRank,
    peer_pids,
    publish_pid,
    torchrun_store,
    worker_rank,
)
from amp_exp.runtime import fsdp
from amp_exp.runtime.hardware import resolve_device

log = logging.getLogger("amp_exp")


# How gloo says that the other end of a connection is gone.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
PEER_EXIT_S = 5.0
# How long a closing gloo group leaves its worker threads to free what they hold (close_group).
GLOO_SETTLE_S = 0.2


class Distributed:
    """This process's share of a data-parallel run: its rank, device, strategy and model."""

    def __init__(
        self, rank: WorkerRank, device: torch.device, strategy: Strategy = Strategy.ddp
    ) -> None:
        self.rank, self.device, self.strategy = rank, device, strategy
        self.world_size = rank.world_size
        self.is_main = rank.is_main
        self.trained: nn.Module | None = None

    @property
    def shards(self) -> bool:
        """Whether each rank holds a shard of the model (FSDP2), not a replica (DDP)."""
        return self.strategy is Strategy.fsdp2

    def wrap(
        self,
        model: nn.Module,
        dtypes: fsdp.ShardingDtypes,
        blocks: Sequence[nn.Module] = (),
        keep_fp32: Sequence[str] = (),
    ) -> nn.Module:
        """The module that trains: a DDP replica, or (FSDP2) ``model`` itself, sharded in place
        block by block, with the ``keep_fp32`` modules under an fp32 policy.

        Either way every rank starts from rank 0's weights: DDP broadcasts them here, and every
        rank built the same weights from the same seed before FSDP2 sharded them. Gradients are
        summed in ``dtypes.reduce`` under either strategy.
        """
        if self.shards:
            self.trained = fsdp.shard_model(model, dtypes, self.device, blocks, keep_fp32)
            return self.trained
        device_ids = [self.device] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        reduce_dtype = fsdp.DTYPES[dtypes.reduce]
        if any(p.dtype != reduce_dtype for p in model.parameters() if p.requires_grad):
            ddp.register_comm_hook(None, reduce_in(reduce_dtype))
        self.trained = ddp
        return ddp

    def no_sync(self) -> contextlib.AbstractContextManager:
        """For all but the last micro-batch of an accumulated step: no gradient reduction."""
        assert self.trained is not None, "wrap() the model first"
        if self.shards:
            return fsdp.no_gradient_sync(self.trained)
        return self.trained.no_sync()  # type: ignore[operator]

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[nn.Module]:
        """The module to evaluate on, whose forwards are no collective: a rank without eval
        batches never joins one. Every rank takes rank 0's buffers (BatchNorm statistics) first,
        as a DDP forward would; FSDP2 never syncs them otherwise."""
        module = unwrap(model)
        self.broadcast_buffers(module)
        if not self.shards:
            yield module
            return
        with fsdp.unsharded(module) as gathered:
            yield gathered

    def state_of(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, Any]:
        """The model's and optimizer's state: whole under DDP, this rank's shards under FSDP2
        (with rank 0's buffers on every rank first: DCP has one rank write each buffer)."""
        if not self.shards:
            return plain_state(model, optimizer)
        self.broadcast_buffers(model)
        return fsdp.sharded_state(model, optimizer)

    def load_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optimizer_state: Any,
    ) -> None:
        if self.shards:
            fsdp.load_sharded_state(model, optimizer, model_state, optimizer_state)
        else:
            load_plain_state(model, optimizer, model_state, optimizer_state)

    def broadcast_buffers(self, module: nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics), as a DDP forward does."""
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduced(tensor, dist.ReduceOp.SUM)

    def maximum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise largest of the ranks' ``tensor``, on every rank."""
        return all_reduced(tensor, dist.ReduceOp.MAX)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (a small picklable object), in rank order, on every rank."""
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def max(self, value: float) -> float:
        """The largest of the ranks' values, on every rank (reads the device)."""
        return self.maximum(torch.tensor(float(value), device=self.device)).item()

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


def all_reduced(tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    """``tensor`` reduced over the ranks by ``op``, in a copy (``tensor`` is left as it was)."""
    reduced = tensor.clone()
    dist.all_reduce(reduced, op=op)
    return reduced


def reduce_in(dtype: torch.dtype):
    """A DDP communication hook that sums each gradient bucket over the ranks in ``dtype``.

    bf16_true's gradients are bf16: summed in bf16, a ring all-reduce rounds at every hop; summed
    in fp32 (as FSDP2's reduce_dtype does) the mean rounds once, back into the bucket.
    """

    # Unannotated: DDP checks a hook's annotations against the classes themselves, which this
    # module's postponed (string) annotations are not.
    def hook(group, bucket):
        buffer = bucket.buffer()
        # DDP's own hook divides before it sums too, which keeps the sum in range.
        mean = buffer.to(dtype).div_(dist.get_world_size(group))

        def cast_back(done):
            return buffer.copy_(done.value()[0])

        return dist.all_reduce(mean, group=group, async_op=True).get_future().then(cast_back)

    return hook


def peer_gone(error: Exception) -> bool:
    """Whether ``error`` is the transport saying the other end of a connection is gone."""
    return isinstance(error, dist.DistError) or any(words in str(error) for words in PEER_GONE)


def lost_ranks(patience_s: float = 0.0) -> list[str]:
    """The other ranks on this node whose process has died, as "rank N (pid P)".

    A collective whose peer died fails with the transport's words for it (gloo: "Connection
    closed by peer [address]:port"), which name no rank; the pids the ranks published at the
    start do (``ranks.publish_pid``). A peer's connections close before its process is gone:
    ``patience_s`` is how long it may take to die. Ranks on other nodes cannot be looked at.
    """
    peers = peer_pids()
    deadline = time.monotonic() + patience_s
    while True:
        lost = [f"rank {r} (pid {pid})" for r, pid in peers.items() if not process_alive(pid)]
        if lost or not peers or time.monotonic() >= deadline:
            return lost
        time.sleep(0.05)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this node runs: a zombie (dead, not yet reaped by torchrun's
    agent) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc to read: only whether the pid exists can be told
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    # "pid (command) state ...": the command may hold spaces and parentheses.
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def plain_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole model's state (from inside its wrappers) and the optimizer's."""
    return unwrap(model).state_dict(), optimizer.state_dict()


def load_plain_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
) -> None:
    unwrap(model).load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)


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
def process_group(
    choice: DeviceChoice, strategy: Strategy = Strategy.ddp
) -> Iterator[Distributed | None]:
    """Join torchrun's process group for the length of a run; None outside torchrun.

    NCCL on CUDA, with each rank pinned to its local GPU; gloo on the CPU. A group the caller
    already initialized is used as it is and left open. FSDP2 outside torchrun trains in a group
    of one process, so that one code path (DTensors, DCP checkpoints) serves every world size;
    its store lives in this process (a HashStore): one rank has no one to meet, so it needs no
    port and no file. A run that fails because another rank of this node died raises
    ``RuntimeFault`` naming it.
    """
    rank = worker_rank()
    if rank is None and strategy is not Strategy.fsdp2:
        yield None
        return
    alone = rank is None
    rank = rank or ALONE
    device = resolve_device(choice, None if alone else rank.local_rank)
    owned = not dist.is_initialized()
    if owned and not alone and "MASTER_ADDR" not in os.environ:
        # submitit's tasks: torch's env:// rendezvous needs the first node's address and a port.
        import submitit

        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    if owned:
        store = dist.HashStore() if alone else agent_store()
        placement = {}
        if store is not None:
            placement = {"store": store, "rank": rank.rank, "world_size": rank.world_size}
        # NCCL on CUDA, bound to the device; gloo on the CPU.
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, **placement)
        else:
            dist.init_process_group("gloo", **placement)
    if not rank.is_main:
        # Rank 0 speaks for the job; the other ranks report only errors.
        log.setLevel(logging.ERROR)
    publish_pid()
    try:
        yield Distributed(rank, device, strategy)
    except Exception as error:
        patience_s, sigterm = 0.0, None
        if peer_gone(error) and not alone:
            patience_s = PEER_EXIT_S
            if threading.current_thread() is threading.main_thread():
                # torchrun's agent SIGTERMs every worker once one has died; this one finds out
                # which, records its failure and exits (the agent SIGKILLs it in 30 s otherwise).
                sigterm = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        lost = lost_ranks(patience_s)
        if not lost:
            if sigterm is not None:
                signal.signal(signal.SIGTERM, sigterm)
            raise
        # The collective that failed says only that a connection closed; the cause is the rank
        # that died.
        raise RuntimeFault(
            f"lost {', '.join(lost)} of {rank.world_size}: its process died, so the run cannot "
            "go on; resume=auto continues from the last checkpoint"
        ) from None
    finally:
        if owned:
            close_group(device)


def close_group(device: torch.device) -> None:
    """Destroy the default process group, and on gloo let its worker threads finish first.

    A gloo worker thread drops each collective it ran once the caller's ``wait()`` has returned,
    and freeing the collective's tensors takes the GIL. A thread that asks for the GIL after the
    interpreter began to finalize is made to exit, which aborts the process ("terminate called
    without an active exception", pytorch/pytorch#179291): a run that ends right after its last
    collective died with SIGABRT about one time in five on two busy cores. ``destroy_process_group``
    does not join gloo's threads; sleeping releases the GIL so that they can finish while the
    interpreter still runs.
    """
    dist.destroy_process_group()
    if device.type != "cuda":
        time.sleep(GLOO_SETTLE_S)
