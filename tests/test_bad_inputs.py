"""Every bad input fails with one line and exit status 2, before any job trains, touching no file.

Most cases run the pre-flight (``check_overrides``) in this process; a handful run
``python -m amp_exp`` as a user does, to check the exit status, the single line on stderr and
that nothing was written outside the run directory.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from amp_exp.config.cross_checks import IMAGE_EXTENSIONS, TORCHVISION_DATA_DIRS
from amp_exp.config.datasets import DatasetName
from amp_exp.config.preflight import CONF_DIR, check_overrides
from amp_exp.errors import ConfigError, RuntimeFault
from helpers.disks import FULL, fill, small_disk
from helpers.runs import FAST, TINY_MLP
from helpers.warm_python import python_m

# About what happens around training (a refused write, an unreadable file), not a precision.
FP32_MLP = [*TINY_MLP, "precision=fp32"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
BROKEN_YAML = "# @package _global_\nseed: [1,\n"
USER_EXPERIMENT = "# @package _global_\nseed: 7\n"


def write_images(root: Path, classes=("cat", "dog"), per_class: int = 2) -> None:
    from PIL import Image

    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (8, 8), (40 * i, 80, 120)).save(root / name / f"{i}.png")


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch) -> Path:
    """A launch directory holding the bad (and good) things the cases point at."""
    (tmp_path / "empty").mkdir()
    for name in ("cat", "dog"):
        (tmp_path / "no_images" / name).mkdir(parents=True)
        (tmp_path / "no_images" / name / "notes.txt").write_text("not an image")
    write_images(tmp_path / "images")
    (tmp_path / "a_file").write_text("a regular file")
    experiments = tmp_path / "userconf" / "experiment"
    experiments.mkdir(parents=True)
    (experiments / "broken.yaml").write_text(BROKEN_YAML)
    (experiments / "mine.yaml").write_text(USER_EXPERIMENT)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# (command line, a fragment of the one-line message); {tmp} is the launch directory.
BAD_INPUTS = [
    (["precision=fp32,bf16"], "precision=fp32,bf16 sweeps precision: add -m (--multirun)"),
    (["seed=-1"], "seed=-1 must lie in [0, 2**32 - 1]"),
    (["seed=4294967296"], "seed=4294967296 must lie in [0, 2**32 - 1]"),
    (["-m", "seed=0,-1"], "seed=-1 must lie in"),
    (
        ["model=null"],
        "model=null is not an option; valid choices: custom, gpt2_small, gpt_tiny, hf, hf_gpt2",
    ),
    (["-m", "model=mlp,null"], "model=null is not an option; valid choices: custom, gpt2_small"),
    (["experiment=null"], "experiment=null is not an option; valid choices: clip_sweep"),
    (["optimizer.lr=inf"], "optimizer.lr=inf must be a finite number"),
    (["optimizer.lr=nan"], "optimizer.lr=nan must be a finite number"),
    (["precision.init_scale=inf"], "precision.init_scale=inf must be a finite number"),
    (["dataset.noise_std=inf"], "dataset.noise_std=inf must be a finite number"),
    (["-m", "precision.init_scale=1024,inf"], "precision.init_scale=inf must be a finite"),
    (["+foo=1"], "foo is not a known key or config group; valid top-level keys: checkpoint"),
    (["+newgroup=x"], "newgroup is not a known key or config group"),
    (["wandb.project=a/b"], "wandb.project='a/b': W&B project names have at most 128"),
    (["resume=''"], "resume='' is empty; use resume=null (start fresh), resume=auto"),
    (["trainer.grad_accum_steps=64"], "an epoch has 32 batches"),
    (["-m", "trainer.grad_accum_steps=1,64"], "fewer than trainer.grad_accum_steps=64"),
    (["dataset.batch_size=8192"], "dataset.batch_size=8192 exceeds dataset.train_size=4096"),
    (["dataset=image_folder", "dataset.root=empty"], "empty has no class sub-folders"),
    (["dataset=image_folder", "dataset.root=no_images"], "cat, dog in {tmp}/no_images hold no"),
    (["-m", "dataset=image_folder", "dataset.root=images,empty"], "has no class sub-folders"),
    (["dataset=cifar10", "dataset.root=empty"], "dataset=cifar10: no copy under {tmp}/empty"),
    (
        ["--config-dir", "userconf", "experiment=broken"],
        "{tmp}/userconf/experiment/broken.yaml: not valid YAML at line 3, column 1",
    ),
    (
        ["experiment=broken", "hydra.searchpath=[file://{tmp}/userconf]"],
        "broken.yaml: not valid YAML",
    ),
    (["--config-dir", "no_such_dir"], "--config-dir no_such_dir: no such directory"),
    (["hydra.run.dir=a_file/run"], "hydra.run.dir=a_file/run: a_file is a file, not a directory"),
    (["-m", "hydra.sweep.dir=a_file/sweep", "seed=1,2"], "a_file is a file, not a directory"),
    (["hydra.run.dir=/proc/amp_exp_run"], "cannot create a directory in /proc"),
    # Decided by the config alone: before job 0, not when job 1 starts.
    (
        ["-m", "trainer.activation_checkpointing=false,true"],
        "trainer.activation_checkpointing=true recomputes the blocks of a transformer "
        "(model.blocks, or a Hugging Face model's _no_split_modules), and model tiny_cnn has "
        "none; set it to false",
    ),
    (["model=mlp", "trainer.activation_checkpointing=true"], "model mlp has none"),
    pytest.param(
        ["-m", "trainer.device=cpu,cuda"],
        "trainer.device=cuda, but no CUDA device is available",
        marks=NO_CUDA,
    ),
]


@pytest.mark.parametrize(("argv", "expected"), BAD_INPUTS)
def test_preflight_rejects_bad_input_in_one_line(workspace, argv, expected) -> None:
    argv = [arg.format(tmp=workspace) for arg in argv]
    with pytest.raises(ConfigError) as raised:
        check_overrides(argv)
    message = str(raised.value)
    assert expected.format(tmp=workspace) in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "argv",
    [
        ["--config-dir", "userconf", "experiment=mine"],
        ["-m", "experiment=mine", "seed=1,2", "hydra.searchpath=[file://{tmp}/userconf]"],
        ["-m", "--config-dir", "userconf", "experiment=mine", "seed=1,2"],
    ],
)
def test_preflight_finds_a_users_experiment_file(workspace, argv) -> None:
    check_overrides([arg.format(tmp=workspace) for arg in argv])


def test_preflight_reads_the_config_path_that_replaces_conf(workspace) -> None:
    shutil.copytree(CONF_DIR, workspace / "myconf")
    (workspace / "myconf" / "experiment" / "mine.yaml").write_text(USER_EXPERIMENT)
    check_overrides(["--config-path", str(workspace / "myconf"), "experiment=mine"])


def test_preflight_names_a_read_only_output_file_system(workspace, monkeypatch) -> None:
    def read_only(**kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr("amp_exp.config.cross_checks.tempfile.mkdtemp", read_only)
    with pytest.raises(ConfigError) as raised:
        check_overrides([f"hydra.run.dir={workspace}/archive/run"])
    assert str(raised.value) == (
        f"hydra.run.dir={workspace}/archive/run: cannot create a directory in {workspace} "
        "(Read-only file system); choose a writable directory"
    )


def test_preflight_checks_only_jobs_the_sweep_runs(workspace) -> None:
    """The default dataset.root=data does not exist, and no job of this sweep uses it."""
    check_overrides(["-m", "dataset=image_folder", f"dataset.root=images,{workspace}/images"])


def test_preflight_rejects_a_bad_wandb_mode_in_the_environment(workspace, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ConfigError, match="WANDB_MODE=bogus is not a W&B mode"):
        check_overrides(["-m", "seed=1,2"])
    check_overrides(["wandb.mode=disabled"])  # an explicit mode wins over the environment


def test_preflight_writes_nothing(workspace) -> None:
    before = snapshot(workspace)
    check_overrides(["-m", "seed=1,2", "hydra.sweep.dir=sweep"])
    assert snapshot(workspace) == before


def test_preflight_knows_torchvisions_image_extensions_and_data_folders() -> None:
    """The pre-flight spells these out to stay clear of importing torchvision."""
    from torchvision import datasets
    from torchvision.datasets.folder import IMG_EXTENSIONS

    assert IMAGE_EXTENSIONS == IMG_EXTENSIONS
    assert {
        DatasetName.cifar10: datasets.CIFAR10.base_folder,
        DatasetName.cifar100: datasets.CIFAR100.base_folder,
        DatasetName.mnist: f"{datasets.MNIST.__name__}/raw",
        DatasetName.fashion_mnist: f"{datasets.FashionMNIST.__name__}/raw",
    } == TORCHVISION_DATA_DIRS


@pytest.mark.parametrize("num_workers", [0, 2])
def test_unreadable_image_fails_in_one_line_naming_the_file(run_cfg, tmp_path, num_workers):
    from amp_exp.tasks.images import build_data
    from amp_exp.tasks.sampling import Placement

    write_images(tmp_path, per_class=3)
    (tmp_path / "dog" / "1.png").write_bytes(b"not a png")
    cfg = run_cfg(
        "dataset=image_folder",
        f"dataset.root={tmp_path}",
        "dataset.image_size=8",
        "dataset.batch_size=5",
        "dataset.eval_fraction=0.2",
        f"dataset.num_workers={num_workers}",
    )
    data = build_data(cfg.dataset, Placement(0, torch.device("cpu")))
    with pytest.raises(ConfigError) as raised:
        for _ in data.train:
            pass
    assert str(raised.value) == (
        f"dataset.root: cannot read image {tmp_path / 'dog' / '1.png'} "
        "(not an image file PIL can read); remove or replace it"
    )


def test_full_disk_during_a_checkpoint_save_fails_in_one_line(run_cfg, tmp_path, monkeypatch):
    from amp_exp.results.checkpoint import load_newest_valid
    from amp_exp.run import train

    real_save, saves = torch.save, []

    def save_until_the_disk_fills(payload, file) -> None:
        """What torch.save does on a full disk: part of the file written, then its zip writer's
        RuntimeError, the ENOSPC only its context (caught: a traceback and exit 1)."""
        saves.append(payload["step"])
        if len(saves) > 1:
            file.write(b"partial")
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")  # noqa: B904
        real_save(payload, file)

    monkeypatch.setattr(torch, "save", save_until_the_disk_fills)
    cfg = run_cfg(*FP32_MLP, "trainer.max_steps=2", "checkpoint.every_steps=1")
    with pytest.raises(RuntimeFault) as raised:
        train(cfg, tmp_path)
    last = tmp_path / "checkpoints" / "last.pt"
    assert str(raised.value) == (
        f"could not write {last} (No space left on device); the previous last.pt is intact"
    )
    monkeypatch.setattr(torch, "save", real_save)
    path, payload = load_newest_valid(tmp_path)
    assert (path, payload["step"]) == (last, 1)
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.pt"]


# --- a full disk: exit 4 and one line, wherever it happens ----------------------------------------


def test_a_metrics_row_the_disk_refuses_stops_the_run_in_one_line(
    run_cfg, tmp_path, monkeypatch
) -> None:
    from amp_exp.run import train

    # Every write: No space left on device. (A link to /dev/full is refused as a planted link.)
    monkeypatch.setattr(
        "amp_exp.results.loggers.open_data", lambda path, flags: os.open(FULL, os.O_WRONLY)
    )
    with pytest.raises(RuntimeFault) as raised:
        train(run_cfg(*FP32_MLP, "trainer.max_steps=2"), tmp_path)
    assert str(raised.value) == (
        f"could not write {tmp_path / 'metrics.jsonl'} (No space left on device); the rows "
        "before this one are kept"
    )


def statvfs_with_free(free_bytes: int):
    real = os.statvfs

    def statvfs(path):
        stats = real(path)
        return os.statvfs_result(
            (4096, 4096, stats.f_blocks, free_bytes // 4096, free_bytes // 4096, *stats[5:])
        )

    return statvfs


def test_preflight_refuses_a_directory_without_room_for_a_run(workspace, monkeypatch) -> None:
    from amp_exp.results.ownership import claim

    launch = check_overrides(["hydra.run.dir=runs/new"])
    monkeypatch.setattr("amp_exp.results.ownership.os.statvfs", statvfs_with_free(24 * 1024))
    with pytest.raises(RuntimeFault) as raised, claim(launch):
        pass
    assert str(raised.value) == (
        f"{workspace}/runs/new has 24 KiB free, and a run needs at least 1 MiB for its config, "
        "log and results; free some space or choose another directory"
    )
    assert not (workspace / "runs").exists()


@pytest.mark.slow
def test_cli_a_metrics_link_is_refused_in_one_line_beside_a_log_the_disk_refuses(
    workspace,
) -> None:
    """A metrics.jsonl planted as a link is refused (exit 2, nothing written through it or
    recorded); the log the disk refuses adds no "Logging error". A disk that refuses metrics
    rows: test_a_metrics_row_the_disk_refuses_stops_the_run_in_one_line, and on a real disk
    test_cli_on_a_full_disk_exits_4_in_one_line."""
    run_dir = workspace / "run"
    run_dir.mkdir()
    for name in ("metrics.jsonl", "train.log"):
        (run_dir / name).symlink_to(FULL)
    # A process of its own: the log on a disk that refuses it is closed as a process's exit
    # closes it, where a failed close is no error.
    result = python_m("amp_exp", *FAST, *FP32_MLP, f"hydra.run.dir={run_dir}", timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "Logging error" not in output
    [error] = [line for line in output.splitlines() if "ERROR" in line]
    assert error.endswith(
        f"{run_dir / 'metrics.jsonl'} is a symbolic link; amp_exp never writes one there, so it "
        "reads and writes nothing through it: replace it with the file itself"
    )
    assert not (run_dir / "summary.json").exists()


def fill_once_training(disk: Path, metrics: Path) -> threading.Thread:
    """Fill ``disk`` to the last byte once the run has logged its first row."""

    def wait_then_fill() -> None:
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and metrics.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.05)
        fill(disk)

    filler = threading.Thread(target=wait_then_fill, daemon=True)
    filler.start()
    return filler


@pytest.mark.slow
@pytest.mark.parametrize(
    ("leave_kib", "says"),
    [
        (0, "amp_exp: error: cannot write "),  # not even the lock file
        (24, "KiB free, and a run needs at least 1 MiB"),
        (2048, "(No space left on device)"),  # room to start; full once training
    ],
    ids=["full", "24 KiB left", "fills while training"],
)
def test_cli_on_a_full_disk_exits_4_in_one_line(amp_exp_here, tmp_path, leave_kib, says) -> None:
    with small_disk(tmp_path / "disk", 3072) as disk:
        fill(disk, leave_kib)
        run_dir = disk / "run"
        argv = (
            *FAST,
            *FP32_MLP,
            "trainer.max_steps=100000",
            "trainer.log_every=1",
            "trainer.eval_every=null",
            "checkpoint.every_steps=null",
            f"hydra.run.dir={run_dir}",
        )
        trains = leave_kib > 1024
        if trains:  # the log on the disk that fills is closed as a process's exit closes it,
            # where a failed close is no error: a process of its own
            filler = fill_once_training(disk, run_dir / "metrics.jsonl")
            result = python_m("amp_exp", *argv, timeout=300)
            filler.join()
        else:  # refused while claiming the directory, before Hydra: the entry point, here
            result = amp_exp_here(*argv)
        assert result.returncode == 4, result.stderr[-2000:]
        output = result.stdout + result.stderr
        assert "Traceback" not in output and "Logging error" not in output
        [error] = [line for line in output.splitlines() if "error" in line.lower()]
        assert says in error
        if not trains:  # refused before anything was written
            assert not run_dir.exists()


# --- as a user runs it --------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in root.rglob("*")
        if p.is_file()
    }


def run_bad(
    amp_exp_here, workspace: Path, *argv: str, run_dir: str = "run"
) -> subprocess.CompletedProcess:
    """``python -m amp_exp`` from ``workspace``, through its entry point in this process; fails
    the test unless it exits 2 and leaves every file outside ``run_dir`` as it was."""
    before = snapshot(workspace)
    result = amp_exp_here(*argv, f"hydra.run.dir={run_dir}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    after = {k: v for k, v in snapshot(workspace).items() if not k.startswith(f"{run_dir}/")}
    assert after == before
    return result


def refused_before_hydra(amp_exp_here, workspace: Path, *argv: str, run_dir: str = "run") -> str:
    """``python -m amp_exp`` from ``workspace`` through its entry point, in this process (the
    pre-flight refuses these before Hydra starts); fails the test unless it exits 2 and leaves
    every file as it was. Returns its stderr."""
    before = snapshot(workspace)
    result = amp_exp_here(*argv, f"hydra.run.dir={run_dir}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert snapshot(workspace) == before
    return result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["seed=-1"], "seed=-1 must lie in [0, 2**32 - 1]"),
        (["model=null"], "model=null is not an option; valid choices: custom"),
        (["--config-dir", "userconf", "experiment=broken"], "broken.yaml: not valid YAML"),
        (["dataset=image_folder", "dataset.root=empty"], "has no class sub-folders"),
        pytest.param(["trainer.device=cuda"], "no CUDA device is available", marks=NO_CUDA),
    ],
)
def test_cli_rejects_bad_input_with_one_line_and_writes_nothing(
    workspace, amp_exp_here, argv, expected
):
    stderr = refused_before_hydra(amp_exp_here, workspace, *argv)
    [line] = stderr.strip().splitlines()
    assert line.startswith("amp_exp: error: ") and expected in line
    assert not (workspace / "run").exists()


@pytest.mark.slow
def test_cli_rejects_an_output_dir_through_a_file(workspace, amp_exp_here) -> None:
    stderr = refused_before_hydra(amp_exp_here, workspace, run_dir="a_file/run")
    assert stderr.strip().splitlines() == [
        "amp_exp: error: hydra.run.dir=a_file/run: a_file is a file, not a directory; "
        "choose another directory"
    ]


@pytest.mark.slow
def test_cli_stops_at_an_unreadable_image_with_one_line_and_a_failed_summary(
    workspace, amp_exp_here
) -> None:
    for image in (workspace / "images").rglob("*.png"):
        image.write_bytes(b"not a png")
    result = run_bad(
        amp_exp_here,
        workspace,
        *FAST,
        *FP32_MLP,
        "dataset=image_folder",
        "dataset.root=images",
        "dataset.batch_size=2",
        "dataset.eval_fraction=0.25",
    )
    errors = [line for line in result.stdout.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and f"cannot read image {workspace}/images/" in errors[0]
    summary = json.loads((workspace / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "cannot read image" in summary["error"]
