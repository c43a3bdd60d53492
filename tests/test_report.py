"""The report on hand-made run directories: baselines, verdicts, failures, and plots that fail."""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
from pathlib import Path

import pytest

import amp_exp.report
from amp_exp.report import plots
from amp_exp.report.__main__ import main
from amp_exp.report.assemble import build_report
from amp_exp.tasks.classification import ClassificationTask
from helpers.warm_python import python_m

# The tests of the pictures ask for real_pngs (conftest).
pytestmark = pytest.mark.usefixtures("pngs_not_rasterized")
MiB = 2**20
COMPUTES_IN = {"fp32": "float32", "fp16": "float16"}
ENGINE_CHECKS = ("master_weights_fp32", "unscaled_grads_fp32_finite")


def write_run(
    path: Path,
    model: str,
    precision: str,
    samples_per_s: float,
    eval_acc: float,
    activation_bytes: int = 100 * MiB,
    clip: float | None = None,
    skipped_steps: int = 0,
    final_loss: float = 1.5,
    world_size: int = 1,
    seed: int = 0,
    losses: list[float] | None = None,
) -> dict:
    """A run directory as python -m amp_exp leaves it: summary.json and metrics.jsonl, whose
    training loss is ``losses`` at steps 1, 2, ... (2/step by default)."""
    path.mkdir(parents=True)
    scale = 1024.0 if precision == "fp16" else None
    summary = {
        "status": "completed",
        "model": model,
        "precision": precision,
        "device_name": "test-cpu",
        "samples_per_s": samples_per_s,
        "peak_mem_bytes": 800 * MiB,
        "peak_mem_kind": "cpu_peak_rss",
        "precision_audit": {
            "engaged": True,
            "flops_by_dtype": {COMPUTES_IN.get(precision, "bfloat16"): 1.0},
            "saved_activation_bytes": {"total": activation_bytes},
        },
        "final_loss": final_loss,
        # The engine's AMP checks, as training/diagnostics.py records them when none failed.
        "checks": {name: {"passed": True, "offenders": []} for name in ENGINE_CHECKS},
        "task_metrics": ClassificationTask.metrics.as_dict(),
        "eval_acc": eval_acc,
        "skipped_steps": skipped_steps,
        "loss_scale": scale,
        "world_size": world_size,
        "config": {
            "model": {"name": model},
            "precision": {"name": precision, "clip_grad_norm": clip},
            "seed": seed,
        },
    }
    (path / "summary.json").write_text(json.dumps(summary))
    losses = losses or [2.0 / step for step in (1, 2, 3)]
    rows = [
        {"kind": "train", "step": step, "loss": loss, "scale": scale}
        | {"skipped_steps": skipped_steps}
        for step, loss in enumerate(losses, start=1)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return summary


def write_failed_run(
    path: Path,
    model: str,
    precision: str,
    error: str | None,
    status: str = "failed",
    seed: int = 0,
    losses: list[float] | None = None,
) -> None:
    """A run that ended without completing; its metrics.jsonl logs ``losses`` at steps 1, 2, ..."""
    path.mkdir(parents=True)
    if losses:
        rows = [
            {"kind": "train", "step": step, "loss": loss} for step, loss in enumerate(losses, 1)
        ]
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "status": status,
        "error": error,
        "model": model,
        "precision": precision,
        "config": {"model": {"name": model}, "precision": {"name": precision}, "seed": seed},
    }
    (path / "summary.json").write_text(json.dumps(summary))


def rows_by_run(report: dict) -> dict[str, dict]:
    return {row["run"]: row for row in report["runs"]}


