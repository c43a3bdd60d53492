"""Two-rank torchrun jobs for tests: start tests/ddp_worker.py and compare what the ranks saved."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import torch

from helpers.runs import FAST, TINY_MLP
from helpers.warm_python import RANKS_ENV, python_m, rank_socket

TORCHRUN_TWO_RANKS = ["--standalone", "--nproc_per_node=2"]
# What torchrun runs in place of python -u: isolated (-I) and without site (-S), it starts at once.
WARM_RANK = ["-I", "-S", str(Path(__file__).with_name("warm_rank.py"))]
TWO_RANKS = [sys.executable, "-m", "torch.distributed.run", *TORCHRUN_TWO_RANKS]

# Two ranks of 32 each draw from 256 training samples: 4 steps per epoch, so 8 steps cross one.
DDP_RUN = [*FAST, "trainer.max_steps=8", "trainer.log_every=2", "scheduler=none"]

# Two ranks of 16 each draw from 256 training samples: 8 steps per epoch. The one-layer MLP: fp16
# convolutions on this CPU cost far more a step, and sharding is the same for any model.
FSDP_RUN = [*FAST, *TINY_MLP, "trainer.strategy=fsdp2", "scheduler=none"]


def torchrun(
    *args: str, cwd: Path | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """Two ranks under torchrun; fails the test unless the job succeeds. ``args``: torchrun's
    options (as ``--name=value``), then ``-m MODULE`` or a script, and its arguments.

    The launcher comes from the warm interpreter, and so do the ranks: torchrun starts
    helpers/warm_rank.py in place of ``python -u``, which has the warm server fork each rank with
    torch imported (4 s of CPU a rank on 2 cores). The agent, its rendezvous and restarts are
    torchrun's own. A test that signals the agent starts torchrun afresh (``TWO_RANKS``): a warm
    rank gets the agent's signal through warm_rank.py, which on a busy machine can pass it on
    after the rank has already stopped on its peer's signal, and SIGTERM then kills it."""
    options = list(itertools.takewhile(lambda arg: arg.startswith("--"), args))
    program = args[len(options) :]
    # One thread per rank: two ranks share the two cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", RANKS_ENV: rank_socket()}
    result = python_m(
        "torch.distributed.run",
        *TORCHRUN_TWO_RANKS,
        *options,
        "--no-python",
        sys.executable,
        *WARM_RANK,
        *program,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
