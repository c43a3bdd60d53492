"""One rank of the two-process signals test (tests/test_signals.py): each rank measures its own
batch, rank 1's ten times larger; every rank saves the row it collected and the figures of both
ranks' batches pooled, computed by hand, to OUTPUT_DIR/rank<r>.pt (a job of tests/ddp_jobs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import scipy.stats
import torch
import torch.distributed as dist
from torch import nn

from amp_exp.config.precisions import get
from amp_exp.training.signals import Limits, SignalCollector


def batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(rank)) * (1 + 9 * rank)


def main(output_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on both ranks, as DDP keeps them
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    collector = SignalCollector(Limits.of(get("fp16").spec)).attach(model)
    collector.arm()
    model(batch(rank))
    row = collector.collect()
    with torch.no_grad():
        pooled = model[0](torch.cat([batch(0), batch(1)])).flatten().double()
        logits = model(torch.cat([batch(0), batch(1)]))
    expected = {
        "act_absmax/0": pooled.abs().max().item(),
        "act_kurtosis/0": float(scipy.stats.kurtosis(pooled.numpy(), fisher=False)),
        "logit_max": logits.max().item(),
        "logit_mean": logits.mean().item(),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"row": row, "expected": expected}, output_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
