"""Data-parallel training under torchrun, two CPU processes over gloo: one job's results, sweeps,
skips and meters (resumes, restarts and signals: tests/test_ddp_resume.py)."""

from __future__ import annotations

import json

import pytest

import ddp_jobs
from amp_exp.run import train
from helpers.runs import FAST_LM, TINY_MLP, meter_with_peak, read_jsonl, ticking_clock
from helpers.torchrun import DDP_RUN, assert_bitwise_equal, torchrun
from helpers.wandb_records import read_only_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory):
    """One job as users start it, with no run directory given. One eval sample for two ranks:
    rank 1 evaluates nothing."""
    workdir = tmp_path_factory.mktemp("torchrun_job")
    torchrun(
        "-m",
        "amp_exp",
        *DDP_RUN,
        "precision=bf16",
        *TINY_MLP,
        "wandb.mode=offline",
        "dataset.eval_size=1",
        "trainer.eval_every=2",
        cwd=workdir,
    )
    return workdir


def test_torchrun_job_writes_one_set_of_results(torchrun_job):
    """One run directory whatever each rank's clock says, one metrics.jsonl and summary.json,
    the global batch in the logs, rank 1's log kept apart."""
    run_dirs = list((torchrun_job / "outputs" / "runs").glob("*/*"))
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    assert [p.relative_to(torchrun_job) for p in torchrun_job.rglob("summary.json")] == [
        (run_dir / "summary.json").relative_to(torchrun_job)
    ]
    assert len(list(torchrun_job.rglob("metrics.jsonl"))) == 1
    assert (run_dir / "train.log").is_file() and (run_dir / "train.rank1.log").is_file()
    assert len(list(torchrun_job.rglob("*.wandb"))) == 1
    wandb_run = read_only_run(run_dir)
    train_rows = [row for row in wandb_run.history if "train/loss" in row]
    assert [(row["_step"], row["samples"]) for row in train_rows] == [
        (2, 64),
        (4, 128),
        (6, 192),
        (8, 256),
    ]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["world_size"] == 2
    assert summary["global_batch_size"] == 2 * 16
    assert summary["samples_seen"] == 8 * 2 * 16
    assert summary["replicas_identical"] is True
    rows = [row for row in read_jsonl(run_dir / "metrics.jsonl") if "loss" in row]
    assert [row["step"] for row in rows] == [2, 4, 6, 8]
    assert rows[-1]["samples"] == 8 * 2 * 16


