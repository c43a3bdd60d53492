"""Image data: synthetic images on the device, torchvision data sets, image folders.

The loaders come from tasks/sampling.py: every epoch's order depends only on (seed, epoch), and
under torchrun each rank trains on its own shard and evaluates its own share of the eval split.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset

from amp_exp.config.cross_checks import check_image_folder, image_folder_splits
from amp_exp.config.datasets import DatasetName, ImageDatasetConfig
from amp_exp.errors import ConfigError, first_line
from amp_exp.launch import WorkerRank
from amp_exp.tasks.base import DataBundle
from amp_exp.tasks.sampling import Placement, dataset_loaders, tensor_loaders


def image_facts(input_shape: tuple[int, int, int], num_classes: int) -> dict:
    return {"input_shape": input_shape, "num_classes": num_classes}


def make_synthetic(
    cfg: ImageDatasetConfig, size: int, seed: int, split: int, device: torch.device
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
    # In place: the same values as prototypes[labels] + noise_std * noise, without two more
    # images-sized buffers to allocate and touch at every start-up.
    images = noise.mul_(cfg.noise_std).add_(prototypes[labels])
    return images.to(device), labels.to(device)


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


def _torchvision_splits(cfg: ImageDatasetConfig, root: Path, worker: WorkerRank):
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

    if cfg.download and worker.world_size > 1:
        # Rank 0 downloads into the shared root while the other ranks wait: ranks downloading
        # into one directory at once would overwrite each other's files.
        if worker.is_main:
            splits = load(download=True)
        torch.distributed.barrier()
        if not worker.is_main:
            splits = load(download=False)
    else:
        splits = load(cfg.download)
    return splits[0], splits[1], shape, classes


def _image_folder_splits(cfg: ImageDatasetConfig, root: Path, seed: int):
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


def build_data(cfg: ImageDatasetConfig, placement: Placement) -> DataBundle:
    """The splits for ``placement``'s worker of a data-parallel job (one alone: all of them)."""
    seed, device = placement.seed, placement.device
    if cfg.name is DatasetName.synthetic:
        train, held_out = tensor_loaders(
            make_synthetic(cfg, cfg.train_size, seed, 0, device),
            make_synthetic(cfg, cfg.eval_size, seed, 1, device),
            cfg.batch_size,
            cfg.eval_batch_size,
            placement,
            f"dataset.train_size={cfg.train_size}",
        )
        shape = (cfg.channels, cfg.image_size, cfg.image_size)
        return DataBundle(train, held_out, image_facts(shape, cfg.num_classes))
    root = Path(cfg.root).expanduser().resolve()
    if cfg.name is DatasetName.image_folder:
        train_set, eval_set, shape, classes = _image_folder_splits(cfg, root, seed)
    else:
        train_set, eval_set, shape, classes = _torchvision_splits(cfg, root, placement.worker)
    train_loader, eval_loader = dataset_loaders(
        train_set, eval_set, cfg.batch_size, cfg.eval_batch_size, cfg.num_workers, placement
    )
    return DataBundle(train_loader, eval_loader, image_facts(shape, classes))
