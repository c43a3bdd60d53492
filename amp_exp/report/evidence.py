"""The evidence behind each verdict, as report.json's ``cells`` and ``comparisons``: numbers and
verdict names only (report/words.py and report/markdown.py word them).

A cell is a model, a setting and a precision: the jobs of a sweep that differ only in seed. Per
cell: n and the mean of the task's quality metric with its 95% CI. Per precision other than
fp32, every seed it attempted counts (``seed_account``): a seed it failed numerically is
``unstable``, one fp32 failed ``baseline_unstable``, one that was killed and never rerun
``incomplete``; over the seeds both completed, the paired difference against fp32 (seed s against
seed s) with its CI, p-values and the verdict (report/stats.py), and the training-loss gap over
the last 10% of steps (report/stats.py); and the speedup of the interleaved speed trial.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from amp_exp.report import decision, stats
from amp_exp.report.compare import (
    BASELINE,
    PRECISION_FAILURES,
    CellKey,
    Row,
    failure,
    group_cells,
    quality_entry,
    tolerance_for,
)
from amp_exp.report.stats import Verdict
from amp_exp.tasks.metrics import ToleranceUnit

# What a comparison says about the quality metric (null where no run measured it).
QUALITY_KEYS = (
    "metric",
    "metric_label",
    "unit",
    "tolerance",
    "delta_mean",
    "delta_ci95",
    "confidence",
    "sd",
    "p_equivalence",
    "p_worse",
    "p_better",
    "p_not_worse",
    "higher_is_better",
    "identical",
    "eval_examples",
    "floor",
    "min_seeds_to_match",
)
# How a speedup without a speed trial is labelled wherever it is shown.
JOB_SPEEDUP_SOURCE = "paired per-seed throughput ratios"
# The largest eval set whose accuracies are read as counts (eval_examples).
MAX_EVAL_EXAMPLES = 10**6
# The verdicts on the seeds themselves, highest precedence first: they override the statistics.
SEED_VERDICTS = (
    Verdict.not_engaged,
    Verdict.baseline_unstable,
    Verdict.unstable,
    Verdict.incomplete,
)


def estimate_dict(estimate: stats.Estimate | None) -> dict[str, Any] | None:
    if estimate is None:
        return None
    return {"mean": estimate.mean, "ci95": None if estimate.ci95 is None else list(estimate.ci95)}


def seed_account(
    rows: list[Row], fp32_rows: list[Row], metrics: dict[str, list]
) -> tuple[list[Row], list[dict[str, Any]], int, Verdict | None]:
    """Every seed the precision attempted against fp32's attempts of it: (the paired runs, the
    failed seeds, the seeds both attempted, the seed verdict that overrides the statistics).

    A seed one of whose attempts failed numerically (or ran out of memory, or ended non-finite)
    is a finding, whatever a rerun did; a seed killed or stopped from outside is missing data
    until a rerun of it completes, and then the completed run is paired, never the failed one.
    A seed that fp32 never attempted is no pair (the verdict lines name it)."""
    paired: list[Row] = []
    failed: list[dict[str, Any]] = []
    kinds: set[Verdict] = set()
    attempted = 0
    for seed in dict.fromkeys(row["seed"] for row in rows):
        mine = [row for row in rows if row["seed"] == seed]
        theirs = [row for row in fp32_rows if row["seed"] == seed]
        if not theirs:
            continue
        attempted += 1
        if any(row["status"] == "completed" and row["engaged"] is False for row in mine):
            kinds.add(Verdict.not_engaged)
        found = {id(row): failure(row, metrics) for row in [*mine, *theirs]}
        own = [r for r in mine if (found[id(r)] or {}).get("status") in PRECISION_FAILURES]
        base = [r for r in theirs if (found[id(r)] or {}).get("status") in PRECISION_FAILURES]
        usable = [r for r in mine if found[id(r)] is None and r["engaged"] is not False]
        base_usable = [r for r in theirs if found[id(r)] is None and r["engaged"] is not False]
        if base or own:
            kinds.add(Verdict.baseline_unstable if base else Verdict.unstable)
            listed = [(row, BASELINE) for row in base] + [(row, row["label"]) for row in own]
        elif usable and base_usable:
            by_run = {row["run"]: row for row in base_usable}
            # A rerun of a seed measures no seed-to-seed noise: its first completed run stands
            # for it, paired with the fp32 run of its seed (compare.find_baseline).
            pair = next((row for row in usable if row["baseline"] in by_run), None)
            if pair is not None:
                paired.append(pair)
                continue
            kinds.add(Verdict.incomplete)  # no usable fp32 run was found to pair with
            listed = []
        else:
            kinds.add(Verdict.incomplete)
            listed = [(row, row["label"]) for row in [*theirs, *mine] if found[id(row)]]
        failed += [
            {"seed": seed, "precision": who, "run": row["run"], **found[id(row)]}
            for row, who in listed
        ]
    seed_verdict = next((kind for kind in SEED_VERDICTS if kind in kinds), None)
    return paired, failed, attempted, seed_verdict


def cell_summary(key: CellKey, rows: list[Row]) -> dict[str, Any]:
    """n, and the mean of the quality metric with its 95% CI, over the cell's completed seeds."""
    measured = [r for r in rows if r["status"] == "completed" and r["quality"] is not None]
    declared = next((r["quality_metric"] for r in measured), None)
    values = [r["quality"] for r in measured]
    log_scale = on_log_scale(declared, values)
    estimate = None
    if measured:
        estimate = (stats.geometric_interval if log_scale else stats.mean_interval)(values)
    model, setting, label = key
    summary = estimate_dict(estimate) or {"mean": None, "ci95": None}
    if summary["ci95"] is not None and is_fraction(declared):
        # An accuracy is a share of the eval set: its interval ends where the share can.
        summary["ci95"] = [max(0.0, summary["ci95"][0]), min(1.0, summary["ci95"][1])]
    return {
        "model": model,
        "setting": setting,
        "precision": rows[0]["precision"],
        "precision_options": rows[0]["precision_options"],
        "label": label,
        "n": len(measured),
        "seeds": [r["seed"] for r in measured],
        "metric": None if declared is None else declared["quality"],
        # A loss or perplexity is summarised as a geometric mean: its interval stays positive.
        "scale": "log" if log_scale else "linear",
        **summary,
    }


