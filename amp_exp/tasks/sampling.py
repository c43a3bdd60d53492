"""Epoch orders and loaders shared by every kind of data: images, tokens, the user's own.

The shuffle order of epoch e depends only on (seed, e), so all jobs of a sweep see the same
batches in the same order, whatever model or precision they use. ``set_epoch(e, start_batch)``
lets a resumed run pick up in the middle of an epoch without loading the batches it already
trained on. Under torchrun each rank trains on its own shard of that order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from amp_exp.errors import ConfigError


def epoch_permutation(size: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


def shard(order: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's share of an epoch's order, dealt as DistributedSampler deals it: every
    world_size-th index, after dropping the tail that would give ranks unequal shares."""
    usable = len(order) - len(order) % world_size
    return order[:usable][rank::world_size]


class DeviceTensorLoader:
    """Batches sliced from tensors that already live on the training device.

    Each batch is a tuple holding the same rows of every tensor (images and labels; inputs and
    targets, which may be views of one token tensor).
    """

    def __init__(
        self,
        *tensors: torch.Tensor,
        batch_size: int,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """``rank`` and ``world_size`` shard the shuffled order; unshuffled data is used whole."""
        self.tensors = tensors
        self.size = len(tensors[0])
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        # Training drops the ragged last batch so every timed step has the same shape.
        if self.shuffle:
            return self.size // self.world_size // self.batch_size
        return -(-self.size // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if self.shuffle:
            order = epoch_permutation(self.size, self.seed, self.epoch)
            order = shard(order, self.rank, self.world_size).to(self.tensors[0].device)
        for i in range(self.start_batch, len(self)):
            if self.shuffle:
                index = order[i * self.batch_size : (i + 1) * self.batch_size]
            else:
                index = slice(i * self.batch_size, (i + 1) * self.batch_size)
            yield tuple(tensor[index] for tensor in self.tensors)


class EpochShuffleSampler(Sampler[int]):
    """A DistributedSampler that can also start mid-epoch; one rank of one is a plain shuffle."""

    def __init__(self, size: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.size, self.seed, self.rank, self.world_size = size, seed, rank, world_size
        self.epoch = self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return self.size // self.world_size - self.start

    def __iter__(self) -> Iterator[int]:
        order = shard(
            epoch_permutation(self.size, self.seed, self.epoch), self.rank, self.world_size
        )
        return iter(order[self.start :].tolist())


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


def dataset_loaders(
    train: Dataset,
    held_out: Dataset,
    batch_size: int,
    eval_batch_size: int | None,
    num_workers: int,
    seed: int,
    device: torch.device,
    rank: int,
    world_size: int,
) -> tuple[EpochDataLoader, EpochDataLoader]:
    """Loaders over map-style datasets: the training order sharded over the ranks, and each
    rank's share of the eval split."""
    check_batch_fits(batch_size, len(train), f"the {len(train)} training samples", world_size)
    common = dict(
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
    )
    train_loader = EpochDataLoader(
        train,
        batch_size=batch_size,
        sampler=EpochShuffleSampler(len(train), seed, rank, world_size),
        drop_last=True,
        **common,
    )
    eval_share = Subset(held_out, range(rank, len(held_out), world_size))
    eval_loader = EpochDataLoader(
        eval_share, batch_size=eval_batch_size or batch_size, shuffle=False, **common
    )
    return train_loader, eval_loader
