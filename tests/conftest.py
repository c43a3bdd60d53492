from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME
from amp_exp.config.schema import Precision, RunConfig
from amp_exp.config.store import register_configs
from amp_exp.config.validate import validate
from amp_exp.runtime.capability import Capability
from amp_exp.runtime.probe import KERNELS, KernelTime, remember

# Small enough for 2 CPU cores, large enough that every code path runs.
FAST_TRAINER = [
    "trainer.device=cpu",
    "trainer.max_steps=4",
    "trainer.log_every=2",
    "trainer.timing_warmup_steps=1",
    "wandb.mode=disabled",
]
FAST = [
    *FAST_TRAINER,
    "dataset.train_size=256",
    "dataset.eval_size=64",
    "dataset.batch_size=32",
    "dataset.image_size=16",
    "dataset.num_workers=0",
]
# A language model the same way: compose with fast=False (FAST's keys are image keys). 64
# sequences / batch 8 = 8 batches an epoch.
TINY_GPT = ["model=gpt_tiny", "model.d_model=16", "model.seq_len=16"]
TINY_TOKENS = [
    "dataset=synthetic_tokens",
    "dataset.vocab_size=32",
    "dataset.train_size=64",
    "dataset.eval_size=16",
    "dataset.batch_size=8",
]
FAST_LM = [*FAST_TRAINER, *TINY_GPT, *TINY_TOKENS]
# fp16 autocast on the CPU is 20-60x slower than fp32: keep its runs tiny.
TINY = ["model.width=4", "dataset.image_size=8", "dataset.batch_size=16"]
# One rank of a torchrun test job (tests/test_ddp.py, tests/test_fsdp.py), and how to start two.
WORKER = Path(__file__).resolve().parent / "ddp_worker.py"
TWO_RANKS = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@pytest.fixture(scope="session", autouse=True)
def _registered_schemas() -> None:
    register_configs()


@pytest.fixture(autouse=True)
def _wandb_kept_local(monkeypatch, tmp_path_factory) -> None:
    """No test, nor any subprocess it starts, reaches W&B or the user's W&B files by accident.

    Tests that want W&B set wandb.mode explicitly, which wins over WANDB_MODE.
    """
    monkeypatch.setenv("WANDB_MODE", "disabled")
    wandb_home = tmp_path_factory.getbasetemp() / "wandb_home"
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(wandb_home))


def timing_at(speed: float) -> dict[str, KernelTime]:
    """Probe kernel times for a precision that runs at ``speed`` times fp32's speed."""
    return {kernel: KernelTime(ms=1 / speed, tflops=speed) for kernel in KERNELS}


def inject_probe(speeds: dict[str, float]) -> None:
    """Cache a probe result in which each precision runs at ``speeds[p]`` times fp32's speed."""
    remember(torch.device("cpu"), {p: timing_at(speed) for p, speed in speeds.items()})


def capability_with(speeds: dict[str, float], device: str = "cpu", **facts) -> Capability:
    """A device's capability as if the probe measured ``speeds`` (relative to fp32's)."""
    measured = {Precision(p): timing_at(speed) for p, speed in speeds.items()}
    return Capability(device, f"test {device}", facts, measured, key=f"test {device}")


@pytest.fixture(autouse=True)
def _measurements_kept_local(monkeypatch, tmp_path_factory) -> None:
    """No test, nor any subprocess it starts, reads or writes the user's ~/.cache/amp_exp.

    The session's cache holds a probe result in which bf16 and fp16 run far slower than fp32, so
    precision=auto picks fp32 without timing anything, whatever this machine's speed. Tests of the
    probe and of the trial point XDG_CACHE_HOME at their own tmp_path.
    """
    cache_home = tmp_path_factory.getbasetemp() / "xdg_cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    if not cache_home.exists():
        inject_probe({"fp32": 1.0, "bf16": 0.05, "fp16": 0.02})


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """Compose the real config from conf/, shrunk to CPU and a few steps, plus ``overrides``."""

    def _compose(*overrides: str, fast: bool = True) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(CONFIG_NAME, overrides=[*(FAST if fast else []), *overrides])

    return _compose


@pytest.fixture
def run_cfg(compose_cfg) -> Callable[..., RunConfig]:
    def _run_cfg(*overrides: str) -> RunConfig:
        return validate(compose_cfg(*overrides))

    return _run_cfg


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m amp_exp`` as a user runs it; fails the test unless it succeeds."""
    result = subprocess.run(
        [sys.executable, "-m", "amp_exp", *args], capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def read_jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def inf_loss_at(steps: set[int], accum: int = 1) -> Callable[..., torch.Tensor]:
    """A loss function that overflows on the given optimizer steps (1-based)."""
    calls = 0

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        loss = F.cross_entropy(logits, labels)
        step = (calls - 1) // accum + 1
        return loss * float("inf") if step in steps else loss

    return loss_fn


def signal_self_at_call(n: int, signum: int = signal.SIGUSR1):
    """A loss function that delivers a preemption signal to this process on its n-th call."""
    calls = 0

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == n:
            os.kill(os.getpid(), signum)
        return F.cross_entropy(logits, labels)

    return loss_fn


def torchrun(
    *args: str, cwd: Path | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """Two ranks under torchrun; fails the test unless the job succeeds."""
    # One thread per rank: two ranks share the two cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*TWO_RANKS, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_worker(output_dir: Path, *args: str, restarts: int = 0) -> dict[int, dict]:
    """Both ranks' final state, as tests/ddp_worker.py saved it."""
    torchrun(f"--max-restarts={restarts}", str(WORKER), str(output_dir), *args)
    return {rank: torch.load(output_dir / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
