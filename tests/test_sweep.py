"""Sweeps end to end: ``python -m amp_exp -m ...`` leaves a report built from the jobs' results.
The sweeps that succeed run through the entry point's ``main`` in this process
(conftest.command_main); one with a failed job is a process of its own, whose report is built as
it exits, and so are the joblib launcher's workers."""

from __future__ import annotations

import csv
import json
import os
import struct
from pathlib import Path

import pytest

from helpers.runs import FAST, TINY_MLP, run_cli

pytestmark = pytest.mark.slow

# TINY without model.width, so that a sweep can cross tiny_cnn with mlp.
SMALL = [*FAST, "dataset.image_size=8", "dataset.batch_size=16"]
# The speed trial at a sweep's end times the models in the sweep's own process, after the
# launcher's jobs; test_2x2_sweep_reports_the_numbers_of_each_job reads one, the others none.
NO_TRIAL = "report.speed_trial=false"
TESTS = str(Path(__file__).resolve().parent)
PYTHONPATH = os.environ.get("PYTHONPATH")
PLOTS = (
    "loss_curves.png",
    "loss_gap.png",
    "loss_scale.png",
    "throughput.png",
    "peak_memory.png",
    "speed_trial.png",
)


def sweep(command_main, *args: str) -> None:
    """``python -m amp_exp ARGS``, which must succeed."""
    result = command_main("amp_exp", *args)
    assert result.returncode == 0, result.stderr[-3000:]


def summaries(sweep_dir: Path) -> dict[str, dict]:
    return {
        path.parent.name: json.loads(path.read_text()) for path in sweep_dir.glob("*/summary.json")
    }


