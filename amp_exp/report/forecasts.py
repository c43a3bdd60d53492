"""The long-run forecast per precision in the report: whether each precision's runs are forecast to
stay within their limits for ``report.forecast_steps`` steps (amp_exp/forecast/ fits and
extrapolates each run's signals; this module groups its results and says them).

A verdict of ``matches`` at 300 steps says nothing of step 3,000; this section says whether the
signals that precede late failures (a block's activations nearing its format's range, attention
logits nearing softmax saturation, an fp16 loss scale falling to its floor) are forecast to cross
a limit before then, on which seed, and when.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from amp_exp.config.schema import PrecisionConfig
from amp_exp.forecast.forecast import forecast_run
from amp_exp.forecast.markdown import crossing_sentence, percent, where
from amp_exp.forecast.plots import plot_forecast
from amp_exp.report.compare import precision_knobs, variant_label
from amp_exp.report.runs import Run
from amp_exp.report.words import md_text

# The planned length, as a multiple of each run's, where report.forecast_steps is null.
DEFAULT_STRETCH = 10
# What the report keeps of a run's forecast: not the per-signal fits (forecast.json has those).
KEPT = (
    "observed_steps",
    "planned_steps",
    "first_crossing",
    "likeliest_crossing",
    "unforecastable",
)


def _min_scale(run: Run) -> float:
    # report/runs.py left out a config or precision section that is no object.
    value = precision_knobs(run.summary).get("min_scale")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return float(value) if ok else PrecisionConfig.min_scale


def run_forecast(run: Run, steps: int | None) -> dict[str, Any] | None:
    """The run's forecast to ``steps`` (None: ten times its own), or None where it logged no
    train rows or none beyond the planned length."""
    logged = [row["step"] for row in run.metrics if row["kind"] == "train"]
    if not logged:
        return None
    planned = DEFAULT_STRETCH * max(logged) if steps is None else steps
    if planned <= max(logged):
        return None
    return forecast_run(run.metrics, planned, _min_scale(run))


def long_run_forecasts(runs: list[Run], out_dir: Path, steps: int | None) -> list[dict[str, Any]]:
    """Per model, setting and precision: each completed run's first forecast crossing (or
    none), without the per-signal fits (forecast.json beside a run has those)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        if not run.completed:
            continue
        forecast = run_forecast(run, steps)
        if forecast is None:
            continue
        groups[(run.model, run.setting, variant_label(run.summary))].append(
            {
                "run": os.path.relpath(run.path, out_dir),
                **{key: forecast[key] for key in KEPT},
                "min_scale": _min_scale(run),
                "sentence": crossing_sentence(forecast),
            }
        )
    return [
        {"model": model, "setting": setting, "label": label, "runs": found}
        for (model, setting, label), found in sorted(groups.items())
    ]


def plot_forecasts(
    forecasts: list[dict[str, Any]], metrics: dict[str, list[dict[str, Any]]], out_dir: Path
) -> None:
    """Each precision's plots, a PNG per signal with its forecast band, of one of its runs: the
    one forecast to cross a limit first, else the first; named in the group (``plots``). After
    the report's table is on disk: a plot that fails costs nothing else (forecast/plots.py)."""
    for index, group in enumerate(forecasts):
        shown = min(group["runs"], key=lambda r: _crossing_step(r["first_crossing"]))
        forecast = forecast_run(metrics[shown["run"]], shown["planned_steps"], shown["min_scale"])
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{group['model']}_{group['label']}")
        drawn = plot_forecast(forecast, out_dir, f"forecast_{index}_{name}")
        group["plots"] = {"run": shown["run"], "files": [path.name for path in drawn]}


def _crossing_step(crossing: dict[str, Any] | None) -> float:
    return float("inf") if crossing is None else crossing["step"]


def _likeliest(runs: list[dict[str, Any]]) -> str:
    """Where no crossing is named: the highest chance of one by the planned end over the runs
    (a silence is no promise where a signal's reads scatter near its limit)."""
    chances = [(r["likeliest_crossing"], r["run"]) for r in runs if r["likeliest_crossing"]]
    if not chances:
        return ""
    likeliest, run = max(chances, key=lambda c: c[0]["chance"]["value"])
    return (
        f"; the highest chance of one by then: {percent(likeliest['chance']['value'])} "
        f"({md_text(where(likeliest))} on {md_text(run)})"
    )


def forecast_section(forecasts: list[dict[str, Any]]) -> list[str]:
    """report.md's lines: one per precision, then each run's sentence."""
    if not forecasts:
        return []
    lines = ["## Long-run forecast", ""]
    for group in forecasts:
        runs = group["runs"]
        crossing = [r for r in runs if r["first_crossing"] is not None]
        planned = sorted({r["planned_steps"] for r in runs})
        subject = f"{group['model']}{' ' + group['setting'] if group['setting'] else ''}"
        verdict = (
            f"a limit is forecast to be crossed on {len(crossing)} of {len(runs)} run(s)"
            if crossing
            else f"no limit is forecast to be crossed on any of its {len(runs)} run(s)"
            + _likeliest(runs)
        )
        lengths = ", ".join(f"{p:,}" for p in planned)
        who = f"{md_text(subject)}, {md_text(group['label'])}"
        lines.append(f"- **{who}** to {lengths} steps: {verdict}.")
        lines += [f"  - {md_text(r['run'])}: {md_text(r['sentence'])}" for r in runs]
        plots = group.get("plots") or {"files": []}
        if plots["files"]:
            lines.append(f"  - each signal of {md_text(plots['run'])} with its forecast band:")
            lines += [f"    ![{Path(name).stem}]({name})" for name in plots["files"]]
    lines += [
        "",
        "Each run's signals (per-block activation range and kurtosis, attention and output "
        "logits, update ratios, gradient norm, loss scale) fitted and extrapolated to the planned "
        "length, taken as the run's own schedule stretched (docs/forecast.md). "
        "`python -m amp_exp.forecast RUN_DIR` writes a run's fits and plots.",
        "",
    ]
    return lines
