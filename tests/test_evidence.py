"""Seeds as replicates in the report: cells, paired differences against fp32, verdicts with their
numbers, loss-curve evidence and the speed trial's speedup, on hand-made run directories."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from amp_exp.report.assemble import build_report
from amp_exp.results.files import SPEED_JSON
from amp_exp.tasks.lm import LanguageModelTask
from test_report import rows_by_run, write_run

FP32_ACC = [0.8125, 0.7969, 0.8047]
COMPARISON_KEYS = {
    "model",
    "precision",
    "setting",
    "n",
    "metric",
    "delta_mean",
    "delta_ci95",
    "p_value",
    "verdict",
    "loss_gap_rel",
    "speedup",
}


def write_seeds(root: Path, precision: str, accuracies: list[float], first_job: int, **kw) -> None:
    for seed, accuracy in enumerate(accuracies):
        write_run(
            root / str(first_job + seed), "tiny_cnn", precision, 1000.0, accuracy, seed=seed, **kw
        )


def test_seeds_form_one_cell_paired_seed_by_seed_with_scipys_interval(tmp_path: Path) -> None:
    bf16_acc = [a + d for a, d in zip(FP32_ACC, (-0.001, 0.0, -0.0005), strict=True)]
    write_seeds(tmp_path, "fp32", FP32_ACC, 0)
    write_seeds(tmp_path, "bf16", bf16_acc, 3)
    report = build_report([tmp_path], tmp_path)
    rows = rows_by_run(report)
    assert [rows[str(job)]["baseline"] for job in (3, 4, 5)] == ["0", "1", "2"]
    assert {row["setting"] for row in rows.values()} == {""}  # the seed is no setting
    (comparison,) = report["comparisons"]
    assert comparison.keys() >= COMPARISON_KEYS
    reference = scipy_stats.ttest_rel(100 * np.array(bf16_acc), 100 * np.array(FP32_ACC))
    low, high = reference.confidence_interval(0.95)
    assert comparison["n"] == 3 and comparison["verdict"] == "matches"
    assert comparison["delta_mean"] == pytest.approx(-0.05)
    assert comparison["delta_ci95"] == pytest.approx([low, high])
    assert comparison["p_value"] == pytest.approx(reference.pvalue)
    (line,) = report["verdicts"]
    assert line.startswith(
        f"tiny_cnn: bf16 matches fp32: Δ accuracy -0.05 points, 95% CI [{low:+.2f}, "
        f"{high:+.2f}], n = 3, tolerance ±0.5 points; 1.00x fp32's speed"
    )
    fp32_cell = report["cells"][0]
    t_low, t_high = scipy_stats.t.interval(
        0.95, 2, loc=np.mean(FP32_ACC), scale=scipy_stats.sem(FP32_ACC)
    )
    assert (fp32_cell["precision"], fp32_cell["n"], fp32_cell["seeds"]) == ("fp32", 3, [0, 1, 2])
    assert fp32_cell["ci95"] == pytest.approx([t_low, t_high])
    markdown = (tmp_path / "report.md").read_text()
    assert "| run | model | precision | seed | status |" in markdown
    assert "| tiny_cnn | bf16 | 3 | eval_acc |" in markdown and "| matches |" in markdown


def test_a_precision_far_behind_is_worse_and_its_curve_leaves_the_fp32_band(
    tmp_path: Path,
) -> None:
    learning = [[2.3 - 0.1 * step + 0.01 * seed for step in range(10)] for seed in range(3)]
    for seed, losses in enumerate(learning):
        write_run(
            tmp_path / str(seed),
            "tiny_cnn",
            "fp32",
            1000.0,
            FP32_ACC[seed],
            seed=seed,
            losses=losses,
        )
        stalled = losses[:3] + [losses[2]] * 7
        write_run(
            tmp_path / str(3 + seed), "tiny_cnn", "bf16", 1000.0, 0.1, seed=seed, losses=stalled
        )
    (comparison,) = build_report([tmp_path], tmp_path)["comparisons"]
    assert comparison["verdict"] == "worse"
    assert comparison["left_band"] == {"step": 4, "side": "above"}
    # The last 10% of 10 steps: steps 9 and 10, where fp32 is at 1.5 and 1.4 (+0.01 per seed)
    # and the stalled run at 2.1.
    gaps = [np.mean([0.6 / (1.5 + 0.01 * s), 0.7 / (1.4 + 0.01 * s)]) for s in range(3)]
    assert comparison["loss_gap_rel"]["mean"] == pytest.approx(np.mean(gaps))
    assert comparison["loss_gap_abs"]["mean"] == pytest.approx(0.65)
    (line,) = build_report([tmp_path], tmp_path)["verdicts"]
    assert line.startswith("tiny_cnn: bf16 is worse than fp32: Δ accuracy -70.47 points")
    assert "left the fp32 band (above) at step 4" in line


def test_inconclusive_says_roughly_how_many_seeds_would_settle_it(tmp_path: Path) -> None:
    write_seeds(tmp_path, "fp32", FP32_ACC, 0)
    write_seeds(
        tmp_path, "bf16", [a + d for a, d in zip(FP32_ACC, (-0.001, -0.009, 0.003), strict=True)], 3
    )
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert comparison["verdict"] == "inconclusive"
    assert comparison["seeds_to_settle"] > 3
    assert f"about {comparison['seeds_to_settle']} seeds would settle it" in report["verdicts"][0]


def test_a_language_model_is_judged_on_its_relative_eval_loss_lower_being_better(
    tmp_path: Path,
) -> None:
    for job, (precision, seed, loss) in enumerate(
        [("fp32", 0, 2.00), ("fp32", 1, 2.10), ("bf16", 0, 2.10), ("bf16", 1, 2.205)]
    ):
        summary = write_run(tmp_path / str(job), "gpt_tiny", precision, 1000.0, 0.0, seed=seed)
        summary.pop("eval_acc")
        summary.update(task_metrics=LanguageModelTask.metrics.as_dict(), eval_loss=loss)
        (tmp_path / str(job) / "summary.json").write_text(json.dumps(summary))
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert (comparison["metric"], comparison["unit"]) == ("eval_loss", "relative")
    assert comparison["delta_mean"] == pytest.approx(0.05)  # 5% above fp32 on both seeds
    assert comparison["verdict"] == "worse"
    assert (
        "Δ loss +5.00%, 95% CI [+5.00%, +5.00%], n = 2, tolerance ±1.00%" in (report["verdicts"][0])
    )


def test_the_speed_trial_gives_the_speedup_beside_each_jobs_own_throughput(
    tmp_path: Path,
) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    write_run(tmp_path / "1", "tiny_cnn", "bf16", 700.0, 0.8)
    trial = {"ratio": 1.2, "ci95": [1.1, 1.3], "rounds": 10, "total_time_ratio": 1.15}
    speed = {"trials": [{"model": "tiny_cnn", "setting": "", "speedup": {"bf16": trial}}]}
    (tmp_path / SPEED_JSON).write_text(json.dumps(speed))
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert comparison["speedup"] == trial and comparison["job_speedup"] == 0.7
    assert (
        "1.20x fp32's speed (95% CI 1.10x to 1.30x, 10 AB/BA rounds; total time 1.15x)"
        in (report["verdicts"][0])
    )
    markdown = (tmp_path / "report.md").read_text()
    assert "| 1 | tiny_cnn | bf16 | completed | 700.0 | 0.70x | 1.20x [1.10, 1.30] |" in markdown


def test_a_rerun_of_one_seed_is_no_replicate_and_a_missing_pair_is_named(tmp_path: Path) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    write_run(tmp_path / "1", "tiny_cnn", "bf16", 1000.0, 0.8)
    write_run(tmp_path / "2", "tiny_cnn", "bf16", 1000.0, 0.8)
    write_run(tmp_path / "3", "tiny_cnn", "bf16", 1000.0, 0.8, seed=1)
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert (comparison["n"], comparison["verdict"]) == (1, "single_seed")
    assert (
        "bf16 (seed 1) final loss 1.5000 (no fp32 run of its seed to pair with)"
        in (report["verdicts"][0])
    )


def test_runs_that_never_evaluated_are_compared_on_speed_and_loss_alone(tmp_path: Path) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, None)
    write_run(tmp_path / "1", "tiny_cnn", "bf16", 1000.0, None)
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert (comparison["n"], comparison["verdict"], comparison["delta_mean"]) == (0, None, None)
    assert report["verdicts"][0].startswith(
        "tiny_cnn: bf16 against fp32: no eval metric to compare;"
    )
    assert "| tiny_cnn | bf16 | 0 | - | - | - | - | - |" in (tmp_path / "report.md").read_text()
