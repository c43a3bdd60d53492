"""Data-parallel jobs that stop and go on: a resume, a torchrun restart (jobs of the session's
shared launch, tests/ddp_jobs.py), SIGTERM to torchrun (submitit's tasks as a job's ranks:
tests/test_slurm.py)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

import ddp_jobs
from helpers.runs import FAST, TINY, read_jsonl
from helpers.torchrun import DDP_RUN, TORCHRUN_TWO_RANKS, assert_bitwise_equal
from helpers.warm_python import start_python_m

pytestmark = pytest.mark.slow

# The stop's step-4 checkpoint is kept beside last.pt, which the resume replaces.
KEEP = ["checkpoint.keep=2"]


# In the session's shared launch (tests/ddp_jobs.py): DDP_RUN uninterrupted; stopped by SIGUSR1
# to rank 1 alone during step 3 (the ranks agree to stop at log step 4); resumed in place with
# resume=auto; and a job whose rank 1 dies in step 5 of torchrun's first attempt, which torchrun
# restarts.
STRAIGHT, STOPPED, RESUMED = ddp_jobs.declare_stop_and_resume(
    "ddp", *DDP_RUN, signal_at=3, stop=KEEP
)
RESTARTED = ddp_jobs.declare(
    "ddp_restarted", "--die-at", "5", *DDP_RUN, "checkpoint.every_steps=2", "resume=auto"
)


@pytest.fixture(scope="module")
def jobs(shared_rank_jobs):
    root, states = shared_rank_jobs
    return root, *(states[job] for job in (STRAIGHT, STOPPED, RESUMED, RESTARTED))


def test_stopped_and_resumed_job_ends_where_an_uninterrupted_one_does(jobs):
    root, straight, stopped, resumed, _ = jobs
    interrupted = root / "ddp_interrupted"
    for state in stopped.values():
        assert state["summary"]["status"] == "stopped"
        assert state["summary"]["steps"] == 4
    step_4 = interrupted / "checkpoints" / "step_00000004.pt"
    assert torch.load(step_4, weights_only=True)["step"] == 4

    assert resumed[0]["summary"]["resumed_from"] == str(interrupted / "checkpoints" / "last.pt")
    assert resumed[0]["summary"]["steps"] == 8
    assert_bitwise_equal(resumed[0]["model"], resumed[1]["model"])
    assert_bitwise_equal(resumed[0]["model"], straight[0]["model"])
    assert [row["step"] for row in read_jsonl(interrupted / "metrics.jsonl") if "loss" in row] == [
        2,
        4,
        6,
        8,
    ]


def test_a_worker_group_that_torchrun_restarts_resumes_where_it_failed(jobs):
    """Rank 1 dies in step 5 of the first attempt; torchrun restarts both ranks, which resume from
    the step-4 checkpoint (and meet in a process group of their own, not the dead one's)."""
    root, straight, *_, restarted = jobs
    summary = restarted[0]["summary"]
    assert summary["resumed_from"] == str(root / "ddp_restarted" / "checkpoints" / "last.pt")
    assert (summary["status"], summary["steps"]) == ("completed", 8)
    assert_bitwise_equal(restarted[0]["model"], restarted[1]["model"])
    assert_bitwise_equal(restarted[0]["model"], straight[0]["model"])


def test_sigterm_to_torchrun_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    """torchrun passes SIGTERM on to its workers, which stop at the same log step; rank 0 saves.
    The agent comes from the warm interpreter, its ranks start afresh (helpers/torchrun.py)."""
    job = start_python_m(
        "torch.distributed.run",
        *TORCHRUN_TWO_RANKS,
        "-m",
        "amp_exp",
        f"hydra.run.dir={tmp_path}",
        *FAST,
        *TINY,
        "trainer.max_steps=100000",
        "trainer.log_every=5",
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=240,
    )
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "metrics.jsonl"
        # The file is created empty when training starts; a byte in it means a logged step.
        while not (metrics.is_file() and metrics.stat().st_size > 0):
            assert time.monotonic() < deadline and job.poll() is None, "training never started"
            time.sleep(0.2)
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate()
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGKILL)
            job.wait()
    summary = json.loads((tmp_path / "summary.json").read_text())
    errors = [line for line in stderr.splitlines() if "ERROR" in line or "Error" in line]
    assert (summary["status"], summary["stop_signal"]) == ("stopped", "SIGTERM"), (
        summary.get("error"),
        errors[:10],
    )
    assert summary["steps"] % 5 == 0 and summary["steps"] < 100000
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["step"] == summary["steps"] and checkpoint["world_size"] == 2
