"""What a job needs from outside its config: the environment, the data on disk, the device, and a
directory to write to.

The pre-flight runs these for every job of a sweep, so a job that could never start fails before
the first one trains. Each check raises ``ConfigError`` with one line. None of them writes a file
or trains anything, and torch is imported only when a job asks for CUDA: the common path stays as
quick as composing the config.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from amp_exp.config.datasets import (
    DatasetConfig,
    DatasetName,
    ImageDatasetConfig,
    TextDatasetConfig,
)
from amp_exp.config.schema import DeviceChoice, RunConfig, WandbMode
from amp_exp.errors import ConfigError

# WANDB_MODE values that wandb.init accepts, including its legacy spellings.
ENV_MODES = {
    "online": WandbMode.online,
    "run": WandbMode.online,
    "offline": WandbMode.offline,
    "dryrun": WandbMode.offline,
    "disabled": WandbMode.disabled,
}
# torchvision's IMG_EXTENSIONS (ImageFolder's default), spelled out: importing torchvision to read
# it would cost every start-up 1.5 s.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Where each torchvision data set lies under dataset.root once downloaded.
TORCHVISION_DATA_DIRS = {
    DatasetName.cifar10: "cifar-10-batches-py",
    DatasetName.cifar100: "cifar-100-python",
    DatasetName.mnist: "MNIST/raw",
    DatasetName.fashion_mnist: "FashionMNIST/raw",
}


def resolve_mode(configured: WandbMode, environ: Mapping[str, str]) -> WandbMode:
    """An explicit wandb.mode wins, as ``wandb.init(mode=...)`` does; under auto, WANDB_MODE."""
    from_env = environ.get("WANDB_MODE", "").strip().lower()
    if configured is not WandbMode.auto or not from_env:
        return configured
    if from_env not in ENV_MODES:
        raise ConfigError(
            f"WANDB_MODE={from_env} is not a W&B mode; use online, offline or disabled"
        )
    return ENV_MODES[from_env]


def image_folder_splits(root: Path) -> tuple[Path, Path | None]:
    """The train and eval folders of an image folder, or (root, None) when the images are not
    split yet and dataset.eval_fraction holds some out."""
    eval_dir = next((root / d for d in ("val", "test") if (root / d).is_dir()), None)
    if (root / "train").is_dir() and eval_dir is not None:
        return root / "train", eval_dir
    return root, None


def _has_image(directory: Path) -> bool:
    # ImageFolder follows links and finds images at any depth below a class folder.
    for _, _, files in os.walk(directory, followlinks=True):
        if any(name.lower().endswith(IMAGE_EXTENSIONS) for name in files):
            return True
    return False


def check_image_folder(root: Path) -> None:
    """Each split has class folders, and each class folder at least one image file (by name:
    opening every image would cost a pass over the data set)."""
    if not root.is_dir():
        raise ConfigError(
            f"dataset.root={root} is not a directory; dataset=image_folder needs "
            "dataset.root=/path/to/images with one sub-folder per class"
        )
    for split in filter(None, image_folder_splits(root)):
        classes = sorted(entry for entry in split.iterdir() if entry.is_dir())
        if not classes:
            raise ConfigError(
                f"dataset.root: {split} has no class sub-folders; put each class's images in "
                "a folder of its own"
            )
        empty = [folder.name for folder in classes if not _has_image(folder)]
        if empty:
            raise ConfigError(
                f"dataset.root: class folder(s) {', '.join(empty)} in {split} hold no image "
                f"file ({', '.join(IMAGE_EXTENSIONS)})"
            )


def check_data(dataset: DatasetConfig) -> None:
    """The data set is on disk, or will be downloaded."""
    if isinstance(dataset, TextDatasetConfig):
        path = Path(dataset.path).expanduser()
        if not (path.is_file() or path.is_dir()):
            raise ConfigError(
                f"dataset.path={dataset.path}: no such file or directory; dataset=text needs "
                "dataset.path=/path/to/file.txt or a folder of .txt files"
            )
        return
    if not isinstance(dataset, ImageDatasetConfig):
        return
    root = Path(dataset.root).expanduser().resolve()
    if dataset.name is DatasetName.image_folder:
        check_image_folder(root)
    folder = TORCHVISION_DATA_DIRS.get(dataset.name)
    if folder is not None and not dataset.download and not (root / folder).is_dir():
        raise ConfigError(
            f"dataset={dataset.name.value}: no copy under {root} (no {folder}/ there); set "
            "dataset.root to it, or dataset.download=true to fetch it"
        )


def require_cuda() -> None:
    """trainer.device=cuda needs a CUDA device that torch can use."""
    import torch  # only when a CUDA device is asked for: the other checks stay light

    if not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.device=cuda, but no CUDA device is available to torch {torch.__version__}; "
            "use trainer.device=auto or trainer.device=cpu"
        )


def check_device(device: DeviceChoice) -> None:
    if device is DeviceChoice.cuda:
        require_cuda()


def check_job(run: RunConfig, environ: Mapping[str, str]) -> None:
    """Everything one job needs that its config alone cannot promise."""
    resolve_mode(run.wandb.mode, environ)
    check_data(run.dataset)
    check_device(run.trainer.device)


def check_output_dir(key: str, value: str) -> None:
    """Hydra can create ``value`` (a run or sweep directory) and write into it.

    A directory is created and removed again in the nearest existing parent: only trying tells a
    read-only file system, /proc or a missing permission apart from a directory that works.
    """
    path = Path(value).expanduser()
    parent = path
    # os.path.exists, unlike Path.exists, says False instead of raising where access is denied.
    while not os.path.exists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(
            f"{key}={value}: {parent} is a file, not a directory; choose another directory"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".amp_exp-probe-", dir=parent))
    except OSError as error:
        raise ConfigError(
            f"{key}={value}: cannot create a directory in {parent} ({error.strerror}); "
            "choose a writable directory"
        ) from None
