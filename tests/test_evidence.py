"""Seeds as replicates in the report: cells, every attempted seed counted, paired differences
against fp32, verdicts with their numbers, the loss gap and the speed trial's speedup, on
hand-made run directories."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from amp_exp.config.schema import ReportConfig
from amp_exp.report import stats
from amp_exp.report.__main__ import main
from amp_exp.report.assemble import build_report
from amp_exp.report.decision import Evidence, decide
from amp_exp.report.words import show_delta, show_interval
from amp_exp.results.files import SPEED_JSON
from amp_exp.tasks.lm import LanguageModelTask
from amp_exp.tasks.metrics import ToleranceUnit
from test_report import rows_by_run, write_failed_run, write_run

FP32_ACC = [0.8125, 0.7969, 0.8047]
LM_LOSSES = [4.8, 3.0, 2.2]
COMPARISON_KEYS = {
    "model",
    "precision",
    "setting",
    "n",
    "metric",
    "delta_mean",
    "delta_ci95",
    "p_equivalence",
    "verdict",
    "n_attempted",
    "failed_seeds",
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
    assert (comparison["n_attempted"], comparison["failed_seeds"]) == (3, [])
    # 0.7969 is no count over 1,024: the accuracies are counts over 10,000 (0.01 points apiece),
    # a floor below the spread seen.
    assert (comparison["eval_examples"], comparison["floor"]) == (10_000, pytest.approx(0.01))
    (line,) = report["verdicts"]
    p_equivalence = comparison["p_equivalence"]
    assert line.startswith(
        f"tiny_cnn: bf16 matches fp32: Δ accuracy -0.05 points, 95% CI [{low:+.2f}, "
        f"{high:+.2f}], n = 3, tolerance ±0.5 points, p_equivalence {p_equivalence:.2g}; failure "
        "rate below 63% (95% upper bound: 0 of 3 seeds failed); 1.00x fp32's speed"
    )
    fp32_cell = report["cells"][0]
    t_low, t_high = scipy_stats.t.interval(
        0.95, 2, loc=np.mean(FP32_ACC), scale=scipy_stats.sem(FP32_ACC)
    )
    assert (fp32_cell["precision"], fp32_cell["n"], fp32_cell["seeds"]) == ("fp32", 3, [0, 1, 2])
    assert fp32_cell["ci95"] == pytest.approx([t_low, t_high])
    markdown = (tmp_path / "report.md").read_text()
    assert "| run | model | precision | seed | result |" in markdown
    assert "| tiny_cnn | bf16 | 3 | eval_acc |" in markdown and "| matches |" in markdown


def test_a_precision_far_behind_is_worse_by_the_paired_loss_gap(
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
    assert comparison["verdict"] == "worse" and "left_band" not in comparison
    # The last 10% of 10 steps: steps 9 and 10, where fp32 is at 1.5 and 1.4 (+0.01 per seed)
    # and the stalled run at 2.1.
    gaps = [np.mean([0.6 / (1.5 + 0.01 * s), 0.7 / (1.4 + 0.01 * s)]) for s in range(3)]
    assert comparison["loss_gap_rel"]["mean"] == pytest.approx(np.mean(gaps))
    assert comparison["loss_gap_abs"]["mean"] == pytest.approx(0.65)
    (line,) = build_report([tmp_path], tmp_path)["verdicts"]
    assert line.startswith("tiny_cnn: bf16 is worse than fp32: Δ accuracy -70.47 points")
    assert "band" not in line
    # The paired gap per step is drawn beside the curves, as a picture.
    assert "loss_gap.png" in build_report([tmp_path], tmp_path)["plots"]


@pytest.mark.parametrize(
    ("offsets", "planned"),
    [
        ((-0.001, -0.005, 0.002), "about {} seeds would settle it with 80% probability"),
        ((-0.001, -0.02, 0.012), "more than 50 seeds would be needed to settle it"),
    ],
)
def test_inconclusive_gives_a_planning_estimate_of_the_seeds_that_would_settle_it(
    tmp_path: Path, offsets: tuple[float, ...], planned: str
) -> None:
    write_seeds(tmp_path, "fp32", FP32_ACC, 0)
    write_seeds(tmp_path, "bf16", [a + d for a, d in zip(FP32_ACC, offsets, strict=True)], 3)
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert comparison["verdict"] == "inconclusive"
    seeds = comparison["seeds_to_settle"]
    assert (seeds is None) == ("more than" in planned) and (seeds is None or seeds > 3)
    assert (
        f"; {planned.format(seeds)} (a simulated planning estimate, from a spread measured with "
        "2 degrees of freedom)"
    ) in report["verdicts"][0]


def write_lm_runs(root: Path, bf16_losses: tuple[float, float]) -> None:
    """Two seeds of gpt_tiny in fp32 (eval loss 2.00, 2.10) and bf16 (``bf16_losses``)."""
    for job, (precision, seed, loss) in enumerate(
        [
            ("fp32", 0, 2.00),
            ("fp32", 1, 2.10),
            ("bf16", 0, bf16_losses[0]),
            ("bf16", 1, bf16_losses[1]),
        ]
    ):
        # Runs that learned: from about ln(128) at their first log to an eval loss near 2.
        summary = write_run(
            root / str(job), "gpt_tiny", precision, 1000.0, 0.0, seed=seed, losses=LM_LOSSES
        )
        summary.pop("eval_acc")
        summary.update(task_metrics=LanguageModelTask.metrics.as_dict(), eval_loss=loss)
        (root / str(job) / "summary.json").write_text(json.dumps(summary))


def test_a_language_model_is_judged_on_its_relative_eval_loss_lower_being_better(
    tmp_path: Path,
) -> None:
    write_lm_runs(tmp_path, (2.10, 2.2155))
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert (comparison["metric"], comparison["unit"]) == ("eval_loss", "relative")
    assert comparison["delta_mean"] == pytest.approx(0.0525)  # 5% and 5.5% above fp32
    assert comparison["verdict"] == "worse" and comparison["floor"] is None
    low, high = comparison["delta_ci95"]
    assert (
        f"Δ loss +5.25%, 95% CI [{low:+.2%}, {high:+.2%}], n = 2, tolerance ±1.00%"
        in (report["verdicts"][0])
    )


@pytest.mark.parametrize(
    ("losses", "reason"),
    [
        # Bit-identical runs: the precision most likely never ran.
        ((2.0, 2.1), "identical to fp32 on every seed: check that the precision engaged"),
        ((2.1, 2.205), "every seed differed from fp32 by exactly as much, which measures no noise"),
    ],
)
def test_identical_relative_loss_deltas_give_no_interval_of_no_width_a_verdict(
    tmp_path: Path, losses: tuple[float, float], reason: str
) -> None:
    write_lm_runs(tmp_path, losses)
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert (comparison["verdict"], comparison["identical"]) == ("inconclusive", True)
    assert comparison["seeds_to_settle"] is None
    assert reason in report["verdicts"][0]


def test_identical_accuracy_deltas_are_floored_at_one_eval_example(tmp_path: Path) -> None:
    """Accuracy on 1,024 images moves in steps of 0.098 points: identical deltas are common and
    no noise estimate, so the interval is floored at one example, and at 2 seeds and a
    0.5-point tolerance matches is out of reach whatever the runs do."""
    fp32 = [801 / 1024, 790 / 1024, 803 / 1024]
    write_seeds(tmp_path / "two", "fp32", fp32[:2], 0)
    write_seeds(tmp_path / "two", "bf16", fp32[:2], 2)
    (two,) = build_report([tmp_path / "two"], tmp_path / "two")["comparisons"]
    assert two["eval_examples"] == 1024 and two["delta_ci95"][1] > two["delta_ci95"][0]
    assert (two["verdict"], two["min_seeds_to_match"]) == ("inconclusive", 3)
    (line,) = build_report([tmp_path / "two"], tmp_path / "two")["verdicts"]
    assert (
        "; with 1,024 eval examples (one is 0.10 points), 2 seeds can never give matches at "
        "±0.5 points: use a larger eval set or at least 3 seeds;"
    ) in line
    write_seeds(tmp_path / "three", "fp32", fp32, 0)
    write_seeds(tmp_path / "three", "bf16", fp32, 3)
    (three,) = build_report([tmp_path / "three"], tmp_path / "three")["comparisons"]
    half = scipy_stats.t.ppf(0.975, 2) * (100 / 1024) / np.sqrt(3)
    assert three["verdict"] == "matches"
    assert three["delta_ci95"] == pytest.approx([-half, half])


def test_the_speed_trial_gives_the_speedup_beside_each_jobs_own_throughput(
    tmp_path: Path,
) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    write_run(tmp_path / "1", "tiny_cnn", "bf16", 700.0, 0.8)
    trial = {
        "ratio": 1.2,
        "ci": [1.1, 1.3],
        "confidence": 0.975,
        "rounds": 10,
        "total_time_ratio": 1.15,
    }
    speed = {"trials": [{"model": "tiny_cnn", "setting": "", "speedup": {"bf16": trial}}]}
    (tmp_path / SPEED_JSON).write_text(json.dumps(speed))
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert comparison["speedup"] == trial
    assert comparison["job_speedup"]["ratio"] == pytest.approx(0.7)
    # One seed's throughput ratio has no interval: it can establish no speedup.
    assert comparison["job_speedup"]["ci"] is None
    assert (
        "1.20x fp32's speed (97.5% CI 1.10x to 1.30x, 10 AB/BA rounds; total time 1.15x)"
        in (report["verdicts"][0])
    )
    markdown = (tmp_path / "report.md").read_text()
    # One speedup column: the trial's; the jobs' own 0.70x stays in report.json.
    assert "| 1 | tiny_cnn | bf16 | learned | 700.0 samples/s | 1.20x [1.10, 1.30] |" in markdown
    # The evidence table gives the same interval at the same level as the verdict, not another.
    assert "trial speedup [97.5% CI] |" in markdown and "| 1.20x [1.10, 1.30] |" in markdown
    assert report["runs"][1]["speedup"] == pytest.approx(0.70) and "0.70x" not in markdown


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
    assert report["verdicts"][0].startswith("tiny_cnn: bf16 against fp32: no eval_acc to compare;")
    assert "| tiny_cnn | bf16 | 0 | - | - | - | - | - |" in (tmp_path / "report.md").read_text()


def write_three_seeds(root: Path, precision: str, first_job: int, failing: dict | None = None):
    """Seeds 0-2 of ``precision`` at fp32's accuracy plus a hair; ``failing`` replaces seed 2
    with a run that failed, given write_failed_run's arguments."""
    accuracies = [a + (0.0005 if precision != "fp32" else 0) for a in FP32_ACC]
    if failing is None:
        write_seeds(root, precision, accuracies, first_job)
    else:
        write_seeds(root, precision, accuracies[:2], first_job)
        write_failed_run(root / str(first_job + 2), "tiny_cnn", precision, seed=2, **failing)