def test_a_rank_without_eval_batches_does_not_hang_the_others(torchrun_job):
    """Rank 1 had no eval batch at any of the four evaluations, and the sums still add up."""
    (run_dir,) = (torchrun_job / "outputs" / "runs").glob("*/*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["eval_acc"] in (0.0, 1.0)
    assert len([row for row in read_jsonl(run_dir / "metrics.jsonl") if "eval_acc" in row]) == 4


def test_each_rank_audits_its_step_and_the_summary_holds_one_audit_of_both(
    torchrun_job, run_cfg, tmp_path
):
    """The FLOPs of both ranks' audited steps, summed: twice those of one process training the
    same per-rank batch."""
    (run_dir,) = (torchrun_job / "outputs" / "runs").glob("*/*")
    audit = json.loads((run_dir / "summary.json").read_text())["precision_audit"]
    assert (audit["ranks"], audit["engaged"], audit["flops_by_dtype"]) == (2, True, {"bfloat16": 1})
    assert audit["communication"] == {
        "strategy": "ddp",
        "allreduce_dtypes": ["float32"],
        "comm_hooks": [],
    }
    alone = train(run_cfg(*DDP_RUN, "precision=bf16", *TINY_MLP), tmp_path)["precision_audit"]
    assert audit["matmul_flops"] == 2 * alone["matmul_flops"]
    assert audit["saved_activation_bytes"] == alone["saved_activation_bytes"]


# gpt_tiny at one global batch of 8 sequences, on a clock that ticks a second per reading and a
# faked peak of 1 TFLOP/s (test_tflops_and_mfu_are_per_device_and_tokens_per_second_global).
LM_RUN = [*FAST_LM, "precision=fp32", "trainer.eval_every=null"]
LM_RANK_RUN = [
    "--peak-tflops=1",
    "--ticking-clock",
    *(o for o in LM_RUN if not o.startswith("dataset.batch_size=")),
    "dataset.batch_size=4",
]


# In the session's shared launch (tests/ddp_jobs.py): precision=auto, with a probe cached that
# makes fp32 and bf16 worth a trial; fp16 with an inf loss on rank 1 at step 2; the language model
# of LM_RANK_RUN, two ranks of 4 sequences each.
AUTO = ddp_jobs.declare(
    "ddp_auto",
    "--probe",
    json.dumps({"fp32": 1.0, "bf16": 1.0, "fp16": 0.02}),
    *DDP_RUN,
    *TINY_MLP,
    "precision=auto",
)
INF = ddp_jobs.declare("ddp_inf", "--inf-at", "2", *DDP_RUN, "precision=fp16", *TINY_MLP)
LM = ddp_jobs.declare("ddp_lm", *LM_RANK_RUN)


@pytest.fixture(scope="module")
def worker_jobs(shared_rank_jobs):
    root, states = shared_rank_jobs
    return {"auto": states[AUTO], "inf": states[INF], "lm": states[LM], "lm_dir": root / LM}


def test_under_torchrun_rank_0_times_the_model_and_every_rank_trains_its_choice(worker_jobs):
    ranks = worker_jobs["auto"]
    chosen = ranks[0]["summary"]["precision"]
    assert ranks[0]["summary"]["precision_reason"].startswith(
        f"auto: {chosen} by the speed trial on this model's forward+backward"
    )
    assert ranks[1]["summary"]["precision"] == chosen
    assert ranks[1]["summary"]["precision_reason"] == "auto: as rank 0 chose"


@pytest.fixture(scope="module")
def torchrun_sweep(tmp_path_factory):
    """A multirun under torchrun, in bf16_true with stochastic rounding: two seeds."""
    sweep_dir = tmp_path_factory.mktemp("torchrun_sweep")
    torchrun(
        "-m",
        "amp_exp",
        "-m",
        f"hydra.sweep.dir={sweep_dir}",
        *DDP_RUN,
        *TINY_MLP,
        "precision=bf16_true",
        "seed=0,1",
        # The report's speed trial would time the precision again; no test here reads it.
        "report.speed_trial=false",
    )
    return sweep_dir


def test_a_sweep_under_torchrun_runs_every_job_data_parallel(torchrun_sweep):
    """Each job of the multirun opens a process group of its own; rank 0 writes the report."""
    report = json.loads((torchrun_sweep / "report.json").read_text())
    assert [(row["status"], row["world_size"]) for row in report["runs"]] == [("completed", 2)] * 2


def test_bf16_true_with_stochastic_rounding_keeps_the_replicas_identical(torchrun_sweep):
    """Every rank seeds torch's generator alike and draws the same rounding bits, and the
    rounding never swaps a parameter's tensor, so DDP's gradient hooks keep firing."""
    for job in ("0", "1"):
        summary = json.loads((torchrun_sweep / job / "summary.json").read_text())
        assert (summary["precision"], summary["replicas_identical"]) == ("bf16_true", True)


def test_inf_on_one_rank_makes_every_rank_skip(worker_jobs):
    """DDP averages gradients before the scaler checks them, so rank 1's overflow is everyone's:
    both ranks skip step 2, back off to the same scale and stay bit-identical."""
    ranks = worker_jobs["inf"]

    for state in ranks.values():
        assert state["summary"]["skipped_steps"] == 1
        assert state["summary"]["first_overflow"]["step"] == 2
        # Rank 0's own loss was finite; the run still reports that a loss overflowed.
        assert state["summary"]["first_overflow"]["loss_finite"] is False
    assert ranks[0]["scale"] == ranks[1]["scale"] == 65536.0 / 2
    assert_bitwise_equal(ranks[0]["model"], ranks[1]["model"])
    assert ranks[0]["summary"]["replicas_identical"] is True


def test_tflops_and_mfu_are_per_device_and_tokens_per_second_global(
    tmp_path, monkeypatch, compose_cfg, worker_jobs
):
    """gpt_tiny at one global batch of 8 sequences: one process, then two ranks of 4 each, on a
    clock that ticks a second per reading (so both time alike) and a faked peak of 1 TFLOP/s. The
    global tokens/s are the same; TFLOP/s and MFU, per device, halve."""
    import amp_exp.build
    from amp_exp.config.values import validate
    from amp_exp.training.meters import Throughput

    monkeypatch.setattr(amp_exp.build, "Meter", meter_with_peak(1.0))
    monkeypatch.setattr(Throughput, "_now", ticking_clock())
    alone = train(validate(compose_cfg(*LM_RUN, fast=False)), tmp_path / "alone")
    two = worker_jobs["lm"][0]["summary"]

    assert (alone["world_size"], two["world_size"]) == (1, 2)
    assert two["samples_seen"] == alone["samples_seen"]
    assert two["tokens_per_s"] == pytest.approx(alone["tokens_per_s"])
    assert two["tokens_per_s_per_device"] == pytest.approx(alone["tokens_per_s"] / 2)
    assert alone["mfu"] == pytest.approx(alone["tflops"] / 1.0)
    for key in ("tflops", "mfu"):
        assert two[key] == pytest.approx(alone[key] / 2), key
    # The rows say the same as the summary.
    rows = [
        [row for row in read_jsonl(run / "metrics.jsonl") if row["kind"] == "train"][-1]
        for run in (tmp_path / "alone", worker_jobs["lm_dir"])
    ]
    assert rows[1]["tokens_per_s"] == pytest.approx(rows[0]["tokens_per_s"])
    assert rows[1]["mfu"] == pytest.approx(rows[0]["mfu"] / 2)
