"""FSDP2 jobs whose ranks see different things: a block-scaled format quantizing gathered
weights (jobs of the session's shared launch, tests/ddp_jobs.py), a rank that dies (an inf in
one rank's shard: tests/test_fsdp.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import ddp_jobs
from helpers.runs import FAST, FAST_TRAINER
from helpers.torchrun import TORCHRUN_TWO_RANKS, WARM_RANK
from helpers.warm_python import RANKS_ENV, python_m, rank_socket

pytestmark = pytest.mark.slow


# gpt_tiny at its own width (64: two MX blocks per row), two ranks of 4 sequences, 4 steps.
MICROSCALING_RUN = [
    *FAST_TRAINER,
    "model=gpt_tiny",
    "dataset=synthetic_tokens",
    "dataset.train_size=64",
    "dataset.eval_size=16",
    "dataset.batch_size=4",
    "scheduler=none",
]


FORMATS = ("mxfp8", "nvfp4")


# Each format under DDP and under FSDP2, in the session's shared launch (tests/ddp_jobs.py).
FORMAT_JOBS = {
    (precision, strategy): ddp_jobs.declare(
        f"formats_{precision}_{strategy}",
        *MICROSCALING_RUN,
        f"precision={precision}",
        "precision.emulate=true",
        f"trainer.strategy={strategy}",
    )
    for precision in FORMATS
    for strategy in ("ddp", "fsdp2")
}


@pytest.mark.parametrize("precision", FORMATS)
def test_a_block_scaled_format_sharded_over_two_ranks_trains_as_ddp_does(
    precision, shared_rank_jobs
):
    """Each converted linear quantizes the whole weight its all-gather brings in, while the
    optimizer steps each rank's fp32 shard: the sharded run engages as the DDP run does (same
    formats, same modules) and ends at its loss. Were a rank to quantize only its own shard,
    nvfp4's per-tensor scale would come from half the weight and its loss would drift (mxfp8's
    32-blocks happen to fit these shards); were the master weights left whole, each rank's
    optimizer would hold all of them."""
    ddp, fsdp = (
        shared_rank_jobs[1][FORMAT_JOBS[precision, strategy]][0]["summary"]
        for strategy in ("ddp", "fsdp2")
    )
    assert (ddp["precision"], ddp["strategy"], fsdp["strategy"]) == (precision, "ddp", "fsdp2")
    assert fsdp["world_size"] == 2
    audit = fsdp["precision_audit"]
    assert audit["engaged"] is True, audit["shortfalls"]
    assert audit["modules"] == ddp["precision_audit"]["modules"]
    assert audit["flops_by_dtype"] == ddp["precision_audit"]["flops_by_dtype"]
    # Each rank's optimizer holds half of the fp32 master weights DDP's holds whole.
    assert audit["state"]["weights"] == {
        "float32": ddp["precision_audit"]["state"]["weights"]["float32"] // 2
    }
    assert (
        fsdp["precision_details"]["converted_linears"]
        == (ddp["precision_details"]["converted_linears"])
    )
    assert fsdp["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-4)


def test_a_rank_that_dies_is_named_in_one_line_and_in_the_summary(tmp_path):
    """SIGKILL rank 1 mid-run: rank 0's collective fails with gloo's "Connection closed by peer";
    rank 0 stops with one line that names the rank it lost, and exit status 4 (unless torchrun's
    agent, which stops every worker once one has died, SIGTERMs it first), no traceback."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    tests = str(Path(__file__).resolve().parent)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([tests, *filter(None, [os.environ.get("PYTHONPATH")])]),
        RANKS_ENV: rank_socket(),
    }
    # The ranks forked warm, as helpers.torchrun.torchrun starts them (which wants exit 0).
    result = python_m(
        "torch.distributed.run",
        *TORCHRUN_TWO_RANKS,
        "--redirects=3",
        f"--log-dir={logs}",
        "--no-python",
        sys.executable,
        *WARM_RANK,
        "-m",
        "amp_exp",
        *FAST,
        "dataset.image_size=8",
        "dataset.batch_size=16",
        "trainer.strategy=fsdp2",
        "model=custom",
        "model._target_=helpers.user_code.make_mortal",
        "trainer.max_steps=8",
        f"hydra.run.dir={run_dir}",
        timeout=300,
        env=env,
    )
    assert result.returncode != 0
    lost = "lost rank 1 (pid "
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith(f"RuntimeFault: {lost}")
    assert summary["error"].endswith(
        "of 2: its process died, so the run cannot go on; resume=auto continues from the last "
        "checkpoint"
    )
    [error] = [line for line in (run_dir / "train.log").read_text().splitlines() if "ERROR" in line]
    assert lost in error
    [rank0_err] = logs.rglob("attempt_0/0/stderr.log")
    assert "Traceback" not in rank0_err.read_text()
    rank0 = result.stderr.split("rank      : 0 (local_rank: 0)")[1].splitlines()[1]
    assert rank0.split(":")[1].split()[0] in ("4", "-15"), rank0
