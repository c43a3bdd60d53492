"""Each rank resumes its own random generators, and a preempted job stops within
STOP_CHECK_STEPS steps, not at a log step: two gloo ranks under torchrun, in the session's
shared launch (tests/ddp_jobs.py)."""

from __future__ import annotations

import pytest
import torch

import ddp_jobs
from amp_exp.training.loop import STOP_CHECK_STEPS
from helpers.runs import FAST_LM, read_jsonl
from helpers.torchrun import assert_bitwise_equal

pytestmark = pytest.mark.slow

# Dropout and stochastic rounding draw from the generators; a log step only at the end.
DROPOUT_RUN = [
    *FAST_LM,
    "model.dropout=0.1",
    "precision=bf16_true",
    "trainer.max_steps=16",
    "trainer.log_every=1000",
    "scheduler=none",
    # The stop's numbered checkpoint is kept beside last.pt, which the resume (same launch)
    # replaces.
    "checkpoint.keep=2",
]


# The stopped job and its resume write one directory.
STRAIGHT, STOPPED, RESUMED = ddp_jobs.declare_stop_and_resume(
    "ranks_resume", *DROPOUT_RUN, signal_at=3, stop_signal="SIGTERM"
)


def test_a_preempted_dropout_run_in_bf16_true_resumes_bit_exact_with_identical_replicas(
    shared_rank_jobs,
) -> None:
    """SIGTERM reaches rank 1 in step 3; with log_every=1000 the ranks still agree to stop at the
    first stop check, step STOP_CHECK_STEPS. Each rank saved and restores its own generators,
    so the resumed run draws the dropout masks and rounding bits an uninterrupted run draws.
    The three jobs run one after another in the session's shared launch (tests/ddp_jobs.py)."""
    root, states = shared_rank_jobs
    interrupted = root / "ranks_resume_interrupted"
    straight, stopped, resumed = states[STRAIGHT], states[STOPPED], states[RESUMED]
    for state in stopped.values():
        summary = state["summary"]
        assert (summary["status"], summary["stop_signal"]) == ("stopped", "SIGTERM")
        assert summary["steps"] == STOP_CHECK_STEPS
    stop_checkpoint = interrupted / "checkpoints" / f"step_{STOP_CHECK_STEPS:08d}.pt"
    checkpoint = torch.load(stop_checkpoint, weights_only=True)
    assert checkpoint["step"] == STOP_CHECK_STEPS
    assert len(checkpoint["rng"]) == 2

    assert resumed[0]["summary"]["steps"] == 16
    assert resumed[0]["summary"]["replicas_identical"] is True
    assert_bitwise_equal(resumed[0]["model"], resumed[1]["model"])
    assert_bitwise_equal(resumed[0]["model"], straight[0]["model"])
    assert resumed[0]["summary"]["final_loss"] == straight[0]["summary"]["final_loss"]
    assert [row["step"] for row in read_jsonl(interrupted / "metrics.jsonl") if "loss" in row] == [
        16
    ]
