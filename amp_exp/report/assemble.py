"""build_report: find the runs, compare them, and write report.md, report.json and the plots."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from amp_exp.report.compare import BASELINE, assign_settings, comparison_rows, verdicts
from amp_exp.report.markdown import write_report
from amp_exp.report.runs import find_runs

log = logging.getLogger("amp_exp")


def draw_plots(
    rows: list[dict[str, Any]], metrics: dict[str, list[dict[str, Any]]], out_dir: Path
) -> tuple[list[str], dict[str, str]]:
    """Each plot on its own: one that fails is named in the report and costs nothing else."""
    try:
        from amp_exp.report import plots
    except ImportError as error:
        return [], {"plots": f"{error}; pip install 'amp_exp[report]' for plots"}
    drawn, errors = [], {}
    for name, draw in plots.PLOTS.items():
        try:
            figure = draw(rows, metrics)
            if figure is not None:
                plots.save(figure, out_dir / name)
                drawn.append(name)
        except Exception as error:
            log.warning("report: %s could not be drawn: %s", name, error)
            errors[name] = f"{type(error).__name__}: {error}"
    return drawn, errors


def build_report(dirs: list[Path], out_dir: Path, tolerance: float | None = None) -> dict[str, Any]:
    """Write report.md, report.json and the plots for the runs under ``dirs``; return the report.

    ``tolerance`` is in the unit of the task's quality metric; None takes each task's default."""
    runs = find_runs(dirs)
    assign_settings(runs)
    rows = comparison_rows(runs, out_dir)
    report = {
        "tolerance": tolerance,
        "baseline_precision": BASELINE,
        "verdicts": verdicts(rows, tolerance),
        "runs": rows,
        "plots": [],
        "plot_errors": {},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    # The table is on disk before any plot is tried.
    write_report(out_dir, report)
    metrics = {os.path.relpath(run.path, out_dir): run.metrics for run in runs}
    report["plots"], report["plot_errors"] = draw_plots(rows, metrics, out_dir)
    write_report(out_dir, report)
    return report