def test_each_run_is_compared_with_fp32_of_its_model_and_setting(tmp_path: Path) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.80, activation_bytes=400 * MiB)
    write_run(tmp_path / "1", "mlp", "fp32", 4000.0, 0.70)
    write_run(tmp_path / "2", "tiny_cnn", "bf16", 2000.0, 0.80, activation_bytes=200 * MiB)
    write_run(tmp_path / "3", "mlp", "bf16", 1000.0, 0.70)
    write_run(tmp_path / "10", "tiny_cnn", "fp32", 500.0, 0.80, clip=1.0)
    write_run(tmp_path / "11", "tiny_cnn", "bf16", 1500.0, 0.80, clip=1.0)
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    rows = rows_by_run(report)
    assert rows["2"]["speedup"] == 2.0 and rows["2"]["baseline"] == "0"
    assert rows["2"]["activation_ratio"] == 0.5 and rows["2"]["peak_mem_ratio"] == 1.0
    assert rows["3"]["speedup"] == 0.25 and rows["3"]["baseline"] == "1"
    assert rows["11"]["speedup"] == 3.0 and rows["11"]["baseline"] == "10"
    assert rows["0"]["speedup"] == 1.0
    assert rows["2"]["setting"] == "precision.clip_grad_norm=null"
    assert rows["11"]["setting"] == "precision.clip_grad_norm=1.0"
    assert rows["1"]["setting"] == ""  # the mlp runs differ only in precision
    # Grouped by model and setting, fp32 first; job 10 sorts after job 3, not after job 1.
    assert [row["run"] for row in report["runs"]] == ["0", "2", "10", "11", "1", "3"]
    assert report["verdicts"][0].startswith(
        "tiny_cnn (precision.clip_grad_norm=null): bf16 against fp32 on a single seed"
    )
    assert (
        "; 2.00x fp32's speed (one seed's jobs timed one after another: no interval), 0.50x the "
        "saved activations of fp32" in (report["verdicts"][0])
    )
    assert report["verdicts"][1].startswith("tiny_cnn (precision.clip_grad_norm=1.0): bf16")
    assert report["verdicts"][2].startswith("mlp: bf16 against fp32 on a single seed")
    assert "0.25x fp32's speed" in report["verdicts"][2]


def test_a_single_seed_shows_the_difference_and_its_tolerance_but_claims_nothing(
    tmp_path: Path,
) -> None:
    write_run(tmp_path / "0", "resnet18", "fp32", 100.0, 0.900)
    write_run(tmp_path / "1", "resnet18", "bf16", 190.0, 0.898)
    write_run(tmp_path / "2", "resnet18", "fp16", 200.0, 0.870, skipped_steps=4)
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    assert report["verdicts"] == [
        "resnet18: bf16 against fp32 on a single seed: Δ accuracy -0.20 points, tolerance "
        "±0.5 points; one seed measures no noise, so no verdict (sweep seed=0,1,2 for one); "
        "1.90x fp32's speed (one seed's jobs timed one after another: no interval), 1.00x the "
        "saved activations of fp32; "
        "loss gap "
        "+0.00%, +0.0000 absolute, over the last 10% of steps",
        "resnet18: fp16 against fp32 on a single seed: Δ accuracy -3.00 points, tolerance "
        "±0.5 points; one seed measures no noise, so no verdict (sweep seed=0,1,2 for one); "
        "2.00x fp32's speed (one seed's jobs timed one after another: no interval), 1.00x the "
        "saved activations of fp32; "
        "loss gap "
        "+0.00%, +0.0000 absolute, over the last 10% of steps, skipped 4 steps",
    ]
    (bf16, fp16) = report["comparisons"]
    assert (bf16["verdict"], bf16["n"], bf16["delta_ci95"], bf16["p_equivalence"]) == (
        "single_seed",
        1,
        None,
        None,
    )
    assert fp16["delta_mean"] == pytest.approx(-3.0)
    report = build_report([tmp_path], tmp_path, tolerance=3.5)
    assert "tolerance ±3.5 points" in report["verdicts"][1]
    report_md = (tmp_path / "report.md").read_text()
    assert "Tolerance: eval_acc ±3.5 points (`report.tolerance`)." in report_md
    # Without report.tolerance the task's own default judges: 0.5 points for classification.
    assert build_report([tmp_path], tmp_path)["comparisons"][0]["tolerance"] == 0.5


def test_verdict_names_a_diverged_run(tmp_path: Path) -> None:
    write_run(tmp_path / "0", "mlp", "fp32", 100.0, 0.10)
    write_run(tmp_path / "1", "mlp", "fp16", 50.0, 0.10, skipped_steps=28, final_loss=float("nan"))
    (verdict,) = build_report([tmp_path], tmp_path, tolerance=0.5)["verdicts"]
    assert verdict.endswith("skipped 28 steps, the loss diverged (nan)")
    row = "| 1 | mlp | fp16 | completed | 50.0 samples/s | 0.50x (jobs) |"
    assert row in (tmp_path / "report.md").read_text()


