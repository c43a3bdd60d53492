"""The evidence behind each verdict, as report.json's ``cells`` and ``comparisons``.

A cell is a model, a setting and a precision: the jobs of a sweep that differ only in seed. Per
cell: n and the mean of the task's quality metric with its 95% CI. Per precision other than
fp32: the paired difference against fp32 (seed s against seed s) with its CI, p-values and the
verdict (report/stats.py), the training-loss gap over the last 10% of steps and where the mean
curve left fp32's seed band (report/curves.py), and the speedup of the interleaved speed trial.
"""

from __future__ import annotations

import statistics
from typing import Any

from amp_exp.report import curves, stats
from amp_exp.report.compare import BASELINE, tolerance_for

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
    "p_value",
    "p_equivalence",
    "verdict",
    "seeds_to_settle",
)


def cell_key(row: Row) -> CellKey:
    return row["model"], row["setting"], row["precision"]


def group_cells(rows: list[Row]) -> dict[CellKey, list[Row]]:
    cells: dict[CellKey, list[Row]] = {}
    for row in rows:
        cells.setdefault(cell_key(row), []).append(row)
    return cells


def estimate_dict(estimate: stats.Estimate | None) -> dict[str, Any] | None:
    if estimate is None:
        return None
    return {"mean": estimate.mean, "ci95": None if estimate.ci95 is None else list(estimate.ci95)}


def cell_summary(key: CellKey, rows: list[Row]) -> dict[str, Any]:
    """n, and the mean of the quality metric with its 95% CI, over the cell's completed seeds."""
    measured = [r for r in rows if r["status"] == "completed" and r["quality"] is not None]
    declared = next((r["quality_metric"] for r in measured), None)
    estimate = stats.mean_interval([r["quality"] for r in measured]) if measured else None
    model, setting, precision = key
    return {
        "model": model,
        "setting": setting,
        "precision": precision,
        "n": len(measured),
        "seeds": [r["seed"] for r in measured],
        "metric": None if declared is None else declared["quality"],
        **(estimate_dict(estimate) or {"mean": None, "ci95": None}),
    }


def metric_label(declared: dict[str, Any]) -> str:
    return next(m["label"] for m in declared["metrics"] if m["name"] == declared["quality"])


def quality_evidence(paired: list[Row], tolerance: float | None) -> dict[str, Any]:
    """The paired difference of the quality metric against fp32, and its verdict."""
    measured = [row for row in paired if row["quality_delta"] is not None]
    declared = next((row["quality_metric"] for row in measured), None)
    if declared is None:
        return {"n": 0, "deltas": {}, **dict.fromkeys(QUALITY_KEYS)}
    limit = float(tolerance_for(measured[0], tolerance))
    difference = stats.paired_difference([row["quality_delta"] for row in measured], limit)
    verdict = stats.verdict(difference, limit, declared["higher_is_better"])
    estimate = difference.estimate
    return {
        "n": estimate.n,
        "metric": declared["quality"],
        "metric_label": metric_label(declared),
        "unit": declared["tolerance_unit"],
        "tolerance": limit,
        "delta_mean": estimate.mean,
        "delta_ci95": None if estimate.ci95 is None else list(estimate.ci95),
        "deltas": {str(row["seed"]): row["quality_delta"] for row in measured},
        "p_value": difference.p_value,
        "p_equivalence": difference.p_equivalence,
        "verdict": verdict.value,
        "seeds_to_settle": (
            stats.seeds_to_settle(estimate, limit)
            if verdict is stats.Verdict.inconclusive
            else None
        ),
    }


def curve_of(metrics: dict[str, list], run: str) -> curves.Curve:
    return curves.train_curve(metrics.get(run, []))


def loss_evidence(
    paired: list[Row], completed: list[Row], fp32_runs: list[Row], metrics: dict[str, list]
) -> dict[str, Any]:
    """The loss gap against each seed's fp32 run, across seeds; where the mean curve of the
    precision's seeds left the band of fp32's."""
    found = [
        curves.loss_gap(curve_of(metrics, r["run"]), curve_of(metrics, r["baseline"]))
        for r in paired
    ]
    gaps = [gap for gap in found if gap is not None]
    fp32_band = curves.band([curve_of(metrics, row["run"]) for row in fp32_runs])
    left = None
    if fp32_band and len(completed) > 1:
        mean = curves.mean_curve([curve_of(metrics, row["run"]) for row in completed])
        left = curves.left_band_at(mean, fp32_band)
    return {
        "loss_gap_rel": estimate_dict(stats.mean_interval([g[0] for g in gaps]) if gaps else None),
        "loss_gap_abs": estimate_dict(stats.mean_interval([g[1] for g in gaps]) if gaps else None),
        "left_band": None if left is None else {"step": left[0], "side": left[1]},
    }


def trial_speedup(trials: list[dict[str, Any]], key: CellKey) -> dict[str, Any] | None:
    """The speed trial's speedup of a cell's precision against fp32, from speed.json; a
    single-process stand-in for a torchrun job's speed is no evidence of it."""
    model, setting, precision = key
    for trial in trials:
        if trial.get("stand_in"):
            continue
        if (trial.get("model"), trial.get("setting", "")) == (model, setting):
            found = (trial.get("speedup") or {}).get(precision)
            if found is not None:
                return found
    return None


def comparison(
    key: CellKey,
    rows: list[Row],
    fp32_runs: list[Row],
    metrics: dict[str, list],
    tolerance: float | None,
    trials: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """A precision against fp32 over the seeds both completed; None without such a pair."""
    completed = [row for row in rows if row["status"] == "completed"]
    # A seed is one replicate however many of its runs were handed in: a rerun of it measures
    # no seed-to-seed noise, so the first run of each seed stands for it.
    by_seed: dict[Any, Row] = {}
    for row in completed:
        if row["baseline"] is not None:
            by_seed.setdefault(row["seed"], row)
    paired = list(by_seed.values())
    if not paired:
        return None
    model, setting, precision = key
    job_speedups = [row["speedup"] for row in paired if row["speedup"] is not None]
    return {
        "model": model,
        "precision": precision,
        "setting": setting,
        **quality_evidence(paired, tolerance),
        **loss_evidence(paired, completed, fp32_runs, metrics),
        "speedup": trial_speedup(trials, key),
        "job_speedup": statistics.median(job_speedups) if job_speedups else None,
    }


def gather(
    rows: list[Row],
    metrics: dict[str, list],
    tolerance: float | None,
    trials: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(cells, comparisons) of the report's rows; ``metrics`` holds each run's metrics.jsonl
    rows by the row's ``run``, ``trials`` the speed trials of speed.json files."""
    cells = group_cells(rows)
    summaries = [cell_summary(key, cell) for key, cell in cells.items()]
    comparisons = []
    for key, cell in cells.items():
        model, setting, precision = key
        if precision == BASELINE:
            continue
        fp32_runs = [
            row for row in cells.get((model, setting, BASELINE), []) if row["status"] == "completed"
        ]
        found = comparison(key, cell, fp32_runs, metrics, tolerance, trials)
        if found is not None:
            comparisons.append(found)
    return summaries, comparisons
