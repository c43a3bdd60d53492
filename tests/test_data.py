"""Data: the synthetic set is seeded and device-resident; real loaders read real file formats."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from amp_exp.errors import ConfigError
from amp_exp.launch import WorkerRank
from amp_exp.tasks.images import build_data
from amp_exp.tasks.sampling import DeviceTensorLoader, Placement

CPU = torch.device("cpu")


def first_batch(loader) -> tuple[torch.Tensor, torch.Tensor]:
    return next(iter(loader))


def test_synthetic_is_seeded_and_reshuffled_per_epoch(run_cfg) -> None:
    cfg = run_cfg()
    a, b = build_data(cfg.dataset, Placement(0, CPU)), build_data(cfg.dataset, Placement(0, CPU))
    assert isinstance(a.train, DeviceTensorLoader)
    assert torch.equal(first_batch(a.train)[0], first_batch(b.train)[0])
    epoch0 = first_batch(a.train)[1]
    a.train.set_epoch(1)
    assert not torch.equal(epoch0, first_batch(a.train)[1])
    other_seed = build_data(cfg.dataset, Placement(1, CPU))
    assert not torch.equal(first_batch(other_seed.train)[0], first_batch(b.train)[0])


def test_synthetic_shapes_follow_the_config(run_cfg) -> None:
    cfg = run_cfg("dataset.channels=1", "dataset.image_size=12", "dataset.num_classes=7")
    data = build_data(cfg.dataset, Placement(0, CPU))
    images, labels = first_batch(data.train)
    assert data.facts == {"input_shape": (1, 12, 12), "num_classes": 7}
    assert images.shape == (32, 1, 12, 12)
    assert int(labels.max()) < 7
    assert len(data.train) == 256 // 32
    assert sum(len(y) for _, y in data.eval) == 64


def write_fake_cifar10(root, per_batch: int = 20) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "labels": rng.integers(0, 10, per_batch).tolist(),
        }
        (folder / name).write_bytes(pickle.dumps(batch))
    meta = {"label_names": [f"class{i}" for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))


def test_cifar10_loads_real_files(run_cfg, tmp_path, monkeypatch) -> None:
    from torchvision.datasets import cifar

    write_fake_cifar10(tmp_path)
    # The files are real CIFAR pickles but not the published ones, so their checksums differ.
    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: True)
    cfg = run_cfg("dataset=cifar10", f"dataset.root={tmp_path}", "dataset.batch_size=8")
    data = build_data(cfg.dataset, Placement(0, CPU))
    assert data.facts == {"input_shape": (3, 32, 32), "num_classes": 10}
    images, _ = first_batch(data.train)
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
    assert len(data.train) == 100 // 8
    assert sum(len(y) for _, y in data.eval) == 20


def test_missing_dataset_says_how_to_get_it(run_cfg, tmp_path) -> None:
    cfg = run_cfg("dataset=cifar10", f"dataset.root={tmp_path}")
    with pytest.raises(ConfigError, match=r"dataset\.download=true") as raised:
        build_data(cfg.dataset, Placement(0, CPU))
    assert "\n" not in str(raised.value)


def write_image_folder(root, classes=("cat", "dog"), per_class: int = 6) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")


def test_image_folder_holds_out_a_seeded_eval_split(run_cfg, tmp_path) -> None:
    write_image_folder(tmp_path)
    cfg = run_cfg(
        "dataset=image_folder",
        f"dataset.root={tmp_path}",
        "dataset.image_size=16",
        "dataset.batch_size=4",
        "dataset.eval_fraction=0.25",
    )
    data = build_data(cfg.dataset, Placement(0, CPU))
    assert data.facts == {"input_shape": (3, 16, 16), "num_classes": 2}
    images, _ = first_batch(data.train)
    assert images.shape == (4, 3, 16, 16)
    assert len(data.train) == 9 // 4  # 12 images, 3 held out, ragged batch dropped
    assert sum(len(y) for _, y in data.eval) == 3


def test_image_folder_uses_train_and_val_directories(run_cfg, tmp_path) -> None:
    write_image_folder(tmp_path / "train", per_class=4)
    write_image_folder(tmp_path / "val", per_class=2)
    cfg = run_cfg(
        "dataset=image_folder",
        f"dataset.root={tmp_path}",
        "dataset.image_size=16",
        "dataset.batch_size=4",
    )
    data = build_data(cfg.dataset, Placement(0, CPU))
    assert len(data.train) == 2
    assert sum(len(y) for _, y in data.eval) == 4


def test_image_folder_trains_end_to_end(run_cfg, tmp_path) -> None:
    from amp_exp.run import train

    write_image_folder(tmp_path / "images")
    cfg = run_cfg(
        "dataset=image_folder",
        f"dataset.root={tmp_path / 'images'}",
        "dataset.image_size=16",
        "dataset.batch_size=4",
        "model.width=4",
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["dataset"] == "image_folder" and summary["steps"] == 4


@pytest.mark.parametrize("rank", [0, 1])
def test_under_ddp_rank_0_downloads_while_the_others_wait(run_cfg, tmp_path, monkeypatch, rank):
    import torchvision
    from torchvision.datasets import cifar

    write_fake_cifar10(tmp_path)
    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: True)
    events = []

    class RecordingCIFAR10(torchvision.datasets.CIFAR10):
        def __init__(self, *args, download: bool, **kwargs) -> None:
            events.append(f"load(download={download})")
            super().__init__(*args, download=False, **kwargs)

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", RecordingCIFAR10)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: events.append("barrier"))
    cfg = run_cfg("dataset=cifar10", f"dataset.root={tmp_path}", "dataset.download=true")
    data = build_data(cfg.dataset, Placement(0, CPU, WorkerRank(rank, 2, rank)))
    expected = {
        0: ["load(download=True)"] * 2 + ["barrier"],
        1: ["barrier"] + ["load(download=False)"] * 2,
    }
    assert events == expected[rank]
    assert sum(len(y) for _, y in data.eval) == 10  # this rank's half of the 20 test images