def test_runs_that_failed_or_stopped_are_shown_and_the_others_still_count(tmp_path: Path) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    write_failed_run(tmp_path / "1", "tiny_cnn", "fp16", "RuntimeError: CUDA out of memory")
    write_run(tmp_path / "2", "tiny_cnn", "bf16", 1200.0, 0.8)
    write_failed_run(tmp_path / "3", "tiny_cnn", "bf16", None, status="stopped")
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    rows = rows_by_run(report)
    assert rows["1"]["status"] == "failed" and rows["1"]["speedup"] is None
    assert rows["2"]["speedup"] == 1.2
    bf16, fp16 = report["verdicts"]
    assert bf16.startswith("tiny_cnn: bf16 against fp32 on a single seed: Δ accuracy +0.00")
    # The stopped attempt of seed 0 is missing data that its completed run settles.
    assert bf16.endswith("; bf16 stopped")
    # Out of memory where fp32 fit is a finding about fp16, not a seed left out.
    assert fp16 == (
        "tiny_cnn: fp16 is unstable (seed 0: fp16 ran out of memory (RuntimeError: CUDA out of "
        "memory), of 1 seed attempted)"
    )
    report_md = (tmp_path / "report.md").read_text()
    assert "4 runs (2 completed, 1 failed, 1 stopped)" in report_md
    assert "| 1 | tiny_cnn | fp16 | failed | - |" in report_md
    assert "- `1` (tiny_cnn fp16) failed (RuntimeError: CUDA out of memory)" in report_md


def test_without_a_completed_fp32_run_the_verdict_says_so(tmp_path: Path) -> None:
    write_failed_run(tmp_path / "0", "mlp", "fp32", "ConfigError: no")
    write_run(tmp_path / "1", "mlp", "fp16", 50.0, 0.5, skipped_steps=2)
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    assert report["verdicts"] == [
        "mlp: no completed fp32 run to compare with; fp32 failed (ConfigError: no); "
        "fp16 final loss 1.5000, skipped 2 steps"
    ]
    assert rows_by_run(report)["1"]["speedup"] is None


def test_a_plot_that_fails_never_costs_the_table(tmp_path: Path, monkeypatch, real_pngs) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    write_run(tmp_path / "1", "tiny_cnn", "fp16", 900.0, 0.8)

    def broken(rows, metrics):
        raise ValueError("no room for bars")

    monkeypatch.setitem(plots.PLOTS, "throughput.png", broken)
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    assert report["plot_errors"] == {"throughput.png": "ValueError: no room for bars"}
    assert report["plots"] == [
        "loss_curves.png",
        "loss_gap.png",
        "loss_scale.png",
        "peak_memory.png",
    ]
    assert all((tmp_path / name).stat().st_size > 0 for name in report["plots"])
    assert not (tmp_path / "throughput.png").exists()
    report_md = (tmp_path / "report.md").read_text()
    assert "| 1 | tiny_cnn | fp16 | learned | 900.0 samples/s | 0.90x (jobs) |" in report_md
    assert "throughput.png could not be drawn: ValueError: no room for bars" in report_md


def test_without_matplotlib_the_report_keeps_its_table(tmp_path: Path, monkeypatch) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    # Importing the plots fails, as it does where matplotlib is not installed.
    monkeypatch.delattr(amp_exp.report, "plots", raising=False)
    monkeypatch.setitem(sys.modules, "amp_exp.report.plots", None)
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    assert report["plots"] == [] and "amp_exp[report]" in report["plot_errors"]["plots"]
    row = "| 0 | tiny_cnn | fp32 | learned | 1,000.0 samples/s |"
    assert row in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["runs"] == report["runs"]


def test_a_completed_run_whose_metrics_end_in_a_cut_line_is_damaged_not_judged(
    tmp_path: Path,
    real_pngs,
) -> None:
    """A completed run closes metrics.jsonl whole: a line cut short means the file was cut
    afterwards, and the run is listed as damaged (its rows before the cut still drawn)."""
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    with (tmp_path / "0" / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 4, "lo')
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    assert report["runs"][0]["status"] == "damaged"
    assert report["runs"][0]["error"] == "its metrics.jsonl ends in a line cut short"
    assert "loss_curves.png" in report["plots"]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"[1]", "it holds a JSON list, not an object"),
        (b'"completed"', "it holds a JSON str, not an object"),
        (b'{"foo": 1}', "its status is None, not one of completed, stopped, failed, killed"),
        (b'{"status": "done"}', "its status is 'done', not one of completed, stopped, failed"),
        (b'{"status": "completed"', "Expecting ',' delimiter"),
        (b'{"status": "completed\xff"}', "'utf-8' codec can't decode byte 0xff"),
    ],
)
def test_a_summary_that_is_no_summary_is_named_and_the_others_are_reported(
    tmp_path: Path, caplog, content: bytes, why: str
) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    write_run(tmp_path / "1", "tiny_cnn", "bf16", 1500.0, 0.8)
    write_run(tmp_path / "2", "tiny_cnn", "fp16", 1200.0, 0.8)
    (tmp_path / "2" / "summary.json").write_bytes(content)
    with caplog.at_level(logging.WARNING):
        report = build_report([tmp_path], tmp_path, tolerance=0.5)
    rows = rows_by_run(report)
    assert rows["2"]["status"] == "failed" and rows["2"]["error"].startswith(
        f"unreadable summary.json: {why}"
    )
    assert rows["1"]["speedup"] == 1.5
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"{tmp_path / '2' / 'summary.json'}: unreadable ({why}")


