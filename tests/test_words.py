"""Words that agree with numbers: a run whose loss diverged (finite or not), that skipped a large
share of its steps, or whose checks never ran (no diagnostics recorded) is never "checks passed",
and a diverged fp32 seed is no baseline; an accuracy's interval ends where a share can; an
interrupted sweep says how to resume."""

from __future__ import annotations

import json
from pathlib import Path

from amp_exp.report.assemble import build_report
from amp_exp.report.compare import DIVERGED_GROWTH, SKIPPED_SHARE
from test_report import write_failed_run, write_run

FP32_ACC = [0.8125, 0.7969, 0.8047]


def health(tmp_path: Path, run: str) -> str:
    text = (tmp_path / "report.md").read_text()
    return next(line for line in text.splitlines() if line.startswith(f"- `{run}`"))


def test_a_finite_but_exploded_loss_is_diverged_never_checks_passed(tmp_path: Path) -> None:
    """fp32 at a loss of 4e10 (the review): finite, so the old rule called it checks passed and
    paired bf16 against it."""
    for seed, accuracy in enumerate(FP32_ACC):
        loss = 4e10 if seed == 2 else 1.5
        write_run(
            tmp_path / str(seed), "tiny_cnn", "fp32", 1000.0, accuracy, seed=seed, final_loss=loss
        )
        write_run(tmp_path / str(3 + seed), "tiny_cnn", "bf16", 1000.0, accuracy, seed=seed)
    report = build_report([tmp_path], tmp_path)
    assert DIVERGED_GROWTH * 2.0 < 4e10
    assert "checks FAILED: diverged: the loss rose from 2 to 4e+10" in health(tmp_path, "2")
    assert health(tmp_path, "0").endswith(
        "(tiny_cnn fp32): checks passed; matmul FLOPs: float32 100%"
    )
    (comparison,) = report["comparisons"]
    assert comparison["verdict"] == "baseline_unstable"


def test_a_run_that_skipped_a_large_share_of_its_steps_is_not_checks_passed(
    tmp_path: Path,
) -> None:
    write_run(tmp_path / "a", "tiny_cnn", "fp32", 1000.0, 0.8)
    # Its metrics.jsonl logs all 100 steps: a shorter one would be listed as damaged instead.
    losses = [2.0 / step for step in range(1, 101)]
    summary = write_run(
        tmp_path / "b", "tiny_cnn", "fp16", 1000.0, 0.8, skipped_steps=37, losses=losses
    )
    summary["steps"] = 100
    (tmp_path / "b" / "summary.json").write_text(json.dumps(summary))
    build_report([tmp_path], tmp_path)
    assert SKIPPED_SHARE < 0.37
    assert "checks FAILED: skipped 37% of its steps" in health(tmp_path, "b")


def test_a_summary_without_diagnostics_is_not_checked_never_checks_passed(
    tmp_path: Path,
) -> None:
    """Runs recorded by the HF and Lightning integrations carry no ``checks``: nothing checked
    them, so calling them "checks passed" claims what nobody saw. A run of the engine with
    diagnostics.checks=false records checks that never ran, which is no pass either."""
    summaries = {"a": write_run(tmp_path / "a", "tiny_cnn", "fp32", 1000.0, 0.8)}
    summaries["b"] = write_run(tmp_path / "b", "tiny_cnn", "bf16", 1000.0, 0.8)
    summaries["c"] = write_run(tmp_path / "c", "tiny_cnn", "bf16", 1000.0, 0.8, seed=1)
    del summaries["a"]["checks"]
    summaries["b"]["checks"] = {}
    summaries["c"]["config"]["diagnostics"] = {"checks": False}
    for run, summary in summaries.items():
        (tmp_path / run / "summary.json").write_text(json.dumps(summary))
    report = build_report([tmp_path], tmp_path)
    assert "checks passed" not in (tmp_path / "report.md").read_text()
    assert "(tiny_cnn fp32): not checked (no diagnostics recorded); " in health(tmp_path, "a")
    assert "(tiny_cnn bf16): not checked (no diagnostics recorded); " in health(tmp_path, "b")
    assert "): not checked (diagnostics.checks=false); " in health(tmp_path, "c")
    unchecked = {row["run"]: row["health"]["unchecked"] for row in report["runs"]}
    assert unchecked == {
        "a": "no diagnostics recorded",
        "b": "no diagnostics recorded",
        "c": "diagnostics.checks=false",
    }


def test_a_diverged_run_without_diagnostics_fails_and_says_its_checks_did_not_run(
    tmp_path: Path,
) -> None:
    """The report's own checks (a diverged loss) still fail a run that recorded no diagnostics;
    the line says which checks did not run rather than implying they passed."""
    write_run(tmp_path / "a", "tiny_cnn", "fp32", 1000.0, 0.8)
    summary = write_run(tmp_path / "b", "tiny_cnn", "bf16", 1000.0, 0.8, final_loss=4e10)
    del summary["checks"]
    (tmp_path / "b" / "summary.json").write_text(json.dumps(summary))
    build_report([tmp_path], tmp_path)
    line = health(tmp_path, "b")
    assert "checks FAILED: diverged: the loss rose from 2 to 4e+10; " in line
    assert "AMP checks not run (no diagnostics recorded)" in line


def test_an_accuracy_interval_is_clipped_to_what_a_share_can_take(tmp_path: Path) -> None:
    for seed, accuracy in enumerate([0.99, 0.999, 1.0]):
        write_run(tmp_path / str(seed), "tiny_cnn", "fp32", 1000.0, accuracy, seed=seed)
    (cell,) = build_report([tmp_path], tmp_path)["cells"]
    low, high = cell["ci95"]
    # The t interval of 0.99, 0.999, 1.0 reaches 1.01: above every accuracy there is.
    assert low > 0.9 and high == 1.0


def test_an_interrupted_sweep_says_how_to_resume(tmp_path: Path) -> None:
    for seed, accuracy in enumerate(FP32_ACC):
        write_run(tmp_path / str(seed), "tiny_cnn", "fp32", 1000.0, accuracy, seed=seed)
    write_run(tmp_path / "3", "tiny_cnn", "bf16", 1000.0, FP32_ACC[0], seed=0)
    write_failed_run(tmp_path / "4", "tiny_cnn", "bf16", None, status="killed", seed=1)
    (recommendation,) = build_report([tmp_path], tmp_path)["recommendations"]
    assert (
        "resume it with the same command, its hydra.sweep.dir and resume=auto"
        in (recommendation["reason"])
    )
