"""Data-parallel jobs that stop and go on: a resume, a torchrun restart, submitit's tasks,
SIGTERM. Apart from tests/test_ddp.py so that pytest-xdist gives the two files two workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from helpers.runs import FAST, TINY, read_jsonl
from helpers.torchrun import DDP_RUN, TWO_RANKS, assert_bitwise_equal, run_worker
from helpers.warm_python import python_m

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Both ranks' state after a job that ran DDP_RUN uninterrupted."""
    return run_worker(tmp_path_factory.mktemp("straight"), *DDP_RUN)


def test_stopped_and_resumed_job_ends_where_an_uninterrupted_one_does(tmp_path, straight):

    # SIGUSR1 reaches rank 1 alone, during step 3; the ranks agree to stop at log step 4.
    interrupted = tmp_path / "interrupted"
    stopped = run_worker(interrupted, "--signal-at", "3", *DDP_RUN)
    for state in stopped.values():
        assert state["summary"]["status"] == "stopped"
        assert state["summary"]["steps"] == 4
    assert torch.load(interrupted / "checkpoints" / "last.pt", weights_only=True)["step"] == 4

    resumed = run_worker(interrupted, *DDP_RUN, "resume=auto")
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


def test_submitit_tasks_of_one_job_train_data_parallel(tmp_path):
    """tasks_per_node=2 through submitit's local executor: the two tasks of a job are its ranks,
    and every job writes into the sweep directory the launcher made (the default one)."""
    result = python_m(
        "amp_exp",
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        *DDP_RUN,
        *TINY,
        "precision=fp32,bf16",
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    for job in ("0", "1"):
        summary = json.loads((sweep_dir / job / "summary.json").read_text())
        assert (summary["status"], summary["world_size"]) == ("completed", 2)
        assert summary["replicas_identical"] is True
        assert (sweep_dir / job / "train.rank1.log").is_file()
    report = json.loads((sweep_dir / "report.json").read_text())
    assert sorted(row["world_size"] for row in report["runs"]) == [2, 2]


def test_a_worker_group_that_torchrun_restarts_resumes_where_it_failed(tmp_path, straight):
    """Rank 1 dies in step 5 of the first attempt; torchrun restarts both ranks, which resume from
    the step-4 checkpoint (and meet in a process group of their own, not the dead one's)."""
    restarted = run_worker(
        tmp_path / "restarted",
        "--die-at",
        "5",
        *DDP_RUN,
        "checkpoint.every_steps=2",
        "resume=auto",
        restarts=1,
    )
    summary = restarted[0]["summary"]
    assert summary["resumed_from"] == str(tmp_path / "restarted" / "checkpoints" / "last.pt")
    assert (summary["status"], summary["steps"]) == ("completed", 8)
    assert_bitwise_equal(restarted[0]["model"], restarted[1]["model"])
    assert_bitwise_equal(restarted[0]["model"], straight[0]["model"])


def test_sigterm_to_torchrun_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    """torchrun passes SIGTERM on to its workers, which stop at the same log step; rank 0 saves."""
    job = subprocess.Popen(
        [
            *TWO_RANKS,
            "-m",
            "amp_exp",
            f"hydra.run.dir={tmp_path}",
            *FAST,
            *TINY,
            "trainer.max_steps=100000",
            "trainer.log_every=5",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "metrics.jsonl"
        # The file is created empty when training starts; a byte in it means a logged step.
        while not (metrics.is_file() and metrics.stat().st_size > 0):
            assert time.monotonic() < deadline and job.poll() is None, "training never started"
            time.sleep(0.2)
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    summary = json.loads((tmp_path / "summary.json").read_text())
    errors = [line for line in stderr.splitlines() if "ERROR" in line or "Error" in line]
    assert (summary["status"], summary["stop_signal"]) == ("stopped", "SIGTERM"), (
        summary.get("error"),
        errors[:10],
    )
    assert summary["steps"] % 5 == 0 and summary["steps"] < 100000
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["step"] == summary["steps"] and checkpoint["world_size"] == 2