def test_fields_of_the_wrong_kind_are_left_out_and_named(tmp_path: Path, caplog, capsys) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    summary = write_run(tmp_path / "1", "tiny_cnn", "bf16", 1500.0, 0.8)
    summary.update(
        samples_per_s="fast",
        world_size="2",
        skipped_steps=True,
        checks=[1],
        first_overflow={"step": 3},
        hardware={"advice": "use fp32"},
    )
    (tmp_path / "1" / "summary.json").write_text(json.dumps(summary))
    with caplog.at_level(logging.WARNING):
        assert main([str(tmp_path)]) == 0
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        f"{tmp_path / '1' / 'summary.json'}: left out world_size, skipped_steps, samples_per_s, "
        "checks, first_overflow, hardware, not of the kind amp_exp writes there"
    )
    row = rows_by_run(json.loads((tmp_path / "report.json").read_text()))["1"]
    assert (row["status"], row["samples_per_s"], row["speedup"]) == ("completed", None, None)
    assert row["quality_delta"] == 0.0  # what could be read still counts
    assert "; throughput not measured, " in capsys.readouterr().out


def test_metrics_lines_that_are_no_rows_are_skipped(tmp_path: Path, caplog, real_pngs) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    metrics = tmp_path / "0" / "metrics.jsonl"
    metrics.write_bytes(b"\xff\xfe not text\n{}\n[2]\n" + metrics.read_bytes())
    with caplog.at_level(logging.WARNING):
        report = build_report([tmp_path], tmp_path, tolerance=0.5)
    assert f"{metrics}: skipping 3 unreadable line(s)" in caplog.text
    assert "loss_curves.png" in report["plots"]


def test_a_sweep_directory_that_cannot_be_written_is_a_one_line_error(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)

    def read_only(path, write, durable=True):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr("amp_exp.results.files.atomic_write", read_only)
    assert main([str(tmp_path)]) == 4
    assert capsys.readouterr().err == (
        f"amp_exp.report: error: could not write {tmp_path / 'report.json'} (Read-only file "
        "system); nothing was written; write it elsewhere with --out DIR\n"
    )


def test_several_run_directories_are_reported_together(tmp_path: Path, capsys) -> None:
    write_run(tmp_path / "runs" / "a", "tiny_cnn", "fp32", 1000.0, 0.8)
    write_run(tmp_path / "runs" / "b", "tiny_cnn", "bf16", 700.0, 0.8)
    assert main([str(tmp_path / "runs" / "a"), str(tmp_path / "runs" / "b")]) == 0
    report = json.loads((tmp_path / "runs" / "report.json").read_text())
    assert [row["run"] for row in report["runs"]] == ["a", "b"]
    assert rows_by_run(report)["b"]["speedup"] == 0.7
    shown = "0.70x fp32's speed (one seed's jobs timed one after another: no interval)"
    assert shown in capsys.readouterr().out


def test_a_missing_directory_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "nope")]) == 2
    assert (
        capsys.readouterr().err
        == f"amp_exp.report: error: {tmp_path / 'nope'} is not a directory\n"
    )


@pytest.mark.slow
def test_report_cli_on_a_directory_without_runs_exits_2(tmp_path: Path) -> None:
    (tmp_path / "empty" / "0").mkdir(parents=True)
    result = python_m("amp_exp.report", str(tmp_path / "empty"), timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"amp_exp.report: error: no runs under {tmp_path / 'empty'}: found no summary.json; give "
        "a sweep directory or run directories written by python -m amp_exp"
    ]
    assert not (tmp_path / "empty" / "report.md").exists()


