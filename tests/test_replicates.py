"""Replicated sweeps end to end: seeds as replicates, verdicts from their spread, and the speed
trial at the end of a sweep that leaves the jobs' results as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from amp_exp.report import stats
from amp_exp.report.assemble import build_report
from amp_exp.results.files import SPEED_JSON, SPEED_MD
from amp_exp.speed.sweep import time_sweep
from helpers.rule import rule_verdict
from helpers.runs import FAST, TINY_MLP

# The reports' plots are drawn, not rasterized: no test here looks at a PNG.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("pngs_not_rasterized")]

# A short trial: enough rounds for a 95% interval of the median, two steps each (the default
# trial, up to 20 rounds of 5 steps after 100 warm-up steps a side, of bf16 convolutions that take
# a tenth of a second a CPU step, was most of this file's time).
SHORT_TRIAL = [
    "speed.rounds=6",
    "speed.max_rounds=6",
    "speed.steps=2",
    "speed.max_warmup_steps=10",
]


def sweep(command_main, *args: str) -> None:
    """``python -m amp_exp -m ARGS`` through its entry point in this process: what is checked
    is the report of the jobs, not a process's exit."""
    result = command_main("amp_exp", "-m", *args)
    assert result.returncode == 0, result.stderr[-3000:]


def test_three_seeds_of_bf16_are_judged_by_the_rule_on_the_jobs_own_accuracies(
    tmp_path: Path, command_main
) -> None:
    sweep(
        command_main,
        *FAST,
        # An MLP: bf16 convolutions cost this CPU far more a step, in the jobs and the trial.
        *TINY_MLP,
        # Accuracy in steps of 0.2 points, finer than the 0.5-point tolerance.
        "dataset.eval_size=512",
        "precision=fp32,bf16",
        "seed=0,1,2",
        "report.speed_trial=false",
        *SHORT_TRIAL,
        f"hydra.sweep.dir={tmp_path}",
    )
    report = json.loads((tmp_path / "report.json").read_text())
    (comparison,) = report["comparisons"]
    assert (comparison["precision"], comparison["n"]) == ("bf16", 3)
    # The jobs' own summaries, paired seed by seed: counts over 512 images, so the interval's
    # spread is floored at one image, 100 / 512 points.
    summaries = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/summary.json"))]
    accuracy = {(s["precision"], s["seed"]): s["eval_acc"] for s in summaries}
    deltas = [100 * (accuracy["bf16", seed] - accuracy["fp32", seed]) for seed in (0, 1, 2)]
    assert comparison["deltas"] == {str(seed): pytest.approx(d) for seed, d in enumerate(deltas)}
    assert comparison["eval_examples"] == 512
    difference = stats.paired_difference(deltas, 0.5, True, floor=100 / 512)
    assert comparison["verdict"] == rule_verdict(difference, 0.5, True).value
    assert (
        comparison["delta_ci95"][1] - comparison["delta_ci95"][0]
        >= 2 * stats.half_width(100 / 512, 3) - 1e-9
    )
    assert comparison["speedup"] is None and not (tmp_path / SPEED_JSON).exists()
    assert [cell["seeds"] for cell in report["cells"]] == [[0, 1, 2], [0, 1, 2]]
    # The trial afterwards, as the sweep's end would run it: the jobs' files stay as they were.
    jobs = {p: p.read_bytes() for p in tmp_path.glob("*/*") if p.is_file()}
    assert time_sweep(tmp_path) == tmp_path / SPEED_JSON
    assert {p: p.read_bytes() for p in tmp_path.glob("*/*") if p.is_file()} == jobs
    (trial,) = json.loads((tmp_path / SPEED_JSON).read_text())["trials"]
    assert (trial["model"], trial["setting"], list(trial["speedup"])) == ("mlp", "", ["bf16"])
    assert "| bf16 |" in (tmp_path / SPEED_MD).read_text()
    (timed,) = build_report([tmp_path], tmp_path)["comparisons"]
    # The report takes the trial's figure for its cell, and the timing changes no verdict.
    assert timed["speedup"] == trial["speedup"]["bf16"]
    assert timed["verdict"] == comparison["verdict"]


def test_a_mode_that_stalls_training_is_worse_than_fp32(tmp_path: Path, command_main) -> None:
    # At a small learning rate most updates are below half a bf16 step: rounded to nearest, they
    # are lost, and the weights stall while fp32's learn.
    sweep(
        command_main,
        *FAST,
        "model=mlp",
        "dataset.image_size=8",
        "dataset.batch_size=16",
        "dataset.noise_std=0.5",
        "optimizer.lr=0.003",
        "trainer.max_steps=40",
        "diagnostics.underflow_every=10",
        "precision=fp32,bf16_true_nearest",
        "seed=0,1,2",
        "report.speed_trial=false",
        f"hydra.sweep.dir={tmp_path}",
    )
    report = json.loads((tmp_path / "report.json").read_text())
    (comparison,) = report["comparisons"]
    assert (comparison["precision"], comparison["n"]) == ("bf16_true", 3)
    assert comparison["label"] == "bf16_true (nearest)"
    assert comparison["precision_options"] == {"options": {"stochastic_rounding": False}}
    assert comparison["verdict"] == "worse"
    assert comparison["delta_ci95"][1] < -comparison["tolerance"]
    (line,) = report["verdicts"]
    assert line.startswith("mlp: bf16_true (nearest) is worse than fp32: Δ accuracy -")
    assert "updates round away in bf16" in line
