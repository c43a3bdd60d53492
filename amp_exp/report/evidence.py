"""The evidence behind each verdict, as report.json's ``cells`` and ``comparisons``: numbers and
verdict names only (report/verdicts.py and report/markdown.py word them).

A cell is a model, a setting and a precision: the jobs of a sweep that differ only in seed. Per
cell: n and the mean of the task's quality metric with its 95% CI. Per precision other than
fp32, every seed it attempted counts (``seed_account``): a seed it failed numerically is
``unstable``, one fp32 failed ``baseline_unstable``, one that was killed and never rerun
``incomplete``; over the seeds both completed, the paired difference against fp32 (seed s against
seed s) with its CI, p-values and the verdict (report/stats.py), and the training-loss gap over
the last 10% of steps (report/curves.py); and the speedup of the interleaved speed trial.
"""

from __future__ import annotations

import math
import statistics
from fractions import Fraction
from typing import Any

from amp_exp.report import curves, stats
from amp_exp.report.compare import BASELINE, tolerance_for
from amp_exp.report.failures import PRECISION_FAILURES, failure
from amp_exp.report.stats import Verdict
from amp_exp.tasks.metrics import ToleranceUnit

Row = dict[str, Any]
CellKey = tuple[str, str, str]
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
    "verdict",
    "unadjusted_verdict",
    "identical",
    "eval_examples",
    "floor",
    "min_seeds_to_match",
    "seeds_to_settle",
)
# The largest eval set whose accuracies are read as counts (eval_examples).
MAX_EVAL_EXAMPLES = 10**6
# The verdicts on the seeds themselves, highest precedence first: they override the statistics.
SEED_VERDICTS = (
    Verdict.not_engaged,
    Verdict.baseline_unstable,
    Verdict.unstable,
    Verdict.incomplete,
)


def cell_key(row: Row) -> CellKey:
    return row["model"], row["setting"], row["label"]


def group_cells(rows: list[Row]) -> dict[CellKey, list[Row]]:
    cells: dict[CellKey, list[Row]] = {}
    for row in rows:
        cells.setdefault(cell_key(row), []).append(row)
    return cells


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
        **(estimate_dict(estimate) or {"mean": None, "ci95": None}),
    }


def on_log_scale(declared: dict[str, Any] | None, values: list[float]) -> bool:
    """Whether a metric judged in relative terms (a loss, a perplexity: a ratio scale) is
    summarised on the log scale; accuracy, in points, stays linear."""
    if declared is None or not values:
        return False
    relative = ToleranceUnit(declared["tolerance_unit"]) is ToleranceUnit.relative
    return relative and all(math.isfinite(v) and v > 0 for v in values)


def metric_label(declared: dict[str, Any]) -> str:
    return next(m["label"] for m in declared["metrics"] if m["name"] == declared["quality"])


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
    confidence: float = stats.CONFIDENCE,
) -> dict[str, Any]:
    """The paired difference of the quality metric against fp32, and its verdict by the rule
    with the interval at ``confidence``; for accuracy the spread is floored at one eval example."""
    measured = [row for row in paired if row["quality_delta"] is not None]
    declared = next((row["quality_metric"] for row in measured), None)
    if declared is None:
        # Named all the same, from any declaration: which metric the runs did not record.
        named = next((r["quality_metric"]["quality"] for r in paired if r["quality_metric"]), None)
        return {"n": 0, "deltas": {}, **dict.fromkeys(QUALITY_KEYS), "metric": named}
    limit = float(tolerance_for(measured[0], tolerance))
    higher = declared["higher_is_better"]
    examples = floor = None
    if ToleranceUnit(declared["tolerance_unit"]) is ToleranceUnit.points:
        baselines = {row["run"]: row["quality"] for row in fp32_rows}
        values = [r["quality"] for r in measured] + [baselines[r["baseline"]] for r in measured]
        examples = eval_examples(values)
        floor = None if examples is None else 100 / examples
    deltas = [row["quality_delta"] for row in measured]
    difference = stats.paired_difference(deltas, limit, higher, floor or 0.0, confidence)
    verdict = stats.verdict(difference, limit, higher)
    estimate = difference.estimate
    return {
        "n": estimate.n,
        "metric": declared["quality"],
        "metric_label": metric_label(declared),
        "unit": declared["tolerance_unit"],
        "tolerance": limit,
        "delta_mean": estimate.mean,
        "delta_ci95": None if estimate.ci95 is None else list(estimate.ci95),
        # The interval's level: 95%, or an evidence sweep's stricter one per look.
        "confidence": confidence,
        "sd": estimate.sd,
        "deltas": {str(row["seed"]): row["quality_delta"] for row in measured},
        "p_equivalence": difference.p_equivalence,
        "p_worse": difference.p_worse,
        "p_better": difference.p_better,
        "p_not_worse": difference.p_not_worse,
        "verdict": verdict.value,
        "unadjusted_verdict": verdict.value,
        "identical": difference.identical,
        "eval_examples": examples,
        "floor": floor,
        "min_seeds_to_match": (
            None if floor is None else stats.min_seeds_to_match(floor, limit, confidence)
        ),
        "seeds_to_settle": (
            stats.seeds_to_settle(estimate, limit, higher, floor or 0.0, floor or 0.0, confidence)
            if verdict is Verdict.inconclusive and not difference.identical
            else None
        ),
    }


