"""Epoch orders and loaders shared by every kind of data: images, tokens, the user's own.

The shuffle order of epoch e depends only on (seed, e), so all jobs of a sweep see the same
batches in the same order, whatever model or precision they use. ``set_epoch(e, start_batch)``
lets a resumed run pick up in the middle of an epoch without loading the batches it already
trained on. Under torchrun each rank trains on its own shard of that order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from amp_exp.errors import ConfigError
from amp_exp.launch import ALONE, WorkerRank

# What an eval split is dealt out as: the rows of tensors on the device, or a dataset's indices.
Rows = TypeVar("Rows", torch.Tensor, range)


def epoch_permutation(size: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


def shard(order: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's share of an epoch's order, dealt as DistributedSampler deals it: every
    world_size-th index, after dropping the tail that would give ranks unequal shares."""
    usable = len(order) - len(order) % world_size
    return order[:usable][rank::world_size]


@dataclass(frozen=True)
class Placement:
    """Where a run's data goes: the seed that orders it, the device it lives on, and the worker
    of a data-parallel job whose share it is (``ALONE``: all of it)."""

    seed: int
    device: torch.device
    worker: WorkerRank = ALONE

    def epoch_order(self, size: int, epoch: int) -> torch.Tensor:
        """This worker's shard of epoch ``epoch``'s order of ``size`` training samples."""
        order = epoch_permutation(size, self.seed, epoch)
        return shard(order, self.worker.rank, self.worker.world_size)

    def share(self, rows: Rows) -> Rows:
        """This worker's share of an eval split (a tensor's rows, or a range of indices): every
        world_size-th row, so that the shares of all workers together are the whole split."""
        return rows[self.worker.rank :: self.worker.world_size]


class DeviceTensorLoader:
    """Batches sliced from tensors that already live on the training device.

    Each batch is a tuple holding the same rows of every tensor (images and labels; inputs and
    targets, which may be views of one token tensor).
    """

    def __init__(
        self, *tensors: torch.Tensor, batch_size: int, shuffled_for: Placement | None = None
    ) -> None:
        """``shuffled_for``: the placement whose seed orders each epoch and whose worker takes
        its shard of that order; without one the rows are used whole, in order."""
        self.tensors = tensors
        self.size = len(tensors[0])
        self.batch_size, self.placement = batch_size, shuffled_for
        self.epoch = self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        # Training drops the ragged last batch so every timed step has the same shape.
        if self.placement is not None:
            return self.size // self.placement.worker.world_size // self.batch_size
        return -(-self.size // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if self.placement is not None:
            order = self.placement.epoch_order(self.size, self.epoch).to(self.tensors[0].device)
        for i in range(self.start_batch, len(self)):
            if self.placement is not None:
                index = order[i * self.batch_size : (i + 1) * self.batch_size]
            else:
                index = slice(i * self.batch_size, (i + 1) * self.batch_size)
            yield tuple(tensor[index] for tensor in self.tensors)


class EpochShuffleSampler(Sampler[int]):
    """A DistributedSampler that can also start mid-epoch; one rank of one is a plain shuffle."""

    def __init__(self, size: int, placement: Placement) -> None:
        self.size, self.placement = size, placement
        self.epoch = self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return self.size // self.placement.worker.world_size - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(self.placement.epoch_order(self.size, self.epoch)[self.start :].tolist())


class EpochDataLoader(DataLoader):
    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        if isinstance(self.sampler, EpochShuffleSampler):
            self.sampler.set_epoch(epoch, start_batch * self.batch_size)

    def __iter__(self) -> Iterator:
        try:
            yield from super().__iter__()
        except ConfigError as error:
            # From a worker process, the message comes back with the worker's traceback; its
            # last line holds the one-line message.
            lines = str(error).strip().splitlines()
            if len(lines) == 1:
                raise
            message = lines[-1].partition(f"{ConfigError.__name__}: ")[2]
            raise ConfigError(message or lines[-1]) from None


def check_batch_fits(batch_size: int, samples: int, described: str, world_size: int) -> None:
    """Each rank needs at least one full batch of its share of the training samples."""
    if samples // world_size < batch_size:
        shared = f" shared by {world_size} ranks" if world_size > 1 else ""
        raise ConfigError(f"dataset.batch_size={batch_size} exceeds {described}{shared}")


def tensor_loaders(
    train: tuple[torch.Tensor, ...],
    held_out: tuple[torch.Tensor, ...],
    batch_size: int,
    eval_batch_size: int | None,
    placement: Placement,
    described: str,
) -> tuple[DeviceTensorLoader, DeviceTensorLoader]:
    """Loaders over the rows of tensors on the device: the training rows (``described`` in the
    error if too few) shuffled and sharded over the ranks, and each rank's share of eval."""
    check_batch_fits(batch_size, len(train[0]), described, placement.worker.world_size)
    train_loader = DeviceTensorLoader(*train, batch_size=batch_size, shuffled_for=placement)
    shares = [placement.share(rows) for rows in held_out]
    return train_loader, DeviceTensorLoader(*shares, batch_size=eval_batch_size or batch_size)


def dataset_loaders(
    train: Dataset,
    held_out: Dataset,
    batch_size: int,
    eval_batch_size: int | None,
    num_workers: int,
    placement: Placement,
) -> tuple[EpochDataLoader, EpochDataLoader]:
    """Loaders over map-style datasets: the training order sharded over the ranks, and each
    rank's share of the eval split."""
    described = f"the {len(train)} training samples"
    check_batch_fits(batch_size, len(train), described, placement.worker.world_size)
    common = dict(
        num_workers=num_workers,
        pin_memory=placement.device.type == "cuda",
        persistent_workers=num_workers > 0,
    )
    train_loader = EpochDataLoader(
        train,
        batch_size=batch_size,
        sampler=EpochShuffleSampler(len(train), placement),
        drop_last=True,
        **common,
    )
    eval_share = Subset(held_out, placement.share(range(len(held_out))))
    eval_loader = EpochDataLoader(
        eval_share, batch_size=eval_batch_size or batch_size, shuffle=False, **common
    )
    return train_loader, eval_loader
