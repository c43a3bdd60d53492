"""Datasets and loaders: synthetic images on the device, torchvision data sets, image folders.

Every train loader has ``set_epoch``: the shuffle order of epoch e depends only on (seed, e), so
all jobs of a sweep see the same batches in the same order, whatever model or precision they use.
Its ``start_batch`` lets a resumed run pick up in the middle of an epoch without loading the
batches it already trained on. Under torchrun each rank trains on its own shard of that order and
evaluates its own share of the eval split.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from amp_exp.config.checks import check_image_folder, image_folder_splits
from amp_exp.config.schema import DatasetConfig, DatasetName
from amp_exp.errors import ConfigError, first_line
from amp_exp.tasks.base import DataBundle


def image_facts(input_shape: tuple[int, int, int], num_classes: int) -> dict:
    return {"input_shape": input_shape, "num_classes": num_classes}


def epoch_permutation(size: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


def shard(order: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's share of an epoch's order, dealt as DistributedSampler deals it: every
    world_size-th index, after dropping the tail that would give ranks unequal shares."""
    usable = len(order) - len(order) % world_size
    return order[:usable][rank::world_size]


class DeviceTensorLoader:
    """Batches sliced from tensors that already live on the training device."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """``rank`` and ``world_size`` shard the shuffled order; unshuffled data is used whole."""
        self.images, self.labels = images, labels
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        # Training drops the ragged last batch so every timed step has the same shape.
        if self.shuffle:
            return len(self.labels) // self.world_size // self.batch_size
        return -(-len(self.labels) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.shuffle:
            order = epoch_permutation(len(self.labels), self.seed, self.epoch)
            order = shard(order, self.rank, self.world_size).to(self.images.device)
        for i in range(self.start_batch, len(self)):
            if self.shuffle:
                index = order[i * self.batch_size : (i + 1) * self.batch_size]
                yield self.images[index], self.labels[index]
            else:
                batch = slice(i * self.batch_size, (i + 1) * self.batch_size)
                yield self.images[batch], self.labels[batch]


def make_synthetic(
    cfg: DatasetConfig, size: int, seed: int, split: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images = a smooth per-class prototype plus noise: learnable, but not in one step.

    The prototypes depend only on ``seed``, so the train split (0) and the eval split (1) share
    their classes and differ only in labels and noise.
    """
    prototypes_rng = torch.Generator().manual_seed(seed)
    coarse = torch.randn(cfg.num_classes, cfg.channels, 4, 4, generator=prototypes_rng)
    prototypes = F.interpolate(coarse, size=cfg.image_size, mode="bilinear", align_corners=False)
    samples_rng = torch.Generator().manual_seed(seed * 1_000_003 + 1 + split)
    labels = torch.randint(cfg.num_classes, (size,), generator=samples_rng)
    noise = torch.randn(size, cfg.channels, cfg.image_size, cfg.image_size, generator=samples_rng)
    images = prototypes[labels] + cfg.noise_std * noise
    return images.to(device), labels.to(device)


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


