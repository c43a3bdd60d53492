"""The evidence sweeper: seeds added only where a verdict is open, Bonferroni over the planned
looks. The error rates of its stopping rule at the tolerance boundary on each side and across
spreads (simulated with the report's own vectorised rule, stats.simulate), its power against the
fixed 3-seed design, its plan on resume, and a real sweep whose decided cell stops early."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from amp_exp.errors import ConfigError
from amp_exp.report import sequential
from amp_exp.report.stats import CODE, Verdict, simulate
from amp_exp.report.sweep_design import evidence_sweep_section
from amp_exp.results.files import EVIDENCE_JSON
from helpers.runs import FAST, TINY, run_cli
from hydra_plugins._amp_exp_evidence import EvidenceSweeper

REPETITIONS = 20_000
TOLERANCE = 1.0
DECIDED = [CODE[Verdict.matches], CODE[Verdict.better], CODE[Verdict.worse]]
# A relative loss (lower is better, no floor), min 2 and max 5 seeds: L = 4 looks at 98.75%.
PLAN = sequential.Plan.of(2, 5)


def adaptive(
    deltas: np.ndarray, plan: sequential.Plan, confidence: float, first: int | None = None, **rule
) -> tuple[np.ndarray, np.ndarray]:
    """Each simulated cell's final verdict code and seeds used: judged at every n from its first
    look to max_seeds, frozen at the first decided verdict (the sweeper's next_seeds)."""
    codes = np.full(len(deltas), CODE[Verdict.inconclusive])
    seeds = np.full(len(deltas), plan.max_seeds)
    open_ = np.ones(len(deltas), dtype=bool)
    for n in range(first or plan.min_seeds, plan.max_seeds + 1):
        found = simulate(deltas[:, :n], TOLERANCE, False, confidence=confidence, **rule)
        last = n == plan.max_seeds
        here = open_ & (np.isin(found, DECIDED) | last)
        codes[here], seeds[here] = found[here], n
        open_ &= ~here
    return codes, seeds


def cells(mean: float, sd: float, n: int = PLAN.max_seeds) -> np.ndarray:
    return np.random.default_rng(0).normal(mean, sd, size=(REPETITIONS, n))


@pytest.mark.parametrize("sd", [0.1, 0.3, 1.0, 3.0])
def test_at_the_worse_boundary_a_false_safe_claim_or_worse_stays_below_2_5_percent(sd) -> None:
    """The true difference is exactly the tolerance (lower is better, so +1 is the worse
    edge): claiming matches or not_worse says it is inside, claiming worse says beyond; each is
    false here, on one side each, and each must stay below 2.5% over the looks."""
    codes, _ = adaptive(cells(TOLERANCE, sd), PLAN, PLAN.confidence)
    safe = np.isin(codes, [CODE[Verdict.matches], CODE[Verdict.not_worse]]).mean()
    worse = (codes == CODE[Verdict.worse]).mean()
    assert safe <= 0.025 and worse <= 0.025, (sd, safe, worse)


@pytest.mark.parametrize("sd", [0.1, 0.3, 1.0, 3.0])
def test_at_the_better_boundary_false_matches_or_better_stays_below_2_5_percent(sd) -> None:
    codes, _ = adaptive(cells(-TOLERANCE, sd), PLAN, PLAN.confidence)
    matches = (codes == CODE[Verdict.matches]).mean()
    better = (codes == CODE[Verdict.better]).mean()
    assert matches <= 0.025 and better <= 0.025, (sd, matches, better)


def test_plain_95_percent_intervals_at_every_look_would_claim_too_often() -> None:
    """The design the review rejected, through the same simulation: it must exceed 2.5% (the
    review: 6.7% per side), or the tests above could not tell a bad rule from a good one."""
    worst = 0.0
    for sd in (0.1, 0.3, 1.0, 3.0):
        codes, _ = adaptive(cells(TOLERANCE, sd), PLAN, 0.95)
        worst = max(worst, np.isin(codes, [CODE[Verdict.matches], CODE[Verdict.not_worse]]).mean())
    assert worst > 0.04, worst


def test_accuracy_cells_look_first_at_3_seeds_and_keep_their_error_rate() -> None:
    """Counts over 1,000 eval examples (0.1 points each), floored at one example, at the worse
    boundary of a 0.5-point tolerance (higher is better: -0.5 is the worse edge)."""
    plan, quantum = sequential.Plan.of(3, 6), 0.1
    deltas = quantum * np.round(cells(-0.5, 0.4, 6) / quantum)
    codes = np.full(REPETITIONS, CODE[Verdict.inconclusive])
    open_ = np.ones(REPETITIONS, dtype=bool)
    for n in range(sequential.ACCURACY_FIRST_LOOK, plan.max_seeds + 1):
        found = simulate(deltas[:, :n], 0.5, True, quantum, plan.confidence)
        here = open_ & (np.isin(found, DECIDED) | (n == plan.max_seeds))
        codes[here] = found[here]
        open_ &= ~here
    safe = np.isin(codes, [CODE[Verdict.matches], CODE[Verdict.not_worse]]).mean()
    assert safe <= 0.025, safe


def test_it_decides_at_least_as_often_as_a_fixed_3_seed_design_and_says_what_it_spent() -> None:
    """Averaged over true differences of 0 (matches is right), +-3 tolerances (worse, better)
    and spreads of 0.2 to 1.5 tolerances: the share of right verdicts, and the mean seeds."""
    right = {0.0: CODE[Verdict.matches], 3.0: CODE[Verdict.worse], -3.0: CODE[Verdict.better]}
    adaptive_share, fixed_share, seeds_used = [], [], []
    for mean, verdict in right.items():
        for sd in (0.2, 0.5, 1.0, 1.5):
            deltas = cells(mean, sd)
            codes, seeds = adaptive(deltas, PLAN, PLAN.confidence)
            fixed = simulate(deltas[:, :3], TOLERANCE, False)
            adaptive_share.append((codes == verdict).mean())
            fixed_share.append((fixed == verdict).mean())
            seeds_used.append(seeds.mean())
    assert np.mean(adaptive_share) >= np.mean(fixed_share), (adaptive_share, fixed_share)
    assert 2 <= np.mean(seeds_used) < PLAN.max_seeds


def test_the_level_is_bonferroni_over_the_planned_looks() -> None:
    assert PLAN.looks == 4 and PLAN.confidence == pytest.approx(0.9875)
    assert sequential.Plan.of(3, 3).confidence == pytest.approx(0.95)  # one look: the 95% rule


def test_a_resumed_sweep_keeps_its_looks_and_may_not_raise_max_seeds(tmp_path: Path) -> None:
    sequential.record(tmp_path, sequential.Plan(2, 5, 4), {"comparisons": [], "runs": []}, [])
    with pytest.raises(ConfigError, match=r"evidence.max_seeds=6: this sweep was planned"):
        sequential.start(tmp_path, 2, 6)
    lowered = sequential.start(tmp_path, 2, 4)
    assert lowered.max_seeds == 4 and lowered.looks == 4  # the level of the looks paid for
    assert sequential.start(tmp_path / "new", 2, 4).looks == 3


def comparison(label: str, verdict: str, n: int, unit: str = "relative") -> dict:
    return {
        "model": "m",
        "setting": "",
        "label": label,
        "verdict": verdict,
        "n_attempted": n,
        "unit": unit,
    }


def test_only_open_cells_get_their_next_seed_with_their_fp32_pair() -> None:
    runs = [
        {"run": f"{label}{s}", "model": "m", "setting": "", "label": label, "seed": s}
        for label in ("fp32", "bf16", "fp16", "bf16_true")
        for s in (0, 1)
    ]
    report = {
        "runs": runs,
        "comparisons": [
            comparison("bf16", "matches", 2),
            comparison("fp16", "inconclusive", 2),
            comparison("bf16_true", "not_worse", 2),
        ],
    }
    cell_of_run = {row["run"]: (f"precision={row['label']}",) for row in runs}
    wanted = sequential.next_seeds(report, cell_of_run, PLAN)
    assert wanted == {("precision=fp16",): 2, ("precision=bf16_true",): 2, ("precision=fp32",): 2}
    # An accuracy cell is not judged at 2 seeds; nothing goes past max_seeds.
    accuracy = comparison("bf16", "worse", 2, unit="points")
    assert sequential.still_open(accuracy, PLAN)
    assert not sequential.still_open(comparison("bf16", "inconclusive", 5), PLAN)


@pytest.mark.slow
def test_a_sweep_freezes_a_decided_cell_and_reports_seeds_and_level(tmp_path: Path) -> None:
    """tiny_cnn on 4 steps, judged by accuracy at report.tolerance=50 points: bf16 cannot be
    judged at 2 seeds (an accuracy cell's first look is at 3) and matches at 3, so the sweep
    must stop there, below max_seeds=4, and its report name the seeds, the rule and the level
    (L = 4 - 2 + 1 = 3 looks planned)."""
    run_cli(
        "-m",
        "hydra/sweeper=evidence",
        "precision=fp32,bf16",
        "evidence.max_seeds=4",
        "report.tolerance=50",
        "report.speed_trial=false",
        *FAST,
        *TINY,
        f"hydra.sweep.dir={tmp_path}",
        timeout=600,
    )
    plan = json.loads((tmp_path / EVIDENCE_JSON).read_text())
    assert plan["seeds"] == {"tiny_cnn||fp32": 3, "tiny_cnn||bf16": 3} and plan["jobs"] == 6
    looks = [look["tiny_cnn||bf16"] for look in plan["looks"]]
    assert [(look["n"], look["verdict"], look["open"]) for look in looks] == [
        (2, "inconclusive", True),
        (3, "matches", False),
    ]
    report = json.loads((tmp_path / "report.json").read_text())
    (found,) = report["comparisons"]
    assert found["verdict"] == "matches" and found["confidence"] == pytest.approx(1 - 0.05 / 3)
    markdown = (tmp_path / "report.md").read_text()
    assert "L = 3 looks planned, each interval at 98.33%" in markdown
    assert "| tiny_cnn bf16 | 3 | n=2 inconclusive, n=3 matches |" in markdown
    assert "98.33% CI" in " ".join(report["verdicts"])


def test_a_frozen_cell_shows_the_look_that_decided_it_once() -> None:
    """bf16 decided at the first look and stayed frozen at 2 seeds while bf16_true (nearest) took
    a third (the lr 0.01 gpt_tiny sweep): listing bf16's second look would read as a second
    judgement on new evidence."""
    bf16, nearest = "gpt_tiny||bf16", "gpt_tiny||bf16_true (nearest)"
    sweep = {
        "plan": {"min_seeds": 2, "max_seeds": 5, "looks": 4},
        "rule": "Bonferroni over the planned looks",
        "confidence": 0.9875,
        "looks": [
            {
                bf16: {"n": 2, "verdict": "matches", "open": False},
                nearest: {"n": 2, "verdict": "inconclusive", "open": True},
            },
            {
                bf16: {"n": 2, "verdict": "matches", "open": False},
                nearest: {"n": 3, "verdict": "worse", "open": False},
            },
        ],
        "seeds": {"gpt_tiny||fp32": 3, bf16: 2, nearest: 3},
        "jobs": 8,
        "fixed_jobs": 9,
        "steps": 1600,
        "steps_per_job": 200,
    }
    lines = evidence_sweep_section(sweep)
    assert "| gpt_tiny bf16 | 2 | n=2 matches |" in lines
    assert "| gpt_tiny bf16_true (nearest) | 3 | n=2 inconclusive, n=3 worse |" in lines
    assert "| gpt_tiny fp32 | 3 | - |" in lines
    # Under report.familywise, Holm may reopen a decided cell when the others' p-values move:
    # the looks after it are new judgements, and stay.
    sweep["looks"].append({bf16: {"n": 3, "verdict": "matches", "open": False}})
    sweep["looks"][1][bf16] = {"n": 2, "verdict": "inconclusive", "open": True}
    sweep["seeds"][bf16] = 3
    lines = evidence_sweep_section(sweep)
    assert "| gpt_tiny bf16 | 3 | n=2 matches, n=2 inconclusive, n=3 matches |" in lines


def test_a_presets_seeds_give_way_and_seeds_on_the_command_line_are_refused() -> None:
    """experiment=precision_evidence fixes seed 0,1,2 in its sweeper params: under this sweeper
    they give way (else every cell would be a seed list, or the preset could not be used); a
    seed=0,1 the user typed contradicts the sweeper, as does a sweep without fp32."""
    sweeper = EvidenceSweeper(params={"precision": "fp32,bf16", "seed": "0,1,2"})
    sweeper.hydra_context = SimpleNamespace(config_loader=None)
    assert sweeper.cells(["model=gpt_tiny"]) == [
        ("precision=fp32", "model=gpt_tiny"),
        ("precision=bf16", "model=gpt_tiny"),
    ]
    with pytest.raises(ConfigError, match=r"^seed=0,1: the evidence sweeper chooses the seeds"):
        sweeper.cells(["seed=0,1"])
    with pytest.raises(ConfigError, match="the evidence sweeper chooses the seeds"):
        sweeper.cells(["++seed=3"])
    sweeper.params = {"precision": "bf16"}
    with pytest.raises(ConfigError, match="compares each precision with fp32"):
        sweeper.cells([])
