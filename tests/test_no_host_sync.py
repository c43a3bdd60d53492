"""The hot loop never reads the device: host reads scale with log intervals, not with steps."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

import amp_exp.training.meters
from amp_exp.run import build
from helpers.runs import TINY

HOST_READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")


def count_host_reads(monkeypatch) -> Counter:
    counts: Counter = Counter()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            # GradScaler.step reads found_inf on the host for non-fused optimizers; that check
            # is PyTorch's own, not the engine's.
            if not sys._getframe(1).f_code.co_filename.endswith("grad_scaler.py"):
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
            *TINY,
            *overrides,
        )
    )
    with monkeypatch.context() as patch:
        counts = count_host_reads(patch)
        built.engine.fit(lambda row: None)
    return counts


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16_true"])
def test_host_reads_depend_only_on_log_intervals(run_cfg, monkeypatch, precision) -> None:
    # The fp32/bf16 non-finite guard reads one flag per step by design; it is measured below.
    overrides = (f"precision={precision}", "trainer.on_nonfinite=off")
    short = host_reads(run_cfg, monkeypatch, 6, 3, *overrides)
    long = host_reads(run_cfg, monkeypatch, 24, 12, *overrides)
    assert short == long
    # Per log interval: the loss, the grad norm and, in fp16, the scale; then eval's two reads.
    assert 0 < sum(short.values()) <= 2 * 4 + 2 + 4


@pytest.mark.parametrize("action", ["skip", "stop"])
def test_nonfinite_guard_costs_exactly_one_read_per_step(run_cfg, monkeypatch, action) -> None:
    def extra_reads(steps: int) -> int:
        guarded = host_reads(run_cfg, monkeypatch, steps, 3, f"trainer.on_nonfinite={action}")
        unguarded = host_reads(run_cfg, monkeypatch, steps, 3, "trainer.on_nonfinite=off")
        return sum(guarded.values()) - sum(unguarded.values())

    assert extra_reads(6) == 6
    assert extra_reads(12) == 12