def load_image(path: str):
    """ImageFolder's loader, with an unreadable file named in one line."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as file:
            return Image.open(file).convert("RGB")
    except UnidentifiedImageError:
        reason = "not an image file PIL can read"
    except OSError as error:  # unreadable, or truncated
        reason = error.strerror or first_line(str(error))
    raise ConfigError(f"dataset.root: cannot read image {path} ({reason}); remove or replace it")


TORCHVISION_SETS = {
    # name: (class name, input shape, classes, normalization mean, std)
    DatasetName.cifar10: (
        "CIFAR10",
        (3, 32, 32),
        10,
        (0.4914, 0.4822, 0.4465),
        (0.247, 0.243, 0.261),
    ),
    DatasetName.cifar100: (
        "CIFAR100",
        (3, 32, 32),
        100,
        (0.5071, 0.4865, 0.4409),
        (0.267, 0.256, 0.276),
    ),
    DatasetName.mnist: ("MNIST", (1, 28, 28), 10, (0.1307,), (0.3081,)),
    DatasetName.fashion_mnist: ("FashionMNIST", (1, 28, 28), 10, (0.2860,), (0.3530,)),
}
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _torchvision_splits(cfg: DatasetConfig, root: Path, rank: int, world_size: int):
    import torchvision
    from torchvision import transforms

    class_name, shape, classes, mean, std = TORCHVISION_SETS[cfg.name]
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    dataset_class = getattr(torchvision.datasets, class_name)

    def load(download: bool) -> list[Dataset]:
        try:
            return [
                dataset_class(str(root), train=train, download=download, transform=transform)
                for train in (True, False)
            ]
        except RuntimeError as error:
            raise ConfigError(
                f"dataset={cfg.name.value}: no usable copy under {root} ({error}); "
                "set dataset.root to it, or dataset.download=true to fetch it"
            ) from None

    if cfg.download and world_size > 1:
        # Rank 0 downloads into the shared root while the other ranks wait: ranks downloading
        # into one directory at once would overwrite each other's files.
        if rank == 0:
            splits = load(download=True)
        torch.distributed.barrier()
        if rank != 0:
            splits = load(download=False)
    else:
        splits = load(cfg.download)
    return splits[0], splits[1], shape, classes


def _image_folder_splits(cfg: DatasetConfig, root: Path, seed: int):
    from torchvision import datasets, transforms

    check_image_folder(root)
    transform = transforms.Compose(
        [
            transforms.Resize(cfg.image_size),
            transforms.CenterCrop(cfg.image_size),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    train_dir, eval_dir = image_folder_splits(root)
    if eval_dir is not None:
        train = datasets.ImageFolder(str(train_dir), transform=transform, loader=load_image)
        held_out = datasets.ImageFolder(str(eval_dir), transform=transform, loader=load_image)
        classes = len(train.classes)
    else:
        full = datasets.ImageFolder(str(root), transform=transform, loader=load_image)
        order = torch.randperm(len(full), generator=torch.Generator().manual_seed(seed)).tolist()
        eval_count = max(1, round(len(full) * cfg.eval_fraction))
        train, held_out = Subset(full, order[eval_count:]), Subset(full, order[:eval_count])
        classes = len(full.classes)
    return train, held_out, (3, cfg.image_size, cfg.image_size), classes


def check_batch_fits(batch_size: int, samples: int, described: str, world_size: int) -> None:
    """Each rank needs at least one full batch of its share of the training samples."""
    if samples // world_size < batch_size:
        shared = f" shared by {world_size} ranks" if world_size > 1 else ""
        raise ConfigError(f"dataset.batch_size={batch_size} exceeds {described}{shared}")


def _loaders(
    cfg: DatasetConfig,
    train: Dataset,
    held_out: Dataset,
    seed: int,
    device: torch.device,
    rank: int,
    world_size: int,
) -> tuple[EpochDataLoader, EpochDataLoader]:
    check_batch_fits(cfg.batch_size, len(train), f"the {len(train)} training samples", world_size)
    common = dict(
        num_workers=cfg.num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )
    train_loader = EpochDataLoader(
        train,
        batch_size=cfg.batch_size,
        sampler=EpochShuffleSampler(len(train), seed, rank, world_size),
        drop_last=True,
        **common,
    )
    eval_share = Subset(held_out, range(rank, len(held_out), world_size))
    eval_loader = EpochDataLoader(
        eval_share, batch_size=cfg.eval_batch_size or cfg.batch_size, shuffle=False, **common
    )
    return train_loader, eval_loader


def build_data(
    cfg: DatasetConfig, seed: int, device: torch.device, rank: int = 0, world_size: int = 1
) -> DataBundle:
    """The splits for ``rank`` of ``world_size`` data-parallel ranks (0 of 1: all of them)."""
    eval_batch_size = cfg.eval_batch_size or cfg.batch_size
    if cfg.name is DatasetName.synthetic:
        check_batch_fits(
            cfg.batch_size, cfg.train_size, f"dataset.train_size={cfg.train_size}", world_size
        )
        train = DeviceTensorLoader(
            *make_synthetic(cfg, cfg.train_size, seed, 0, device),
            cfg.batch_size,
            True,
            seed,
            rank,
            world_size,
        )
        eval_images, eval_labels = make_synthetic(cfg, cfg.eval_size, seed, 1, device)
        held_out = DeviceTensorLoader(
            eval_images[rank::world_size],
            eval_labels[rank::world_size],
            eval_batch_size,
            False,
            seed,
        )
        shape = (cfg.channels, cfg.image_size, cfg.image_size)
        return DataBundle(train, held_out, image_facts(shape, cfg.num_classes))
    root = Path(cfg.root).expanduser().resolve()
    if cfg.name is DatasetName.image_folder:
        train_set, eval_set, shape, classes = _image_folder_splits(cfg, root, seed)
    else:
        train_set, eval_set, shape, classes = _torchvision_splits(cfg, root, rank, world_size)
    train_loader, eval_loader = _loaders(cfg, train_set, eval_set, seed, device, rank, world_size)
    return DataBundle(train_loader, eval_loader, image_facts(shape, classes))