FAULT = {
    "error": "NumericalFault: fp16 loss scaling collapsed by step 40: loss scale 0.0001 fell "
    "below precision.min_scale",
    "losses": [2.0] * 40,
}


def test_a_seed_that_failed_numerically_makes_the_precision_unstable_never_matches(
    tmp_path: Path,
) -> None:
    write_three_seeds(tmp_path, "fp32", 0)
    write_three_seeds(tmp_path, "fp16", 3, failing=FAULT)
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    # Of the two seeds that survived, fp16 matches; the seed it failed decides.
    assert (comparison["verdict"], comparison["unadjusted_verdict"]) == ("unstable", "matches")
    assert (comparison["n"], comparison["n_attempted"]) == (2, 3)
    assert comparison["failed_seeds"] == [
        {
            "seed": 2,
            "precision": "fp16",
            "run": "5",
            "status": "numerical",
            "reason": FAULT["error"],
            "step": 40,
        }
    ]
    assert comparison["conditional_on_survival"] and comparison["failure_rate_bound"] is None
    (line,) = report["verdicts"]
    assert line.startswith(
        "tiny_cnn: fp16 is unstable (seed 2: fp16 failed numerically at step 40 (NumericalFault: "
    )
    assert (
        "of 3 seeds attempted): over the seeds that survived, conditional on their survival" in line
    )
    assert "matches" not in line
    markdown = (tmp_path / "report.md").read_text()
    assert "| tiny_cnn | fp16 | 2 of 3 attempted | eval_acc |" in markdown
    assert "| unstable |" in markdown


