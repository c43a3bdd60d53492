"""Tiny runs for tests: the shrinking overrides, the CLI, metrics files, injected faults."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME
from amp_exp.tasks import workload
from helpers.warm_python import python_m

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


# The learning rates of the one offline W&B sweep (test_wandb_cli.offline_wandb_sweep).
OFFLINE_SWEEP_LRS = ("0.1", "0.05", "0.02")


# fp16 autocast on the CPU is 20-60x slower than fp32: keep its runs tiny.
TINY = ["model.width=4", "dataset.image_size=8", "dataset.batch_size=16"]


# TINY's sizes on a one-layer MLP, for runs that need some model trained but are not about it:
# no convolutions, whose bf16 kernels on this CPU cost far more a step than a few small matmuls.
TINY_MLP = [
    "model=mlp",
    "model.hidden_dim=8",
    "model.depth=1",
    "dataset.image_size=8",
    "dataset.batch_size=16",
]


@functools.cache
def composed(overrides: tuple[str, ...]) -> DictConfig:
    """The real config from conf/ with ``overrides``, composed once a session: composing takes
    a quarter of a second, and conf/ does not change while the tests run. Don't change it."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(CONFIG_NAME, overrides=list(overrides))


def run_cli(
    *args: str, expect_rc: int = 0, timeout: int = 300, **where: Any
) -> subprocess.CompletedProcess:
    """``python -m amp_exp`` as a user runs it (from a warm interpreter: helpers/warm_python.py);
    fails the test unless it exits with ``expect_rc``. ``where``: ``cwd``, ``env``."""
    result = python_m("amp_exp", *args, timeout=timeout, **where)
    assert result.returncode == expect_rc, result.stderr[-3000:]
    return result


def read_jsonl(path: Path) -> list[dict]:

    return [json.loads(line) for line in path.read_text().splitlines()]


class LossOverride:
    """A real task trained with another loss: ``loss_fn(outputs, targets)``, on outputs flattened
    to [positions, classes] as the task's own cross-entropy sees them. Everything else (data,
    metrics, evaluation) is the task's."""

    def __init__(self, task: Any, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.task, self.loss_fn = task, loss_fn

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        outputs = model(inputs)
        if outputs.dim() == 3:  # next-token logits: [batch, position, vocabulary]
            outputs, targets = outputs.float().flatten(0, 1), targets.flatten()
        return self.loss_fn(outputs, targets)


def overriding_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """A ``tasks.workload.make_task`` whose tasks train with ``loss_fn`` (tests inject faults)."""
    real = workload.make_task
    return lambda *args, **kwargs: LossOverride(real(*args, **kwargs), loss_fn)


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


def ticking_clock() -> Callable[[Any], float]:
    """A stand-in for ``Throughput._now`` that reads one second later at each call: two runs
    that read the throughput clock alike then time alike, whatever else the machine does."""
    ticks = itertools.count()
    return lambda _throughput: float(next(ticks))


def meter_with_peak(peak_tflops: float) -> Callable[..., Any]:
    """A stand-in for the ``Meter`` that ``amp_exp.build`` makes, giving the run's meter a device
    peak (no CPU has one), so that a CPU run reports MFU."""
    import amp_exp.build

    real = amp_exp.build.Meter

    def meter(*args: Any) -> Any:
        return dataclasses.replace(
            real(*args), peak_tflops=peak_tflops, peak_source="a faked peak for tests"
        )

    return meter
