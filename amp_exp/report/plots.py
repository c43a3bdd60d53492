"""The report's figures, drawn on matplotlib's Agg canvas: no display and no pyplot state.

Every plot takes the report's table rows and the metrics.jsonl rows of each run (keyed by the
row's ``run``) and returns a Figure, or None when it has nothing to show. It is imported only
where a picture is drawn (report/assemble.py, the sensitivity report), so nothing else pays for
importing matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from amp_exp.report import stats
from amp_exp.report.compare import BASELINE, cell_key, group_cells
from amp_exp.report.decision import trial_interval
from amp_exp.report.evidence import curve_of
from amp_exp.report.runs import report_plugin
from amp_exp.report.words import speedup_cell, trial_levels

Rows = list[dict[str, Any]]
Metrics = dict[str, list[dict[str, Any]]]

OTHER_COLOR = "#8c8c8c"
PANEL_COLUMNS = 3


def precision_color(precision: str) -> str:
    # A variant ("fp8 (rowwise)", "bf16_true (nearest)") takes its mode's colour (its facts').
    plugin = report_plugin(precision.split(" ")[0])
    return OTHER_COLOR if plugin is None else plugin.spec.colour


def _label(row: dict[str, Any], with_model: bool) -> str:
    status = "" if row["status"] == "completed" else f"({row['status']})"
    parts = [row["model"] if with_model else "", row["label"], row["setting"], status]
    return " ".join(part for part in parts if part)


def _model_panels(
    models: list[str], panel_size: tuple[float, float]
) -> tuple[Figure | None, list[tuple[Any, str]]]:
    """A figure with one panel per model (``models`` may repeat), filled row by row, unused
    panels hidden, and its (axes, model) pairs; (None, []) without a model, so that a plot with
    nothing to show returns its figure, None."""
    models = list(dict.fromkeys(models))
    if not models:
        return None, []
    columns = min(PANEL_COLUMNS, len(models))
    panel_rows = math.ceil(len(models) / columns)
    width, height = panel_size
    figure = Figure(figsize=(width * columns, height * panel_rows), layout="constrained")
    axes = list(figure.subplots(panel_rows, columns, squeeze=False).flat)
    for ax in axes[len(models) :]:
        ax.set_visible(False)
    return figure, list(zip(axes, models, strict=False))


def _finish(
    ax: Any, title: str, ylabel: str, bars: Rows | None = None, legend: bool = True
) -> None:
    """A panel's title, labels, grid and legend; with ``bars``, a tick per bar named by its run."""
    if bars is None:
        ax.set(title=title, xlabel="step", ylabel=ylabel)
    else:
        labels = [_label(row, with_model=False).replace(" ", "\n") for row in bars]
        ax.set_xticks(range(len(bars)), labels, fontsize="small")
        ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="both" if bars is None else "y", alpha=0.3)
    if legend:
        ax.legend(fontsize="small")


def _line(ax: Any, curve: stats.Curve, **style: Any) -> None:
    steps = sorted(curve)
    ax.plot(steps, [curve[s] for s in steps], **style)


def _fill(ax: Any, band: stats.Band, **style: Any) -> None:
    """The lowest to highest of several curves at each step, shaded (none from one curve)."""
    if not band:
        return
    steps = sorted(band)
    ax.fill_between(
        steps, [band[s][0] for s in steps], [band[s][1] for s in steps], linewidth=0, **style
    )


def _draw_cell(ax: Any, cell: Rows, metrics: Metrics) -> None:
    """One precision's loss: a line per seed, their mean over them; a run that did not complete
    dashed. A picture only: the paired loss gap (loss_gap.png, the verdicts) is the evidence."""
    color = precision_color(cell[0]["precision"])
    curves = [(row, curve_of(metrics, row["run"])) for row in cell]
    done = [curve for row, curve in curves if curve and row["status"] == "completed"]
    for row, curve in curves:
        completed = row["status"] == "completed"
        if curve and (not completed or len(done) > 1):
            _line(
                ax,
                curve,
                color=color,
                alpha=0.35 if completed else 0.8,
                linewidth=0.8,
                linestyle="-" if completed else "--",
                label=None if completed else _label(row, with_model=False),
            )
    if not done:
        return
    mean = stats.mean_curve(done)
    label = _label(cell[0], with_model=False)
    _line(
        ax,
        mean,
        color=color,
        linewidth=1.8,
        marker="." if len(mean) < 30 else None,
        label=f"{label}, mean of {len(done)} seeds" if len(done) > 1 else label,
    )