def is_fraction(declared: dict[str, Any] | None) -> bool:
    """Whether the quality metric is a share in [0, 1] (judged in points: an accuracy)."""
    return declared is not None and declared["tolerance_unit"] == ToleranceUnit.points.value


def on_log_scale(declared: dict[str, Any] | None, values: list[float]) -> bool:
    """Whether a metric judged in relative terms (a loss, a perplexity: a ratio scale) is
    summarised on the log scale; accuracy, in points, stays linear."""
    if declared is None or not values:
        return False
    relative = ToleranceUnit(declared["tolerance_unit"]) is ToleranceUnit.relative
    return relative and all(math.isfinite(v) and v > 0 for v in values)


def eval_examples(accuracies: list[float]) -> int | None:
    """The eval set's size, as far as the accuracies show it: each is a count over N, so N is
    the least common multiple of their denominators (a divisor of the true N when every count
    shares a factor with it, which floors the interval higher, never lower). None for values
    that are no counts over at most ``MAX_EVAL_EXAMPLES``."""
    denominators = [
        Fraction(a).limit_denominator(MAX_EVAL_EXAMPLES).denominator for a in accuracies
    ]
    size = math.lcm(*denominators)
    close = all(abs(a * size - round(a * size)) < 1e-6 for a in accuracies)
    return size if close and size <= MAX_EVAL_EXAMPLES else None