def test_amp_health_section_names_failed_checks_overflow_and_advice(tmp_path: Path) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.9)
    fp16 = tmp_path / "1"
    write_run(fp16, "tiny_cnn", "fp16", 900.0, 0.9)
    summary = json.loads((fp16 / "summary.json").read_text())
    summary.update(
        checks={
            "master_weights_fp32": {"passed": False, "offenders": ["head.bias"]},
            "unscaled_grads_fp32_finite": {"passed": True, "offenders": []},
        },
        first_overflow={"step": 3, "loss_finite": True, "parameters": ["head.weight"]},
        underflow={"underflow_frac_scaled": 0.25},
        suggested_init_scale=262144.0,
        hardware={"advice": ["fp16 on this CPU: no fast fp16 kernels"]},
    )
    (fp16 / "summary.json").write_text(json.dumps(summary))
    build_report([tmp_path], tmp_path, tolerance=0.5)
    markdown = (tmp_path / "report.md").read_text()
    section = markdown.split("## AMP health\n\n")[1].split("\n\n")[0].splitlines()
    assert section == [
        "- `0` (tiny_cnn fp32): checks passed; matmul FLOPs: float32 100%",
        "- `1` (tiny_cnn fp16): checks FAILED: master_weights_fp32 (head.bias); first overflow "
        "at step 3 (loss finite; head.weight); 25.00% of gradients lost to fp16 underflow; "
        "suggested init_scale 262144; matmul FLOPs: float16 100%",
        "- this machine: fp16 on this CPU: no fast fp16 kernels",
    ]
    health = rows_by_run(json.loads((tmp_path / "report.json").read_text()))["1"]["health"]
    assert health["failed_checks"] == {"master_weights_fp32": ["head.bias"]}


def test_fp16_figures_of_another_precision_say_what_fp16_would_do_and_advice_is_said_once(
    tmp_path: Path,
) -> None:
    """Issue 37: fp32 runs said "0.16% of gradients lost to fp16 underflow", as if fp32 lost
    something, and the probe's advice came once per run."""
    for job, precision in enumerate(("fp32", "bf16")):
        summary = write_run(tmp_path / str(job), "tiny_cnn", precision, 1000.0, 0.9)
        summary.update(
            underflow={"underflow_frac_scaled": 0.0016},
            suggested_init_scale=1048576.0,
            hardware={"advice": ["bf16 is slow here"]},
        )
        (tmp_path / str(job) / "summary.json").write_text(json.dumps(summary))
    build_report([tmp_path], tmp_path, tolerance=0.5)
    markdown = (tmp_path / "report.md").read_text()
    section = markdown.split("## AMP health\n\n")[1].split("\n\n")[0]
    assert "- `0` (tiny_cnn fp32): checks passed; if this run were fp16, 0.16% of its " in section
    assert "lost to fp16 underflow" not in section and "init_scale" not in section
    assert markdown.count("bf16 is slow here") == 1


def test_the_precision_cell_names_ranks_only_when_a_run_was_data_parallel(tmp_path: Path) -> None:
    write_run(tmp_path / "single" / "0", "tiny_cnn", "fp32", 1000.0, 0.80)
    build_report([tmp_path / "single"], tmp_path / "single", tolerance=0.5)
    assert "| 0 | tiny_cnn | fp32 | learned |" in (tmp_path / "single" / "report.md").read_text()

    write_run(tmp_path / "ddp" / "0", "tiny_cnn", "fp32", 1000.0, 0.80, world_size=2)
    write_run(tmp_path / "ddp" / "1", "tiny_cnn", "bf16", 1500.0, 0.80, world_size=2)
    report = build_report([tmp_path / "ddp"], tmp_path / "ddp", tolerance=0.5)
    assert [row["world_size"] for row in report["runs"]] == [2, 2]
    assert "| 1 | tiny_cnn | bf16 [2 ranks] |" in (tmp_path / "ddp" / "report.md").read_text()


def test_fsdp2_runs_show_their_strategy_and_the_dtypes_that_are_not_fp32(tmp_path: Path) -> None:
    for job, reduce_dtype in (("0", "fp32"), ("1", "bf16")):
        summary = write_run(tmp_path / job, "gpt_tiny", "bf16", 1000.0, 0.5, world_size=2)
        summary.update(strategy="fsdp2", param_dtype="bf16", reduce_dtype=reduce_dtype)
        (tmp_path / job / "summary.json").write_text(json.dumps(summary))
    build_report([tmp_path], tmp_path, tolerance=0.5)
    table = (tmp_path / "report.md").read_text()
    assert "| bf16 [2 ranks, fsdp2, params bf16] |" in table
    assert "| bf16 [2 ranks, fsdp2, params bf16, reduce bf16] |" in table

    write_run(tmp_path / "ddp" / "0", "tiny_cnn", "fp32", 1000.0, 0.80, world_size=2)
    build_report([tmp_path / "ddp"], tmp_path / "ddp", tolerance=0.5)
    assert "fsdp2" not in (tmp_path / "ddp" / "report.md").read_text()