def curve_of(metrics: dict[str, list], run: str) -> curves.Curve:
    return curves.train_curve(metrics.get(run, []))


def loss_evidence(paired: list[Row], metrics: dict[str, list]) -> dict[str, Any]:
    """The loss gap against each seed's fp32 run, across seeds."""
    found = [
        curves.loss_gap(curve_of(metrics, r["run"]), curve_of(metrics, r["baseline"]))
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
    model, setting, label = key
    for trial in trials:
        if trial.get("stand_in"):
            continue
        if (trial.get("model"), trial.get("setting", "")) == (model, setting):
            found = (trial.get("speedup") or {}).get(label)
            if found is not None:
                return found
    return None


def comparison(
    key: CellKey,
    rows: list[Row],
    fp32_rows: list[Row],
    metrics: dict[str, list],
    tolerance: float | None,
    trials: list[dict[str, Any]],
    confidence: float = stats.CONFIDENCE,
) -> dict[str, Any] | None:
    """A precision against fp32 over every seed both attempted; None when fp32 attempted none
    of them."""
    paired, failed, attempted, seed_verdict = seed_account(rows, fp32_rows, metrics)
    if not attempted:
        return None
    model, setting, label = key
    job_speedups = [row["speedup"] for row in paired if row["speedup"] is not None]
    found = {
        "model": model,
        "precision": rows[0]["precision"],
        "precision_options": rows[0]["precision_options"],
        "label": label,
        "setting": setting,
        "n_attempted": attempted,
        "failed_seeds": failed,
        **quality_evidence(paired, fp32_rows, tolerance, confidence),
        **loss_evidence(paired, metrics),
        "speedup": trial_speedup(trials, key),
        "job_speedup": statistics.median(job_speedups) if job_speedups else None,
        "contended": any(row["contended"] for row in [*paired, *fp32_rows]),
    }
    found["seed_verdict"] = None if seed_verdict is None else seed_verdict.value
    if seed_verdict is not None:
        found["verdict"] = seed_verdict.value
    # The statistics of the seeds that survived hold only on the condition that they did.
    found["conditional_on_survival"] = bool(failed) and found["delta_ci95"] is not None
    matched = found["verdict"] == Verdict.matches.value
    found["failure_rate_bound"] = stats.failure_rate_bound(found["n"]) if matched else None
    return found


# The claims the rule makes, each with the key of the p-value that makes it: Holm's families,
# and the p-value shown beside a verdict (never the test of no difference).
CLAIM_P = {
    Verdict.matches.value: "p_equivalence",
    Verdict.not_worse.value: "p_not_worse",
    Verdict.worse.value: "p_worse",
    Verdict.better.value: "p_better",
}


def adjust_familywise(
    comparisons: list[dict[str, Any]], confidence: float = stats.CONFIDENCE
) -> None:
    """Holm across the report's comparisons, a family per claim (``CLAIM_P``), each at 2.5% (an
    evidence sweep's level per look at ``confidence``): every comparison the rule judged is
    tested, and a claim whose hypothesis Holm does not reject becomes ``inconclusive``. The
    intervals stay unadjusted."""
    # A comparison its seeds decided (unstable, incomplete, ...) makes no statistical claim.
    judged = [c for c in comparisons if c["p_equivalence"] is not None and not c["seed_verdict"]]
    for claim, key in CLAIM_P.items():
        rejected = stats.holm([c[key] for c in judged], (1 - confidence) / 2)
        for found, kept in zip(judged, rejected, strict=True):
            if found["verdict"] == claim and not kept:
                found["verdict"] = Verdict.inconclusive.value
                found["failure_rate_bound"] = None


def gather(
    rows: list[Row],
    metrics: dict[str, list],
    tolerance: float | None,
    trials: list[dict[str, Any]],
    familywise: bool = False,
    confidence: float = stats.CONFIDENCE,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(cells, comparisons) of the report's rows; ``metrics`` holds each run's metrics.jsonl
    rows by the row's ``run``, ``trials`` the speed trials of speed.json files; ``familywise``
    applies Holm across the comparisons; ``confidence`` is the level of the verdicts' intervals
    (an evidence sweep's per look, report/sequential.py)."""
    cells = group_cells(rows)
    summaries = [cell_summary(key, cell) for key, cell in cells.items()]
    comparisons = []
    for key, cell in cells.items():
        model, setting, label = key
        if label == BASELINE:
            continue
        fp32_rows = cells.get((model, setting, BASELINE), [])
        found = comparison(key, cell, fp32_rows, metrics, tolerance, trials, confidence)
        if found is not None:
            comparisons.append(found)
    if familywise:
        adjust_familywise(comparisons, confidence)
    return summaries, comparisons