def quality_evidence(
    paired: list[Row],
    fp32_rows: list[Row],
    tolerance: float | None,
    alpha: Callable[[int, str], float],
) -> tuple[dict[str, Any], stats.PairedDifference | None]:
    """The paired difference of the quality metric against fp32 with its interval at the level
    ``alpha(n, unit)`` of its look (one-sided; an interval at 1 - 2 alpha), and the statistics
    the decision reads (report/decision.py); for accuracy the spread is floored at one eval
    example."""
    measured = [row for row in paired if row["quality_delta"] is not None]
    declared = next((row["quality_metric"] for row in measured), None)
    if declared is None:
        # Named all the same, from any declaration: which metric the runs did not record.
        named = next((r["quality_metric"]["quality"] for r in paired if r["quality_metric"]), None)
        return {"n": 0, "deltas": {}, **dict.fromkeys(QUALITY_KEYS), "metric": named}, None
    limit = float(tolerance_for(measured[0], tolerance))
    higher = declared["higher_is_better"]
    examples = floor = None
    if ToleranceUnit(declared["tolerance_unit"]) is ToleranceUnit.points:
        baselines = {row["run"]: row["quality"] for row in fp32_rows}
        values = [r["quality"] for r in measured] + [baselines[r["baseline"]] for r in measured]
        examples = eval_examples(values)
        floor = None if examples is None else 100 / examples
    deltas = [row["quality_delta"] for row in measured]
    confidence = 1 - 2 * alpha(len(deltas), declared["tolerance_unit"])
    difference = stats.paired_difference(deltas, limit, higher, floor or 0.0, confidence)
    estimate = difference.estimate
    return {
        "n": estimate.n,
        "metric": declared["quality"],
        "metric_label": quality_entry(declared)["label"],
        "unit": declared["tolerance_unit"],
        "tolerance": limit,
        "higher_is_better": higher,
        "delta_mean": estimate.mean,
        "delta_ci95": None if estimate.ci95 is None else list(estimate.ci95),
        # The interval's level: 95%, or an evidence sweep's stricter one at its look.
        "confidence": confidence,
        "sd": estimate.sd,
        "deltas": {str(row["seed"]): row["quality_delta"] for row in measured},
        "p_equivalence": difference.p_equivalence,
        "p_worse": difference.p_worse,
        "p_better": difference.p_better,
        "p_not_worse": difference.p_not_worse,
        "identical": difference.identical,
        "eval_examples": examples,
        "floor": floor,
        "min_seeds_to_match": (
            None if floor is None else stats.min_seeds_to_match(floor, limit, confidence)
        ),
    }, difference


def curve_of(metrics: dict[str, list], run: str) -> stats.Curve:
    return stats.train_curve(metrics.get(run, []))


def loss_evidence(paired: list[Row], metrics: dict[str, list]) -> dict[str, Any]:
    """The loss gap against each seed's fp32 run, across seeds."""
    found = [
        stats.loss_gap(curve_of(metrics, r["run"]), curve_of(metrics, r["baseline"]))
        for r in paired
    ]
    gaps = [gap for gap in found if gap is not None]
    return {
        "loss_gap_rel": estimate_dict(stats.mean_interval([g[0] for g in gaps]) if gaps else None),
        "loss_gap_abs": estimate_dict(stats.mean_interval([g[1] for g in gaps]) if gaps else None),
    }


def trial_speedup(trials: list[dict[str, Any]], key: CellKey) -> dict[str, Any] | None:
    """The speed trial's speedup of a cell's precision against fp32, from speed.json; a
    single-process stand-in for a torchrun job's speed is no evidence of it."""
    timed = [trial for trial in of_setting(trials, key) if not trial.get("stand_in")]
    found = ((trial.get("speedup") or {}).get(key[2]) for trial in timed)
    return next((speedup for speedup in found if speedup is not None), None)


def of_setting(entries: list[dict[str, Any]], key: CellKey) -> list[dict[str, Any]]:
    """The entries of speed.json or predicted.json made for the model and setting of ``key``."""
    return [entry for entry in entries if (entry.get("model"), entry.get("setting", "")) == key[:2]]


def job_speedup(paired: list[Row]) -> dict[str, Any] | None:
    """For runs no speed trial timed: the geometric mean of the paired per-seed throughput ratios
    (each seed's run against its fp32 run) and its 95% interval, labelled as such; no interval
    from one seed."""
    ratios = [row["speedup"] for row in paired if row["speedup"] is not None and row["speedup"] > 0]
    if not ratios:
        return None
    found = stats.geometric_interval(ratios)
    return {
        "ratio": found.mean,
        "ci": None if found.ci95 is None else list(found.ci95),
        "confidence": stats.CONFIDENCE,
        "n": found.n,
        "source": JOB_SPEEDUP_SOURCE,
    }


