"""The hot loop never reads the device: host reads scale with log intervals, not with steps."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

import amp_exp.meters
from amp_exp.run import build
from conftest import TINY

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
    original_sync = amp_exp.meters.synchronize

    def counting_sync(device):
        counts["synchronize"] += 1
        original_sync(device)

    monkeypatch.setattr(amp_exp.meters, "synchronize", counting_sync)
    return counts


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_host_reads_depend_only_on_log_intervals(run_cfg, monkeypatch, precision) -> None:
    def reads(steps: int, log_every: int) -> Counter:
        built = build(
            run_cfg(
                f"precision={precision}",
                f"trainer.max_steps={steps}",
                f"trainer.log_every={log_every}",
                "precision.clip_grad_norm=1.0",
                *TINY,
            )
        )
        with monkeypatch.context() as patch:
            counts = count_host_reads(patch)
            built.engine.fit(lambda row: None)
        return counts

    short, long = reads(steps=6, log_every=3), reads(steps=24, log_every=12)
    assert short == long
    # Per log interval: the loss, the grad norm and, in fp16, the scale; then eval's two reads.
    assert 0 < sum(short.values()) <= 2 * 4 + 2 + 4