def loss_curves(rows: Rows, metrics: Metrics) -> Figure | None:
    """Training loss, one panel per model: the band of fp32's seeds (lowest to highest) with
    each precision's mean over its seeds drawn over it; a single seed is its own line."""
    shown = [row for row in rows if curve_of(metrics, row["run"])]
    figure, panels = _model_panels([row["model"] for row in shown], (5.2, 3.8))
    cells = group_cells(shown)
    for ax, model in panels:
        panel = [row for row in shown if row["model"] == model]
        losses = [loss for row in panel for loss in curve_of(metrics, row["run"]).values()]
        losses = [loss for loss in losses if loss > 0]
        if losses and max(losses) > 100 * min(losses):
            # A run that blows up would flatten every other curve on a linear axis.
            ax.set_yscale("log")
        for setting in dict.fromkeys(row["setting"] for row in panel):
            fp32 = [
                curve_of(metrics, r["run"])
                for r in cells.get((model, setting, BASELINE), [])
                if r["status"] == "completed"
            ]
            _fill(
                ax,
                stats.band([curve for curve in fp32 if curve]),
                color=precision_color(BASELINE),
                alpha=0.25,
                label=f"fp32 band ({len(fp32)} seeds){f', {setting}' if setting else ''}",
            )
            for (cell_model, cell_setting, _), cell in cells.items():
                if (cell_model, cell_setting) == (model, setting):
                    _draw_cell(ax, cell, metrics)
        _finish(ax, model, "training loss (mean per log interval)")
    return figure


def loss_scale_trace(rows: Rows, metrics: Metrics) -> Figure | None:
    """The fp16 loss scale over training; a cross marks each log interval with skipped steps."""
    traced = []
    for row in rows:
        plugin = report_plugin(row["precision"])
        logged = metrics.get(row["run"], [])
        points = [m for m in logged if m["kind"] == "train" and m.get("scale") is not None]
        if plugin is not None and plugin.spec.grad_scaler and points:
            traced.append((row, points))
    if not traced:
        return None
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    ax = figure.subplots()
    skip_label = "interval with skipped steps (number skipped)"
    for row, points in traced:
        steps, scales = [p["step"] for p in points], [p["scale"] for p in points]
        label = _label(row, with_model=True)
        line = ax.plot(steps, scales, drawstyle="steps-post", marker=".", label=label)[0]
        counts = [0] + [p["skipped_steps"] for p in points]
        for step, scale, (before, after) in zip(steps, scales, pairwise(counts), strict=True):
            if after > before:
                ax.scatter(
                    step, scale, marker="x", s=70, color="#c44e52", zorder=3, label=skip_label
                )
                ax.annotate(
                    str(after - before),
                    (step, scale),
                    textcoords="offset points",
                    xytext=(4, 6),
                    color=line.get_color(),
                    fontsize="small",
                )
                skip_label = "_nolegend_"
    ax.set_yscale("log", base=2)
    _finish(ax, "fp16 loss scale", "loss scale (after the step)")
    return figure


# Below this relative gap DeepSeek-V3 calls fp8 training's loss error acceptable.
DEEPSEEK_BAR = 0.0025


def loss_gap(rows: Rows, metrics: Metrics) -> Figure | None:
    """The paired training-loss gap against fp32 at each logged step, one panel per model: each
    precision's mean gap over its seeds, the band of its seeds' gaps (lowest to highest) and the
    lines it is read against. A picture, not a test: the verdicts rest on the final 10%."""
    pairs: dict[tuple[str, str, str], list[stats.Curve]] = {}
    tolerance_of: dict[str, float] = {}
    for row in rows:
        if row["status"] != "completed" or row["baseline"] is None:
            continue
        gap = stats.gap_curve(curve_of(metrics, row["run"]), curve_of(metrics, row["baseline"]))
        finite = {step: value for step, value in gap.items() if math.isfinite(value)}
        if finite and row["label"] != BASELINE:
            pairs.setdefault(cell_key(row), []).append(finite)
        declared = row["quality_metric"]
        if declared is not None and declared["tolerance_unit"] == "relative":
            tolerance_of[row["model"]] = row["tolerance"]
    figure, panels = _model_panels([model for model, _, _ in pairs], (5.2, 3.8))
    for ax, model in panels:
        for (cell_model, setting, label), gaps in pairs.items():
            if cell_model != model:
                continue
            color = precision_color(label)
            name = " ".join([label, setting]).strip()
            mean = stats.mean_curve(gaps)
            _line(ax, mean, color=color, label=f"{name} (mean of {len(gaps)})")
            spread = stats.band(gaps)
            _fill(ax, spread, color=color, alpha=0.2, label=f"{name}: lowest to highest seed")
        lines = [(DEEPSEEK_BAR, "DeepSeek-V3's ±0.25%", ":")]
        if model in tolerance_of:
            lines.append(
                (tolerance_of[model], f"eval-loss tolerance ±{tolerance_of[model]:.2%}", "--")
            )
        for level, name, style in lines:
            ax.axhline(level, color="#333333", linestyle=style, linewidth=0.9, label=name)
            ax.axhline(-level, color="#333333", linestyle=style, linewidth=0.9)
        ax.axhline(0, color=precision_color(BASELINE), linewidth=0.8)
        ax.yaxis.set_major_formatter(lambda value, _: f"{value:+.2%}")
        _finish(ax, model, "training-loss gap vs fp32, paired by seed")
    return figure