def test_a_job_killed_before_its_summary_is_listed_as_killed(tmp_path: Path) -> None:
    """SIGKILL and the OOM killer leave no summary.json; the config Hydra saved names the job."""
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    killed = tmp_path / "1"
    (killed / ".hydra").mkdir(parents=True)
    (killed / ".hydra" / "config.yaml").write_text(
        "model:\n  name: tiny_cnn\nprecision:\n  name: bf16\nseed: 0\n"
    )
    (killed / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n{"st')
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    row = rows_by_run(report)["1"]
    assert (row["status"], row["model"], row["precision"]) == ("killed", "tiny_cnn", "bf16")
    assert "no summary.json" in row["error"]
    assert "2 runs (1 completed, 1 killed)" in (tmp_path / "report.md").read_text()


def write_parallel_run(path: Path, precision: str, acc: float, ranks: int, strategy: str) -> None:
    """A tiny_cnn run of ``ranks`` ranks of batch 16 each."""
    summary = write_run(path, "tiny_cnn", precision, 1000.0 * ranks, acc, world_size=ranks)
    summary.update(strategy=strategy, global_batch_size=16 * ranks, param_dtype="fp32")
    (path / "summary.json").write_text(json.dumps(summary))


def test_world_size_strategy_and_global_batch_are_part_of_the_setting(tmp_path: Path) -> None:
    """A 1-rank fp32 run at global batch 16 is no baseline for a 2-rank bf16 run at 32."""
    write_parallel_run(tmp_path / "0", "fp32", 0.80, 1, "single")
    write_parallel_run(tmp_path / "1", "bf16", 0.79, 2, "ddp")
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    bf16 = rows_by_run(report)["1"]
    assert bf16["setting"] == "world_size=2, strategy=ddp, global_batch_size=32"
    assert bf16["baseline"] is None and bf16["speedup"] is None
    assert report["verdicts"][1] == (
        "tiny_cnn (world_size=2, strategy=ddp, global_batch_size=32): no completed fp32 run to "
        "compare with; bf16 final loss 1.5000"
    )
    write_parallel_run(tmp_path / "2", "fp32", 0.80, 2, "ddp")
    bf16 = rows_by_run(build_report([tmp_path], tmp_path, tolerance=0.5))["1"]
    assert bf16["baseline"] == "2" and bf16["speedup"] == 1.0


def test_the_report_says_so_when_its_runs_ran_under_different_strategies(tmp_path: Path) -> None:
    write_parallel_run(tmp_path / "0", "fp32", 0.80, 2, "ddp")
    write_parallel_run(tmp_path / "1", "fp32", 0.80, 2, "fsdp2")
    write_parallel_run(tmp_path / "2", "bf16", 0.80, 2, "fsdp2")
    summary = json.loads((tmp_path / "2" / "summary.json").read_text())
    summary.update(param_dtype="bf16", reduce_dtype="fp32")
    (tmp_path / "2" / "summary.json").write_text(json.dumps(summary))
    build_report([tmp_path], tmp_path, tolerance=0.5)
    assert (
        "These runs ran under different strategies, so each is compared only with the fp32 run "
        "of its own strategy, world size and global batch: ddp (weights compute in fp32, "
        "gradients reduced in -); fsdp2 (weights compute in bf16, gradients reduced in fp32); "
        "fsdp2 (weights compute in fp32, gradients reduced in -)."
    ) in (tmp_path / "report.md").read_text()
    write_parallel_run(tmp_path / "ddp" / "0", "fp32", 0.80, 2, "ddp")
    build_report([tmp_path / "ddp"], tmp_path / "ddp", tolerance=0.5)
    assert "different strategies" not in (tmp_path / "ddp" / "report.md").read_text()


def test_a_killed_jobs_config_is_resolved_so_it_keeps_its_fp32_partner(
    tmp_path: Path, run_cfg, compose_cfg
) -> None:
    """Hydra saves the job's config before validation infers its task, with its interpolations
    as written: read as saved, the killed job would sit alone under task=null."""
    from omegaconf import OmegaConf

    from amp_exp.config.plain import plain_run_config

    interpolated = "dataset.eval_batch_size=${dataset.batch_size}"
    summary = write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    summary["config"] = plain_run_config(run_cfg(interpolated, "precision=fp32"))
    (tmp_path / "0" / "summary.json").write_text(json.dumps(summary))
    killed = tmp_path / "1" / ".hydra"
    killed.mkdir(parents=True)
    saved = compose_cfg(interpolated, "precision=bf16")
    assert saved.task is None and "${" in OmegaConf.to_yaml(saved)
    (killed / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    row = rows_by_run(report)["1"]
    assert (row["status"], row["setting"]) == ("killed", "")
    assert report["verdicts"] == [
        "tiny_cnn: bf16 against fp32 is incomplete (seed 0: bf16 was killed (no "
        "summary.json: the process was killed (SIGKILL, out of memory) or is still running), of 1 "
        "seed attempted; rerun the seed: its completed rerun is paired, never the failed attempt)"
    ]


def test_only_rank_0_of_a_torchrun_sweep_writes_the_report(tmp_path: Path, monkeypatch) -> None:
    from amp_exp.report.assemble import SweepReport

    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    callback = SweepReport()
    callback.sweep_dir = tmp_path
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    callback.build()
    assert not (tmp_path / "report.md").exists()
    monkeypatch.setenv("RANK", "0")
    callback.build()
    assert (tmp_path / "report.md").is_file()


def test_emulated_fp8_shows_as_not_timed_and_mode_variants_share_the_fp32_baseline(
    tmp_path: Path,
) -> None:
    write_run(tmp_path / "0", "mlp", "fp32", 1000.0, 0.8)
    for job, precision, knobs, extra in [
        ("1", "fp8", {"options": {"recipe": "rowwise"}, "emulate": True}, {}),
        ("2", "bf16_true", {"options": {"stochastic_rounding": True}}, {"stale_weight_frac": 0.01}),
    ]:
        path = tmp_path / job
        summary = write_run(path, "mlp", precision, 0.0, 0.8) | extra
        summary["samples_per_s"] = None if precision == "fp8" else 900.0
        summary["config"]["precision"] |= knobs
        if precision == "fp8":
            summary["precision_details"] = {
                "emulated": True,
                "converted_linears": ["3"],
                "skipped_linears": {"1": "too small"},
            }
        (path / "summary.json").write_text(json.dumps(summary))
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    rows = rows_by_run(report)
    # The name a user passes back, its options, and the label the report shows.
    assert rows["1"]["precision"] == "fp8"
    assert rows["1"]["precision_options"] == {"emulate": True, "options": {"recipe": "rowwise"}}
    assert rows["1"]["label"] == "fp8 (rowwise, emulated)"
    assert rows["2"]["precision_options"] == {"options": {"stochastic_rounding": True}}
    assert [c["precision"] for c in report["comparisons"]] == ["bf16_true", "fp8"]
    assert rows["1"]["baseline"] == rows["2"]["baseline"] == "0"
    assert rows["1"]["setting"] == ""
    bf16_true, fp8 = report["verdicts"]
    assert "; emulated, not timed, 1.00x the saved activations of fp32" in fp8
    assert "0.90x fp32's speed" in bf16_true and "did not move" not in bf16_true
    markdown = (tmp_path / "report.md").read_text()
    assert "fp8 linears: 3 (kept in bf16: 1: too small)" in markdown
    assert "1.0% of weights unchanged over the last interval" in markdown


def test_a_run_whose_precision_did_not_engage_is_marked_and_not_judged_as_that_precision(
    tmp_path: Path,
) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.80, activation_bytes=400 * MiB)
    summary = write_run(tmp_path / "1", "tiny_cnn", "bf16", 3000.0, 0.80)
    summary["precision_audit"] |= {
        "engaged": False,
        "flops_by_dtype": {"float32": 0.88, "bfloat16": 0.12},
        "shortfalls": ["12% of matmul FLOPs ran in bfloat16, at least 50% expected"],
        "responsible": {"island": {"float32": 0.88}},
    }
    (tmp_path / "1" / "summary.json").write_text(json.dumps(summary))
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    row = rows_by_run(report)["1"]
    assert (row["precision"], row["label"], row["engaged"]) == ("bf16", "bf16", False)
    (verdict,) = report["verdicts"]
    assert verdict == (
        "tiny_cnn: bf16: 12% of matmul FLOPs ran in bfloat16, at least 50% expected, so its "
        "figures are not bf16's; bf16 did not engage (not_engaged), so no verdict on it"
    )
    (comparison,) = report["comparisons"]
    assert comparison["verdict"] == "not_engaged"
    markdown = (tmp_path / "report.md").read_text()
    assert "| 1 | tiny_cnn | bf16 (did not engage) |" in markdown
    # The evidence table names the verdict too, never matches.
    assert "| not_engaged |" in markdown and "| matches |" not in markdown
    assert (
        "- `1` (tiny_cnn bf16 (did not engage)): checks passed; matmul FLOPs: float32 88%, "
        "bfloat16 12%; DID NOT ENGAGE: 12% of matmul FLOPs ran in bfloat16, at least 50% "
        "expected (island)"
    ) in markdown


def test_memory_columns_compare_saved_activations_and_state_and_keep_cpu_rss_a_footnote(
    tmp_path: Path,
) -> None:
    for job, precision, activations in (("0", "fp32", 400 * MiB), ("1", "bf16", 200 * MiB)):
        summary = write_run(tmp_path / job, "tiny_cnn", precision, 1000.0, 0.8, activations)
        summary["state_bytes"] = 10 * MiB
        (tmp_path / job / "summary.json").write_text(json.dumps(summary))
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    assert (
        "0.50x the saved activations, 1.00x the weights and optimizer state of fp32"
        in report["verdicts"][0]
    )
    markdown = (tmp_path / "report.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| run"))
    assert "| memory vs fp32 |" in header
    assert "peak memory" not in header and "CUDA peak" not in header
    assert "| 0.50x act., 1.00x state |" in markdown
    assert "CPU peak resident memory of the process (not of the precision): `0` 800 MiB" in markdown


def test_peak_memory_png_stacks_saved_activations_and_state_by_precision_not_process_rss(
    tmp_path: Path,
    real_pngs,
) -> None:
    """Issue 37: the plot showed the process's resident set, which the report calls "not of the
    precision"; the precision's 0.50x of saved activations was nowhere to be seen."""
    for job, precision, seed, activations in (
        ("0", "fp32", 0, 400 * MiB),
        ("1", "fp32", 1, 400 * MiB),
        ("2", "bf16", 0, 200 * MiB),
        ("3", "bf16", 1, 200 * MiB),
    ):
        summary = write_run(tmp_path / job, "tiny_cnn", precision, 1000.0, 0.8, activations)
        summary["state_bytes"] = 10 * MiB
        summary["config"]["seed"] = seed
        (tmp_path / job / "summary.json").write_text(json.dumps(summary))
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    assert "peak_memory.png" in report["plots"]
    (ax,) = [ax for ax in plots.memory_bars(report["runs"], {}).axes if ax.get_visible()]
    # A bar per precision, not per seed: activations below, weights + state stacked on top.
    heights = [(patch.get_x(), patch.get_y(), patch.get_height()) for patch in ax.patches]
    assert sorted(heights) == sorted(
        [(-0.4, 0, 400), (0.6, 0, 200), (-0.4, 400, 10), (0.6, 200, 10)]
    )
    labels = [text.get_text() for text in ax.texts]
    assert "200.00\n0.50x" in labels and "10.00\n1.00x" in labels


def test_throughput_png_labels_the_speed_trials_figure_or_says_none_was_measured(
    tmp_path: Path,
    real_pngs,
) -> None:
    """Caught: throughput.png labelling each bar with its job's samples/s over fp32's ("4.22x"),
    a second speed answer beside the trial's."""
    for job, precision, samples in (("0", "fp32", 1000.0), ("1", "bf16", 4220.0)):
        write_run(tmp_path / job, "tiny_cnn", precision, samples, 0.8)
    rows = build_report([tmp_path], tmp_path, tolerance=0.5)["runs"]

    def labels() -> list[str]:
        (ax,) = [ax for ax in plots.throughput_bars(rows, {}).axes if ax.get_visible()]
        return [text.get_text() for text in ax.texts]

    assert labels() == ["1,000", "4,220\nspeedup not\nmeasured (no trial)"]
    bf16 = next(row for row in rows if row["label"] == "bf16")
    bf16["trial_speedup"] = {"ratio": 1.5, "ci": [1.2, 1.8], "confidence": 0.975}
    assert labels() == ["1,000", "4,220\ntrial 1.50x [1.20, 1.80]"]