def comparison(
    key: CellKey,
    rows: list[Row],
    fp32_rows: list[Row],
    metrics: dict[str, list],
    tolerance: float | None,
    trials: list[dict[str, Any]],
    alpha: Callable[[int, str], float],
) -> tuple[dict[str, Any], decision.Evidence] | None:
    """A precision against fp32 over every seed both attempted, and what its verdict is decided
    from; None when fp32 attempted none of them."""
    paired, failed, attempted, seed_verdict = seed_account(rows, fp32_rows, metrics)
    if not attempted:
        return None
    model, setting, label = key
    quality, difference = quality_evidence(paired, fp32_rows, tolerance, alpha)
    found = {
        "model": model,
        "precision": rows[0]["precision"],
        "precision_options": rows[0]["precision_options"],
        "label": label,
        "setting": setting,
        "n_attempted": attempted,
        "failed_seeds": failed,
        **quality,
        **loss_evidence(paired, metrics),
        "speedup": trial_speedup(trials, key),
        "job_speedup": job_speedup(paired),
        "contended": any(row["contended"] for row in [*paired, *fp32_rows]),
        "seed_verdict": None if seed_verdict is None else seed_verdict.value,
    }
    # The statistics of the seeds that survived hold only on the condition that they did.
    found["conditional_on_survival"] = bool(failed) and found["delta_ci95"] is not None
    evidence = decision.Evidence(
        difference,
        tuple(found["deltas"].values()),
        found["tolerance"],
        bool(found.get("higher_is_better")),
        seed_verdict,
        alpha(found["n"], found["unit"]) if found["unit"] else stats.ONE_SIDED,
    )
    return found, evidence


def store(found: dict[str, Any], decided: decision.Decision) -> None:
    """The decision's verdict into its comparison (the one place a comparison gets one), and
    what follows from it: the failure-rate bound beside ``matches``, the seeds to plan for an
    open verdict."""
    verdict = decided.verdict
    found["verdict"] = None if verdict is None else verdict.value
    found["unadjusted_verdict"] = None if decided.unadjusted is None else decided.unadjusted.value
    found["withheld"] = decided.withheld
    matched = verdict is Verdict.matches
    found["failure_rate_bound"] = stats.failure_rate_bound(found["n"]) if matched else None
    found["seeds_to_settle"] = None
    if verdict is Verdict.inconclusive and found["sd"] is not None and not found["identical"]:
        estimate = stats.Estimate(found["n"], found["delta_mean"], None, found["sd"])
        floor = found["floor"] or 0.0
        higher = found["higher_is_better"]
        found["seeds_to_settle"] = stats.seeds_to_settle(
            estimate, found["tolerance"], higher, floor, floor, found["confidence"]
        )


def fixed_level(n: int, unit: str) -> float:
    """A report over a fixed sweep: every claim at 2.5% per side."""
    return stats.ONE_SIDED


def gather(
    rows: list[Row],
    metrics: dict[str, list],
    tolerance: float | None,
    trials: list[dict[str, Any]],
    familywise: str = decision.DEFAULT_FAMILYWISE,
    alpha: Callable[[int, str], float] = fixed_level,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(cells, comparisons) of the report's rows; ``metrics`` holds each run's metrics.jsonl
    rows by the row's ``run``, ``trials`` the speed trials of speed.json files; ``familywise``
    is the family rule (report/decision.py); ``alpha(n, unit)`` the one-sided level of a claim
    on n seeds (an evidence sweep's at its look, report/sequential.py)."""
    cells = group_cells(rows)
    summaries = [cell_summary(key, cell) for key, cell in cells.items()]
    found = []
    for key, cell in cells.items():
        model, setting, label = key
        if label == BASELINE:
            continue
        fp32_rows = cells.get((model, setting, BASELINE), [])
        compared = comparison(key, cell, fp32_rows, metrics, tolerance, trials, alpha)
        if compared is not None:
            found.append(compared)
    decisions = decision.decide([evidence for _, evidence in found], familywise)
    for (comparison_found, _), decided in zip(found, decisions, strict=True):
        store(comparison_found, decided)
    return summaries, [comparison_found for comparison_found, _ in found]