def test_a_seed_fp32_failed_too_is_the_baselines_failure(tmp_path: Path) -> None:
    write_three_seeds(tmp_path, "fp32", 0, failing=FAULT)
    write_three_seeds(tmp_path, "fp16", 3, failing=FAULT)
    (comparison,) = build_report([tmp_path], tmp_path)["comparisons"]
    assert comparison["verdict"] == "baseline_unstable"
    # Both failures are listed; the verdict is fp32's.
    assert [(f["seed"], f["precision"]) for f in comparison["failed_seeds"]] == [
        (2, "fp32"),
        (2, "fp16"),
    ]


def test_a_non_finite_loss_is_unstable_at_the_step_it_diverged(tmp_path: Path) -> None:
    write_three_seeds(tmp_path, "fp32", 0)
    write_seeds(tmp_path, "fp16", FP32_ACC[:2], 3)
    nan, inf = float("nan"), float("inf")
    write_run(tmp_path / "5", "tiny_cnn", "fp16", 1000.0, 0.1, seed=2, final_loss=nan)
    # Step 1's inf gradient norm (a skipped fp16 step) is no divergence; step 2's loss is.
    rows = [
        {"kind": "train", "step": 1, "loss": 2.0, "grad_norm": inf},
        {"kind": "train", "step": 2, "loss": nan, "grad_norm": inf},
        {"kind": "eval", "step": 3, "eval_loss": nan},
    ]
    (tmp_path / "5" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (comparison,) = build_report([tmp_path], tmp_path)["comparisons"]
    assert comparison["verdict"] == "unstable"
    (failed,) = comparison["failed_seeds"]
    assert (failed["status"], failed["step"], failed["seed"]) == ("diverged", 2, 2)


def test_a_killed_seed_is_incomplete_until_a_rerun_of_it_completes(tmp_path: Path) -> None:
    write_three_seeds(tmp_path, "fp32", 0)
    killed = {"error": None, "status": "killed"}
    write_three_seeds(tmp_path, "bf16", 3, failing=killed)
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert (comparison["verdict"], comparison["n"]) == ("incomplete", 2)
    assert [f["status"] for f in comparison["failed_seeds"]] == ["killed"]
    assert "rerun the seed: its completed rerun is paired" in report["verdicts"][0]
    write_run(tmp_path / "9", "tiny_cnn", "bf16", 1000.0, FP32_ACC[2] + 0.0005, seed=2)
    (rerun,) = build_report([tmp_path], tmp_path)["comparisons"]
    assert (rerun["verdict"], rerun["n"], rerun["failed_seeds"]) == ("matches", 3, [])
    assert rerun["deltas"]["2"] == pytest.approx(0.05)


def planted(ci: tuple[float, float], p_equivalence: float, p_worse: float = 0.5) -> Evidence:
    """A comparison whose interval gives the rule's claim and whose p-values are planted."""
    estimate = stats.Estimate(3, sum(ci) / 2, ci, 0.1, 0.1)
    difference = stats.PairedDifference(estimate, p_equivalence, p_worse, 0.9, p_equivalence)
    return Evidence(difference, (0.0, 0.1, 0.2), 0.5, True, None)


def test_holm_across_comparisons_turns_claims_that_fail_their_threshold_inconclusive() -> None:
    inside, below = (-0.1, 0.1), (-2.0, -1.0)
    family = [planted(inside, 0.001), planted(inside, 0.01), planted(inside, 0.02)]
    family.append(planted(below, 0.9, p_worse=0.02))
    found = decide(family)
    # 0.001 <= 0.025 / 4; then 0.01 > 0.025 / 3 stops the matches family (at twice the level,
    # 0.01 <= 0.05 / 3 and 0.02 <= 0.05 / 2 would pass). The worse family has one claim of p 0.02
    # among four p-values, the next smallest 0.5: 0.02 > 0.025 / 4.
    assert [d.verdict.value for d in found] == ["matches", *["inconclusive"] * 3]
    assert [d.unadjusted.value for d in found] == [*["matches"] * 3, "worse"]
    assert found[1].withheld == "familywise"
    # Holm is on by default; none leaves each claim at its own level, and says so.
    assert ReportConfig().familywise == "holm"
    assert [d.verdict.value for d in decide(family, "none")] == [*["matches"] * 3, "worse"]


def test_holm_reads_each_p_value_in_units_of_its_looks_level() -> None:
    """An evidence sweep's look at a stricter level: its p-value 0.004 is above that look's
    0.0034, so alone (a family of one) it claims nothing, and neither may it under Holm."""
    found = planted((-0.1, 0.1), 0.004)
    strict = Evidence(found.difference, found.deltas, 0.5, True, None, alpha=0.0034)
    assert decide([strict])[0].verdict.value == "inconclusive"


def test_familywise_none_is_named_in_the_words_and_holm_by_default(tmp_path: Path) -> None:
    write_three_seeds(tmp_path, "fp32", 0)
    write_three_seeds(tmp_path, "bf16", 3)
    report = build_report([tmp_path], tmp_path)
    assert report["familywise"] == "holm" and report["comparisons"][0]["verdict"] == "matches"
    assert "The intervals shown are unadjusted." in (tmp_path / "report.md").read_text()
    build_report([tmp_path], tmp_path, familywise="none")
    assert "`report.familywise=none`" in (tmp_path / "report.md").read_text()
    assert main([str(tmp_path), "--familywise", "none"]) == 0
    assert json.loads((tmp_path / "report.json").read_text())["familywise"] == "none"


def test_options_that_train_nothing_never_split_a_cell(tmp_path: Path) -> None:
    """fp32 timed in a speed trial and logged to W&B still pairs with bf16_true that was not."""
    for job, precision, extra in [
        ("0", "fp32", {"report": {"speed_trial": True}, "wandb": {"mode": "online"}}),
        ("1", "bf16_true", {"report": {"speed_trial": False}, "wandb": {"mode": "disabled"}}),
    ]:
        summary = write_run(tmp_path / job, "tiny_cnn", precision, 1000.0, 0.8)
        summary["config"] |= extra | {"checkpoint": {"every_steps": int(job)}}
        summary["config"]["trainer"] = {"log_every": 10 + int(job), "max_steps": 3}
        summary["config"]["precision"]["options"] = {"stochastic_rounding": False}
        (tmp_path / job / "summary.json").write_text(json.dumps(summary))
    report = build_report([tmp_path], tmp_path)
    assert rows_by_run(report)["1"]["baseline"] == "0"
    (comparison,) = report["comparisons"]
    assert comparison["setting"] == ""
    # report.json names the precision as a user passes it back, the label apart.
    assert (comparison["precision"], comparison["precision_options"], comparison["label"]) == (
        "bf16_true",
        {"options": {"stochastic_rounding": False}},
        "bf16_true (nearest)",
    )
    summary = json.loads((tmp_path / "1" / "summary.json").read_text())
    summary["config"]["trainer"]["max_steps"] = 4  # what is trained: a setting of its own
    (tmp_path / "1" / "summary.json").write_text(json.dumps(summary))
    assert rows_by_run(build_report([tmp_path], tmp_path))["1"]["baseline"] is None


def write_lm_cell(
    root: Path, precision: str, eval_losses: list[float], first_job: int, **updates
) -> None:
    """gpt_tiny runs of ``precision``, seed s with eval loss ``eval_losses[s]``, first logging a
    loss of 4.8 (about ln 128), on tokens whose loss_floor is 1.05; ``updates`` go into each
    summary.json."""
    for seed, loss in enumerate(eval_losses):
        path = root / str(first_job + seed)
        summary = write_run(path, "gpt_tiny", precision, 1000.0, 0.0, seed=seed, losses=LM_LOSSES)
        summary.pop("eval_acc")
        summary.update(
            task_metrics=LanguageModelTask.metrics.as_dict(),
            eval_loss=loss,
            loss_floor=1.05,
            **updates,
        )
        (path / "summary.json").write_text(json.dumps(summary))


def write_trial(root: Path, **speedups: tuple[float, float, float]) -> None:
    """A speed trial of gpt_tiny: each precision's (ratio, low, high) against fp32."""
    found = {
        label: {
            "ratio": r,
            "ci": [low, high],
            "confidence": 0.975,
            "rounds": 10,
            "total_time_ratio": r,
        }
        for label, (r, low, high) in speedups.items()
    }
    trial = {"model": "gpt_tiny", "setting": "", "speedup": found}
    (root / SPEED_JSON).write_text(json.dumps({"trials": [trial]}))


def test_an_fp32_run_that_never_left_its_plateau_is_named_and_the_fix_is_the_training_not_seeds(
    tmp_path: Path,
) -> None:
    """Issue 37: SGD at lr 0.1 left fp32's seed 2 at 3.60 against a floor of 1.05, bf16 got
    -49% there, and the report asked for 16 more seeds."""
    write_lm_cell(tmp_path, "fp32", [1.10, 1.12, 3.60], 0)
    write_lm_cell(tmp_path, "bf16", [1.1002, 1.1190, 1.82], 3)
    report = build_report([tmp_path], tmp_path)
    fp32 = [row for row in report["runs"] if row["label"] == "fp32"]
    assert [row["learned"] for row in fp32] == [True, True, False]
    assert "3.43x its loss_floor 1.05" in fp32[2]["learned_reason"]
    (comparison,) = report["comparisons"]
    assert comparison["baseline_not_learned"] == [2]
    (line,) = report["verdicts"]
    assert "fp32 did not learn on seed 2, so its difference measures optimization luck" in line
    assert "lower optimizer.lr, use optimizer=adamw, or raise trainer.max_steps" in line
    assert "seeds would settle it" not in line
    assert json.loads((tmp_path / "report.json").read_text())["runs"][2]["learned"] is False
    assert "| 2 | gpt_tiny | fp32 | 2 | DID NOT LEARN |" in (tmp_path / "report.md").read_text()


def test_a_sweep_at_a_learning_rate_where_nothing_learns_names_every_run(tmp_path: Path) -> None:
    # Eval losses at 90% of the first logged loss: they fell, but not well below it.
    write_lm_cell(tmp_path, "fp32", [4.30, 4.35], 0)
    write_lm_cell(tmp_path, "bf16", [4.31, 4.34], 2)
    write_failed_run(tmp_path / "4", "gpt_tiny", "fp16", "RuntimeError: boom")
    report = build_report([tmp_path], tmp_path)
    learned = {row["run"]: row["learned"] for row in report["runs"]}
    assert learned == {"0": False, "1": False, "2": False, "3": False, "4": None}
    assert "fell by less than 20%" in report["runs"][0]["learned_reason"]
    (recommendation,) = report["recommendations"]
    assert recommendation["precision"] is None
    assert recommendation["reason"].startswith("bf16: fp32 did not learn on some seeds; lower")


def test_losses_are_summarised_on_a_log_scale_so_no_interval_is_negative(tmp_path: Path) -> None:
    write_lm_cell(tmp_path, "fp32", [1.0, 4.0], 0)
    (cell,) = build_report([tmp_path], tmp_path)["cells"]
    assert cell["scale"] == "log"
    assert cell["mean"] == pytest.approx(2.0)  # the geometric mean; arithmetic would be 2.5
    # The arithmetic t interval of 1 and 4 on one degree of freedom is [-16.6, 21.6].
    low, high = cell["ci95"]
    assert 0 < low < 1.0 and high > 4.0


def test_both_lower_precisions_qualify_and_loss_scaling_breaks_a_tie_of_speed(
    tmp_path: Path,
) -> None:
    write_lm_cell(tmp_path, "fp32", [1.10, 1.12, 1.11], 0)
    write_lm_cell(tmp_path, "bf16", [1.1001, 1.1199, 1.1102], 3)
    write_lm_cell(tmp_path, "fp16", [1.1002, 1.1198, 1.1101], 6, skipped_steps=3)
    # fp16 measured faster, but within the interval of bf16's speed.
    write_trial(tmp_path, bf16=(1.30, 1.20, 1.40), fp16=(1.35, 1.25, 1.45))
    report = build_report([tmp_path], tmp_path)
    assert {c["label"]: c["verdict"] for c in report["comparisons"]} == {
        "bf16": "matches",
        "fp16": "matches",
    }
    (recommendation,) = report["recommendations"]
    assert recommendation["precision"] == "bf16"
    assert "fp16 qualifies too; bf16 is as fast" in recommendation["reason"]
    assert "fp16 needs loss scaling, fp16 skipped 9 steps" in recommendation["reason"]
    evidence = {item["precision"]: item for item in recommendation["evidence"]}
    assert evidence["fp16"]["loss_scaling"] and not evidence["bf16"]["loss_scaling"]
    lines = (tmp_path / "report.md").read_text().splitlines()
    assert lines[2] == "## Recommendation"
    assert lines[4].startswith("- **gpt_tiny: use bf16.** bf16 matches fp32 at 1.30x")
    assert "python -m amp_exp.predict" in lines[6]

    # Told apart, the faster one wins whatever it costs.
    write_trial(tmp_path, bf16=(1.30, 1.20, 1.40), fp16=(2.00, 1.90, 2.10))
    (recommendation,) = build_report([tmp_path], tmp_path)["recommendations"]
    assert recommendation["precision"] == "fp16"
    assert "bf16 qualifies too; fp16 is faster (2.00x" in recommendation["reason"]


def test_fp32_is_recommended_when_no_lower_precision_is_faster(tmp_path: Path) -> None:
    write_lm_cell(tmp_path, "fp32", [1.10, 1.12, 1.11], 0)
    write_lm_cell(tmp_path, "bf16", [1.1001, 1.1199, 1.1102], 3)
    write_trial(tmp_path, bf16=(0.70, 0.65, 0.75))
    (recommendation,) = build_report([tmp_path], tmp_path)["recommendations"]
    assert recommendation["precision"] == "fp32"
    assert recommendation["reason"] == (
        "no interval shows a lower precision faster (bf16 0.70x fp32's speed (speed trial, 97.5% "
        "CI 0.65x to 0.75x))"
    )
    assert "- **gpt_tiny: fp32 on this device.**" in (tmp_path / "report.md").read_text()


def test_a_faster_precision_with_an_open_verdict_leaves_it_not_decided(tmp_path: Path) -> None:
    write_lm_cell(tmp_path, "fp32", [1.10, 1.12, 1.11], 0)
    write_lm_cell(tmp_path, "bf16", [1.105, 1.128, 1.112], 3)  # +0.45%, +0.71%, +0.18%
    write_trial(tmp_path, bf16=(1.30, 1.20, 1.40))
    report = build_report([tmp_path], tmp_path)
    assert report["comparisons"][0]["verdict"] == "inconclusive"
    (recommendation,) = report["recommendations"]
    assert recommendation["precision"] is None
    assert recommendation["reason"].startswith("bf16: inconclusive, about ")
    assert "- **gpt_tiny: not decided yet.** bf16: inconclusive" in (
        (tmp_path / "report.md").read_text()
    )


def test_a_narrow_interval_gets_the_decimals_that_show_its_width() -> None:
    """fp16 against fp32 on gpt_tiny (lm_precision_evidence, measured): a paired difference of
    -0.0003% in [-0.0016%, +0.0010%] printed at two decimals read [-0.00%, +0.00%], an interval
    of no width, which no spread gives; the ordinary one keeps two."""
    relative, points = ToleranceUnit.relative, ToleranceUnit.points
    narrow = [-1.5825643820158774e-05, 1.0429234613373404e-05]
    assert show_interval(narrow, relative) == "[-0.002%, +0.001%]"
    assert show_delta(-2.698e-06, relative, narrow) == "-0.000%"
    assert show_interval([0.0051, 0.0087], relative) == "[+0.51%, +0.87%]"
    assert show_delta(0.0069, relative, [0.0051, 0.0087]) == "+0.69%"
    assert show_interval([0.1001, 0.1004], points) == "[+0.1001, +0.1004]"
    # A bound just below zero is not shown as zero (bf16 on lm_precision_sweep, measured).
    assert show_interval([-9.8e-05, -2.1e-06], relative) == "[-0.0098%, -0.0002%]"
    assert show_interval([0.0, 0.0051], relative) == "[+0.00%, +0.51%]"