def _bars(
    rows: Rows, segments: list[tuple[str, Callable, str]], unit: float, ylabel: str, fmt: str
) -> Figure | None:
    """A panel per model with a bar per completed row: its ``segments`` ((value key, its ratio's
    text by row, legend), from the bottom up) stacked, each labelled with value and ratio."""
    shown = [row for row in rows if row["status"] == "completed" and row[segments[0][0]]]
    figure, panels = _model_panels([row["model"] for row in shown], (4.2, 4.0))
    for ax, model in panels:
        bars = [row for row in shown if row["model"] == model]
        bottom = [0.0] * len(bars)
        for layer, (key, ratio_text, legend) in enumerate(segments):
            values = [(row[key] or 0) / unit for row in bars]
            drawn = ax.bar(
                range(len(bars)),
                values,
                bottom=bottom,
                color=[precision_color(row["precision"]) for row in bars],
                alpha=0.45 if layer else 1.0,
                hatch="//" if layer else None,
                label=legend,
            )
            labels = [
                format(value, fmt) + ("" if (text := ratio_text(row)) is None else f"\n{text}")
                for value, row in zip(values, bars, strict=True)
            ]
            ax.bar_label(drawn, labels=labels, label_type="center", fontsize="small")
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.margins(y=0.25)
        _finish(ax, model, ylabel, bars, legend=len(segments) > 1)
    return figure


def ratio_of(key: str) -> Callable[[dict[str, Any]], str | None]:
    """A row's ratio to fp32 under ``key`` as a bar's label shows it: 0.50x, or None."""
    return lambda row: None if row[key] is None else f"{row[key]:.2f}x"


def bar_speed(row: dict[str, Any]) -> str | None:
    """A run's speed under its throughput bar: the speed trial's figure for its precision, or that
    none was measured (its samples/s over fp32's, jobs timed one after another on a shared
    machine, is no speedup: the recommendation's rule); nothing under fp32's own bar."""
    if row["label"] == BASELINE:
        return None
    trial = row["trial_speedup"]
    return "speedup not\nmeasured (no trial)" if trial is None else f"trial {speedup_cell(trial)}"


def throughput_bars(rows: Rows, metrics: Metrics) -> Figure | None:
    segments = [("samples_per_s", bar_speed, "samples/s")]
    return _bars(rows, segments, 1, "training samples/s (speedup: the speed trial's)", ",.0f")


def memory_bars(rows: Rows, metrics: Metrics) -> Figure | None:
    """What a precision changes in memory, a bar per precision: the saved activations with the
    weights and optimizer state on top, each against fp32's. Memory does not change with the
    seed, so a cell's first run stands for it. (The process's resident set measures Python and
    torch, not the precision: it is no bar.)"""
    firsts = [
        next((row for row in cell if row["status"] == "completed"), cell[0])
        for cell in group_cells(rows).values()
    ]
    segments = [
        ("saved_activation_bytes", ratio_of("activation_ratio"), "saved activations"),
        ("state_bytes", ratio_of("state_ratio"), "weights + optimizer state"),
    ]
    return _bars(firsts, segments, 2**20, "MiB (x fp32)", ",.2f")


def speed_trial_bars(rows: Rows, metrics: Metrics) -> Figure | None:
    """The speed trial: each precision's speedup over fp32 (geometric mean) and its interval."""
    trialled = {
        key: cell[0]
        for key, cell in group_cells(rows).items()
        if cell[0]["trial_speedup"] is not None
    }
    figure, panels = _model_panels([model for model, _, _ in trialled], (4.2, 4.0))
    for ax, model in panels:
        bars = [row for (cell_model, _, _), row in trialled.items() if cell_model == model]
        medians = [row["trial_speedup"]["ratio"] for row in bars]
        intervals = [trial_interval(row["trial_speedup"]) for row in bars]
        errors = [
            [m - low for m, (low, _, _) in zip(medians, intervals, strict=True)],
            [high - m for m, (_, high, _) in zip(medians, intervals, strict=True)],
        ]
        drawn = ax.bar(
            range(len(bars)),
            medians,
            yerr=errors,
            capsize=4,
            color=[precision_color(row["precision"]) for row in bars],
        )
        ax.bar_label(
            drawn, labels=[f"{m:.2f}x" for m in medians], label_type="center", fontsize="small"
        )
        baseline = precision_color(BASELINE)
        ax.axhline(1.0, color=baseline, linewidth=1, linestyle="--", label=BASELINE)
        ax.margins(y=0.2)
        _finish(ax, model, f"speedup over fp32 ({trial_levels(intervals)} CI)", bars)
    return figure


PLOTS: dict[str, Callable[[Rows, Metrics], Figure | None]] = {
    "loss_curves.png": loss_curves,
    "loss_gap.png": loss_gap,
    "loss_scale.png": loss_scale_trace,
    "throughput.png": throughput_bars,
    "peak_memory.png": memory_bars,
    "speed_trial.png": speed_trial_bars,
}


def save(figure: Figure, path: Path) -> None:
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=110)