def markdown_rows(report_md: str) -> dict[str, dict[str, str]]:
    """The run table of report.md, as {run: {header: cell}}."""
    runs = report_md.split("\n| run |", 1)[1]
    lines = [
        line for line in f"| run |{runs}".split("\n\n")[0].splitlines() if line.startswith("| ")
    ]
    headers = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [
        dict(zip(headers, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[1:]
    ]
    return {row["run"]: row for row in rows}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_2x2_sweep_reports_the_numbers_of_each_job(tmp_path: Path, command_main) -> None:
    sweep(
        command_main,
        "-m",
        *SMALL,
        "precision=fp32,fp16",
        "model=tiny_cnn,mlp",
        # The speed trial at the sweep's end, kept short: enough rounds for a 95% interval.
        "speed.rounds=6",
        "speed.steps=2",
        "speed.max_warmup_steps=10",
        f"hydra.sweep.dir={tmp_path}",
    )
    jobs = summaries(tmp_path)  # each job its own directory and results
    assert sorted((s["model"], s["precision"]) for s in jobs.values()) == [
        ("mlp", "fp16"),
        ("mlp", "fp32"),
        ("tiny_cnn", "fp16"),
        ("tiny_cnn", "fp32"),
    ]
    report = json.loads((tmp_path / "report.json").read_text())
    rows = {row["run"]: row for row in report["runs"]}
    table = markdown_rows((tmp_path / "report.md").read_text())
    assert rows.keys() == table.keys() == jobs.keys()
    fp32_of = {s["model"]: s for s in jobs.values() if s["precision"] == "fp32"}
    for job, summary in jobs.items():
        row, cells, baseline = rows[job], table[job], fp32_of[summary["model"]]
        for key in ("model", "precision", "samples_per_s", "peak_mem_bytes", "final_loss"):
            assert row[key] == summary[key], key
        assert row["eval"] == {key: summary[key] for key in ("eval_loss", "eval_acc")}
        for key in ("skipped_steps", "loss_scale"):
            assert row[key] == summary[key], key
        assert row["speedup"] == summary["samples_per_s"] / baseline["samples_per_s"]
        assert row["peak_mem_ratio"] == summary["peak_mem_bytes"] / baseline["peak_mem_bytes"]
        assert row["quality_delta"] == 100 * (summary["eval_acc"] - baseline["eval_acc"])
        # report.md's Runs table keeps 9 columns; every field above is in runs.csv too.
        assert len(cells) <= 10
        assert cells["throughput"] == f"{summary['samples_per_s']:,.1f} samples/s"
        activations = row["activation_ratio"]
        assert cells["memory vs fp32"].startswith(f"{activations:.2f}x act.")
        assert cells["eval_acc"] == f"{summary['eval_acc']:.2%}"
        assert cells["result"] in ("learned", "DID NOT LEARN")
    csv_rows = list(csv.DictReader((tmp_path / "runs.csv").open()))
    assert [r["run"] for r in csv_rows] == list(rows)
    for found in csv_rows:
        summary = jobs[found["run"]]
        assert float(found["samples_per_s"]) == summary["samples_per_s"]
        assert float(found["final_loss"]) == summary["final_loss"]
        assert found["skipped_steps"] == str(summary["skipped_steps"])
    assert [line.split(":")[0] for line in report["verdicts"]] == ["tiny_cnn", "mlp"]
    # One seed measures no noise: each difference is shown, and no verdict claimed.
    comparisons = report["comparisons"]
    assert [(c["model"], c["verdict"]) for c in comparisons] == [
        ("tiny_cnn", "single_seed"),
        ("mlp", "single_seed"),
    ]
    assert all("on a single seed" in line for line in report["verdicts"])
    # The trial timed each model's fp16 against fp32 in AB/BA rounds, and the report gives
    # that figure, beside each job's own samples/s.
    trials = {t["model"]: t for t in json.loads((tmp_path / "speed.json").read_text())["trials"]}
    for comparison in comparisons:
        trial = trials[comparison["model"]]
        assert comparison["speedup"] == trial["speedup"]["fp16"]
        assert trial["pairs"]["fp16"]["order"][:2] == [["fp32", "fp16"], ["fp16", "fp32"]]
    # One speedup column: the trial's, with its interval, never the jobs' beside it.
    for job, cells in table.items():
        trial = rows[job]["trial_speedup"]
        if cells["precision"] == "fp16":
            low, high = trial["ci"]
            assert cells["speedup vs fp32"] == f"{trial['ratio']:.2f}x [{low:.2f}, {high:.2f}]"
    assert report["plots"] == list(PLOTS) and report["plot_errors"] == {}
    for name in PLOTS:
        width, height = png_size(tmp_path / name)
        assert 400 <= width <= 3000 and 300 <= height <= 2000, (name, width, height)
        assert 10_000 < (tmp_path / name).stat().st_size < 1_000_000, name
        assert f"![{name.removesuffix('.png')}]({name})" in (tmp_path / "report.md").read_text()


def test_a_failed_job_is_reported_failed_and_the_others_still_count(tmp_path: Path) -> None:
    # Jobs with a learning rate of 1e30 diverge at step 2 and stop: they fail once they train.
    result = run_cli(
        "-m",
        *FAST,
        *TINY_MLP,
        "precision=fp32,bf16",
        "optimizer.lr=0.1,1e30",
        "trainer.on_nonfinite=stop",
        NO_TRIAL,
        f"hydra.sweep.dir={tmp_path}",
        expect_rc=1,  # Hydra still reports the sweep as failed
    )
    assert "non-finite gradients at step 2" in result.stderr
    jobs = summaries(tmp_path)
    job_of = {(s["precision"], s["config"]["optimizer"]["lr"]): job for job, s in jobs.items()}
    assert len(job_of) == 4
    failed = {job for job, summary in jobs.items() if summary["status"] == "failed"}
    assert failed == {job_of["fp32", 1e30], job_of["bf16", 1e30]}
    assert jobs[job_of["fp32", 1e30]]["error"].startswith(
        "NumericalFault: non-finite gradients at step 2 in fp32"
    )
    assert {jobs[job]["task"] for job in failed} == {"classification"}  # inferred, not null
    rows = {row["run"]: row for row in json.loads((tmp_path / "report.json").read_text())["runs"]}
    assert {job for job, row in rows.items() if row["status"] == "failed"} == failed
    # bf16 at lr 0.1 is compared with fp32 at lr 0.1, not with the failed fp32 job.
    bf16, fp32 = job_of["bf16", 0.1], job_of["fp32", 0.1]
    assert rows[bf16]["baseline"] == fp32
    assert rows[bf16]["speedup"] == jobs[bf16]["samples_per_s"] / jobs[fp32]["samples_per_s"]
    report_md = (tmp_path / "report.md").read_text()
    assert "4 runs (2 completed, 2 failed)" in report_md
    assert "(mlp bf16) failed (NumericalFault: non-finite gradients" in report_md


def test_a_preset_sweeps_without_dash_m(tmp_path: Path, command_main, pngs_not_rasterized) -> None:
    # fp16 is the slowest CPU path: four jobs of a one-layer MLP, whose scaled gradients
    # overflow fp16 as a network's do.
    sweep(
        command_main, "experiment=init_scale_sweep", *FAST, *TINY_MLP, f"hydra.sweep.dir={tmp_path}"
    )
    jobs = summaries(tmp_path)
    scales = {s["config"]["precision"]["init_scale"]: s for s in jobs.values()}
    assert sorted(scales) == [1024.0, 65536.0, 16777216.0, 4294967296.0]
    assert all(s["precision"] == "fp16" for s in jobs.values())
    # 2**32 times the loss overflows fp16 gradients: the scaler skips steps and backs off.
    assert scales[4294967296.0]["skipped_steps"] > 0
    assert scales[4294967296.0]["loss_scale"] < 4294967296.0
    report = json.loads((tmp_path / "report.json").read_text())
    assert {row["setting"] for row in report["runs"]} == {
        f"precision.init_scale={scale}" for scale in scales
    }
    assert "loss_scale.png" in report["plots"]


def test_joblib_launcher_runs_jobs_in_parallel_and_reports_them(tmp_path: Path) -> None:
    """Each job's model is built only when both jobs are building theirs (a rendezvous, not a
    clock): run one after another, the first job fails and the report says so."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    run_cli(
        "-m",
        *FAST,
        "dataset.image_size=8",
        "dataset.batch_size=16",
        "model=custom",
        "model._target_=helpers.user_code.make_classifier_met_by",
        f"+model.kwargs.rendezvous={rendezvous}",
        "+model.kwargs.jobs=2",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "precision=fp32,bf16",
        NO_TRIAL,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        # loky's workers are fresh interpreters: they import the model from this folder.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, PYTHONPATH]))},
    )
    report = json.loads((tmp_path / "sweep" / "report.json").read_text())
    assert [(row["precision"], row["status"]) for row in report["runs"]] == [
        ("fp32", "completed"),
        ("bf16", "completed"),
    ]
    # Two processes met: loky's two workers, not the launcher's own process twice.
    assert len(list(rendezvous.iterdir())) == 2
