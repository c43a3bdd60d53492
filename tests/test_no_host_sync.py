"""The hot loop never reads the device: host reads scale with log intervals, not with steps.

A step with non-finite gradients is skipped on the device by a fused optimizer (CUDA's default),
so the default trainer.on_nonfinite=skip costs no read either; a non-fused optimizer makes the
host decide each step. On CUDA, torch's own sync detector proves it (skipped without a GPU).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import amp_exp.training.meters
from amp_exp.run import build
from helpers.runs import TINY

# The engine's reads are the point, not the model's: an MLP, as fp16 and bf16 convolutions take
# a tenth of a second a CPU step.
SMALL_MLP = ["model=mlp", "model.hidden_dim=16", "dataset.image_size=8", "dataset.batch_size=16"]
HOST_READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")
FUSED = "optimizer.fused=true"


def count_host_reads(monkeypatch) -> Counter:
    counts: Counter = Counter()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    original_sync = amp_exp.training.meters.synchronize

    def counting_sync(device):
        counts["synchronize"] += 1
        original_sync(device)

    monkeypatch.setattr(amp_exp.training.meters, "synchronize", counting_sync)
    return counts


def host_reads(run_cfg, monkeypatch, steps: int, log_every: int, *overrides: str) -> Counter:
    built = build(
        run_cfg(
            f"trainer.max_steps={steps}",
            f"trainer.log_every={log_every}",
            "precision.clip_grad_norm=1.0",
            *SMALL_MLP,
            *overrides,
        )
    )
    with monkeypatch.context() as patch:
        counts = count_host_reads(patch)
        built.engine.fit(lambda row: None)
    return counts


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16_true"])
def test_host_reads_depend_only_on_log_intervals(run_cfg, monkeypatch, precision) -> None:
    """With the default on_nonfinite=skip; GradScaler's own reads count too (a fused optimizer
    takes its found_inf on the device)."""
    overrides = (f"precision={precision}", FUSED)
    short = host_reads(run_cfg, monkeypatch, 6, 3, *overrides)
    long = host_reads(run_cfg, monkeypatch, 24, 12, *overrides)
    assert short == long
    # Per log interval: the loss, the grad norm, the skip record, the signals (training/signals.py)
    # and, in fp16, the scale; then eval's two reads.
    assert 0 < sum(short.values()) <= 2 * 5 + 2 + 4


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_long_run_signals_cost_one_read_per_log_interval(
    run_cfg, monkeypatch, precision
) -> None:
    """training/signals.py reads the device once per log step and never between: a hook left
    armed, or a read per step, would make the extra reads grow with the steps."""

    def extra_reads(steps: int, log_every: int) -> int:
        overrides = (f"precision={precision}", FUSED)
        on = host_reads(run_cfg, monkeypatch, steps, log_every, *overrides)
        off = host_reads(
            run_cfg, monkeypatch, steps, log_every, *overrides, "diagnostics.signals=false"
        )
        return sum(on.values()) - sum(off.values())

    assert extra_reads(6, 3) == extra_reads(24, 12) == 2  # one per log step


@pytest.mark.parametrize("action", ["skip", "stop"])
def test_a_non_fused_optimizer_makes_the_guard_read_one_flag_per_step(
    run_cfg, monkeypatch, action
) -> None:
    def extra_reads(steps: int) -> int:
        guarded = host_reads(run_cfg, monkeypatch, steps, 3, f"trainer.on_nonfinite={action}")
        fused = host_reads(run_cfg, monkeypatch, steps, 3, f"trainer.on_nonfinite={action}", FUSED)
        return sum(guarded.values()) - sum(fused.values())

    assert extra_reads(6) == 6
    assert extra_reads(12) == 12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_no_step_synchronizes_with_the_gpu_by_default(run_cfg, precision, optimizer) -> None:
    """CUDA's defaults (fused optimizers, on_nonfinite=skip) under torch's sync detector, which
    raises on any synchronizing call; the first step (lazy initializations) runs before it."""
    built = build(
        run_cfg(
            "trainer.device=cuda",
            f"precision={precision}",
            f"optimizer={optimizer}",
            "trainer.max_steps=8",
            *TINY,
        )
    )
    engine = built.engine
    batches = engine.train_batches()
    interval_loss = torch.zeros((), device=engine.device)
    engine.train_step(batches, interval_loss, want_grad_norm=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            engine.train_step(batches, interval_loss, want_grad_norm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.skip_record.read(None).count == 0
