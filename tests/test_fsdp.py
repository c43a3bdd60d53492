"""FSDP2 under torchrun: two CPU processes over gloo, the model sharded between them (block-scaled
formats and a dying rank: tests/test_fsdp_ranks.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ddp_jobs
from amp_exp.results.resume import find_checkpoint, resume
from amp_exp.run import build, train
from amp_exp.runtime.distributed import process_group
from amp_exp.runtime.fsdp import whole
from helpers.runs import TINY_MLP, read_jsonl
from helpers.torchrun import FSDP_RUN, assert_bitwise_equal, torchrun

pytestmark = pytest.mark.slow


# One eval sample for two ranks: rank 1 evaluates nothing, and no one may wait in a collective.
SWEEP_EVAL = ["dataset.eval_size=1", "trainer.eval_every=2"]


@pytest.fixture(scope="module")
def fsdp_sweep(tmp_path_factory):
    """One sweep under torchrun, a job per precision (jobs 0, 1, 2: fp32, bf16, fp16)."""
    sweep_dir = tmp_path_factory.mktemp("fsdp_sweep")
    torchrun(
        "-m",
        "amp_exp",
        "-m",
        f"hydra.sweep.dir={sweep_dir}",
        *FSDP_RUN,
        *SWEEP_EVAL,
        "precision=fp32,bf16,fp16",
        # The report's speed trial would time each precision again; no test here reads it.
        "report.speed_trial=false",
        timeout=400,
    )
    return sweep_dir


def test_fsdp2_trains_in_every_precision_with_its_policy(fsdp_sweep):
    """Each job trains sharded, with the dtypes of its policy in summary.json and the report,
    and a DCP checkpoint of both ranks' shards; rank 1 evaluates nothing, and no one hangs.
    FSDP2 gathers the fp32 weights and autocasts, as DDP does."""
    tmp_path = fsdp_sweep
    summaries = [json.loads((tmp_path / job / "summary.json").read_text()) for job in "012"]
    assert [(s["precision"], s["param_dtype"], s["reduce_dtype"]) for s in summaries] == [
        ("fp32", "fp32", "fp32"),
        ("bf16", "fp32", "fp32"),
        ("fp16", "fp32", "fp32"),
    ]
    for job, summary in zip("012", summaries, strict=True):
        assert (summary["status"], summary["strategy"], summary["world_size"]) == (
            "completed",
            "fsdp2",
            2,
        )
        assert summary["final_loss"] is not None and summary["eval_acc"] in (0.0, 1.0)
        step_dir = tmp_path / job / "checkpoints" / "step_00000004"
        assert sorted(p.name for p in step_dir.iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "engine.pt",
        ]
    # Only the fp16 job's GradScaler state is replicated across the ranks to compare.
    assert [s["replicas_identical"] for s in summaries] == [None, None, True]
    # The Runs table says how each job ran where it is not one process: its ranks and FSDP2
    # (the policy's dtypes only where they are not fp32's).
    markdown = (tmp_path / "report.md").read_text()
    assert "| bf16 [2 ranks, fsdp2] |" in markdown and "params fp32" not in markdown


def test_the_audit_reads_the_dtypes_fsdp2_gathers_and_reduces_in(fsdp_sweep):
    """bf16 under FSDP2 gathers fp32 weights and autocasts, as under DDP: every matmul runs in
    bf16, and the policy in force gathers and reduces in fp32 (precision.fsdp_cast_params=true
    would gather bf16)."""
    audit = json.loads((fsdp_sweep / "1" / "summary.json").read_text())["precision_audit"]
    assert (audit["ranks"], audit["engaged"], audit["flops_by_dtype"]) == (2, True, {"bfloat16": 1})
    policies = {
        (policy["param_dtype"], policy["reduce_dtype"]): policy["modules"]
        for policy in audit["communication"]["policies"]
    }
    assert policies == {("float32", "float32"): [""]}
    # The optimizer steps this rank's fp32 shards.
    assert set(audit["state"]["weights"]) == set(audit["state"]["grads"]) == {"float32"}


# fp16 with its scaler, two micro-batches a step, 8 steps (the second epoch); the stop's step-4
# checkpoint is kept beside the resume's step-8 one.
RESUMED_RUN = [
    *FSDP_RUN,
    "precision=fp16",
    "trainer.max_steps=8",
    "trainer.grad_accum_steps=2",
    "checkpoint.keep=2",
]


# In the session's shared launch (tests/ddp_jobs.py): RESUMED_RUN uninterrupted; stopped by
# SIGTERM to rank 1 during step 3; resumed in place with resume=auto; and an fp16 run in which
# rank 1 puts an inf into its own shard of a gradient at step 2.
STRAIGHT, STOPPED, RESUMED = ddp_jobs.declare_stop_and_resume(
    "fsdp", *RESUMED_RUN, signal_at=5, stop_signal="SIGTERM"
)
INF_IN_SHARD = ddp_jobs.declare("fsdp_inf", "--inf-in-shard-at", "2", *FSDP_RUN, "precision=fp16")


@pytest.fixture(scope="module")
def jobs(shared_rank_jobs):
    root, states = shared_rank_jobs
    return root, *(states[job] for job in (STRAIGHT, STOPPED, RESUMED, INF_IN_SHARD))


def test_sigterm_then_resume_auto_ends_bit_exact_with_an_uninterrupted_run(jobs):
    """SIGTERM reaches rank 1 during step 3; the ranks stop at log step 4 with a sharded
    checkpoint; resume=auto trains on to step 8 and ends bit for bit where a run that never
    stopped ends, on both ranks."""
    root, straight, stopped, resumed, _ = jobs
    interrupted = root / "fsdp_interrupted"
    for state in stopped.values():
        assert (state["summary"]["status"], state["summary"]["stop_signal"]) == (
            "stopped",
            "SIGTERM",
        )
        assert state["summary"]["steps"] == 4
    checkpoint = interrupted / "checkpoints" / "step_00000004"
    assert (checkpoint / ".metadata").is_file()

    for rank in (0, 1):
        summary = resumed[rank]["summary"]
        assert (summary["resumed_from"], summary["steps"]) == (str(checkpoint), 8)
        assert_bitwise_equal(resumed[rank]["model"], straight[rank]["model"])
        assert resumed[rank]["scale"] == straight[rank]["scale"]
        assert summary["final_loss"] == straight[rank]["summary"]["final_loss"]
        assert summary["eval_acc"] == straight[rank]["summary"]["eval_acc"]
    rows = read_jsonl(interrupted / "metrics.jsonl")
    assert [row["step"] for row in rows if "loss" in row] == [2, 4, 6, 8]


def test_an_inf_in_one_ranks_shard_skips_the_step_on_every_rank(jobs):
    """After the reduce-scatter rank 1 puts an inf into its own shard of a gradient; rank 0's
    shards are all finite. DTensor's inf check takes the MAX of the ranks' flags, so both
    GradScalers skip step 2 and halve the scale, and both name the parameter."""
    ranks = jobs[-1]

    assert [ranks[rank]["shard_finite"] for rank in (0, 1)] == [True, False]
    for state in ranks.values():
        assert state["summary"]["skipped_steps"] == 1
        overflow = state["summary"]["first_overflow"]
        assert (overflow["step"], overflow["parameters"]) == (2, ["1.weight"])
        assert overflow["loss_finite"] is True
    assert ranks[0]["scale"] == ranks[1]["scale"] == 65536.0 / 2
    assert ranks[0]["summary"]["replicas_identical"] is True


def test_a_checkpoint_of_two_ranks_resumes_in_one_process(tmp_path, run_cfg, fsdp_sweep):
    """DCP reshards the two ranks' shards onto one process: the weights load exactly (as DCP's
    own offline reader reads them), and the epoch goes on from the samples the two ranks trained
    on (4 batches each = 8 of one rank)."""
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_sweep / "1", run_dir)  # the bf16 job, which ended at step 4
    checkpoint = run_dir / "checkpoints" / "step_00000004"
    dcp_to_torch_save(checkpoint, tmp_path / "offline.pt")
    saved = torch.load(tmp_path / "offline.pt", weights_only=True)["model"]

    cfg = run_cfg(
        *TINY_MLP, "trainer.strategy=fsdp2", "scheduler=none", "precision=bf16", *SWEEP_EVAL
    )
    cfg.trainer.max_steps, cfg.resume = 8, "auto"
    with process_group(cfg.trainer.device, cfg.trainer.strategy) as alone:
        built = build(cfg, distributed=alone)
        resume(cfg, built.engine, run_dir, find_checkpoint(cfg, run_dir, alone), writes=True)
        loaded = {name: whole(value) for name, value in built.model.state_dict().items()}
        progress = built.engine.progress
    assert not dist.is_initialized()
    assert_bitwise_equal(loaded, saved)
    assert (progress.step, progress.epoch, progress.batch_in_epoch) == (4, 0, 8)

    summary = train(cfg, run_dir)
    assert (summary["status"], summary["world_size"], summary["steps"]) == ("completed", 1, 8)
    assert summary["resumed_from"] == str(checkpoint)
    assert summary["samples_seen"] == 4 * 2 * 16 + 4 * 16
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl") if "loss" in row] == [
        2,
        4,
        6,
        8,
    ]
    assert torch.isfinite(torch.tensor(summary["final_loss"]))
