"""build_report: find the runs, compare them, weigh the evidence, and write report.md,
report.json and the plots; the evidence sweeper's looks, the same report at each look; and the
Hydra callback (``SweepReport``, registered under ``hydra.callbacks`` in conf/config.yaml) that
builds it when a multirun ends."""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from amp_exp.config.schema import ReportConfig
from amp_exp.launch import worker_rank
from amp_exp.report import sequential
from amp_exp.report.compare import (
    BASELINE,
    assign_settings,
    cell_key,
    comparison_rows,
    mark_comparisons,
    mark_learned,
    tolerance_for,
    troubles,
)
from amp_exp.report.decision import DEFAULT_FAMILYWISE
from amp_exp.report.evidence import fixed_level, gather, of_setting, trial_speedup
from amp_exp.report.forecasts import long_run_forecasts, plot_forecasts
from amp_exp.report.markdown import write_report
from amp_exp.report.recommend import recommendations
from amp_exp.report.runs import find_runs
from amp_exp.report.sequential import Plan, read_plan
from amp_exp.report.words import verdicts
from amp_exp.results.contract import Stopped, stop_on_signals
from amp_exp.results.files import PREDICTED_JSON, SPEED_JSON, UntrustedFile, read_json
from amp_exp.results.sweep import named_code

log = logging.getLogger("amp_exp")


def read_entries(dirs: list[Path], name: str, key: str) -> list[dict[str, Any]]:
    """The ``key`` lists of every ``name`` file under ``dirs``: the speed trials of speed.json
    (amp_exp/speed/ writes them), the predictions of predicted.json (amp_exp/predict/). One that
    cannot be read is skipped with a warning: the report falls back to the jobs' own timings, or
    shows no prediction."""
    entries = []
    for directory in dirs:
        for path in sorted(directory.rglob(name)):
            try:
                entries += read_json(path)[key]
            except UntrustedFile:
                raise
            except (OSError, ValueError, KeyError, TypeError) as error:
                log.warning("report: skipping %s: %s", path, error)
    return entries


def predicted_speedups(
    predictions: list[dict[str, Any]], key: tuple[str, str, str]
) -> dict[str, dict[str, Any]]:
    """Per GPU, the predicted speedup over fp32 of a cell's precision (``speedup_vs_fp32``), or
    why there is none (``unavailable``), keyed by the GPU's label; empty without a prediction."""
    prediction, label = next(iter(of_setting(predictions, key)), {}), key[2]
    return {
        device["label"]: device["precisions"][label]
        for device in (prediction.get("devices") or {}).values()
        if label in device["precisions"]
    }


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


def assemble(
    dirs: list[Path],
    out_dir: Path,
    tolerance: float | None = None,
    familywise: str = DEFAULT_FAMILYWISE,
    plan: Plan | None = None,
    forecast_steps: int | None = None,
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The report of the runs under ``dirs`` (no plots yet) and each run's metrics rows; the
    verdicts' levels those of an evidence sweep's ``plan`` at each look (report/sequential.py),
    else 2.5% per side."""
    runs = find_runs(dirs)
    assign_settings(runs)
    rows = comparison_rows(runs, out_dir)
    metrics = {os.path.relpath(run.path, out_dir): run.metrics for run in runs}
    trials = read_entries(dirs, SPEED_JSON, "trials")
    for row in rows:
        row["trial_speedup"] = trial_speedup(trials, cell_key(row))
        # The tolerance that judges the run's quality metric, in its unit (null without one).
        row["tolerance"] = tolerance_for(row, tolerance)
        if row["trial_speedup"] is not None:
            # One speed fact per precision: the trial timed this model, so the probe's advice
            # from generic kernels, which may say the opposite, is not repeated beside it.
            row["health"]["hardware_advice"] = []
    mark_learned(rows, metrics)
    for row in rows:
        row["troubles"] = troubles(row, metrics.get(row["run"], []))
    alpha = fixed_level if plan is None else plan.alpha
    cells, comparisons = gather(rows, metrics, tolerance, trials, familywise, alpha)
    predictions = read_entries(dirs, PREDICTED_JSON, "predictions")
    for found in comparisons:
        found["predicted"] = predicted_speedups(predictions, cell_key(found))
    mark_comparisons(comparisons, rows)
    report = {
        "recommendations": recommendations(rows, comparisons),
        "tolerance": tolerance,
        "familywise": familywise,
        # The verdicts' interval level where all share one (null: an evidence sweep's looks').
        "confidence": shared_level(comparisons),
        "baseline_precision": BASELINE,
        "verdicts": verdicts(rows, comparisons),
        "comparisons": comparisons,
        "cells": cells,
        "speed_trials": trials,
        "forecasts": long_run_forecasts(runs, out_dir, forecast_steps),
        "runs": rows,
        "plots": [],
        "plot_errors": {},
    }
    return report, metrics


class EvidenceLooks:
    """The evidence sweeper's looks (hydra_plugins/_amp_exp_evidence.py ``Looks``; the entry
    point hands this class in): each builds the report's verdicts from the jobs so far at the
    plan's level, records them in evidence.json and names the next seed of each open cell."""

    def __init__(
        self,
        sweep_dir: Path,
        min_seeds: int,
        max_seeds: int,
        tolerance: float | None,
        familywise: str,
    ) -> None:
        self.sweep_dir, self.tolerance, self.familywise = sweep_dir, tolerance, familywise
        self.plan = sequential.start(sweep_dir, min_seeds, max_seeds)
        self.min_seeds = self.plan.min_seeds
        self.looks: list[dict[str, Any]] = []

    def shown(self) -> str:
        plan = self.plan
        return (
            f"{plan.min_seeds} to {plan.max_seeds} seeds, {plan.looks} looks planned, "
            f"one-sided levels {plan.shown()}"
        )

    def look(self, cell_of_run: dict[str, tuple[str, ...]]) -> dict[tuple[str, ...], int]:
        dirs = [self.sweep_dir / name for name in cell_of_run]
        report, _ = assemble(dirs, self.sweep_dir, self.tolerance, self.familywise, self.plan)
        sequential.record(self.sweep_dir, self.plan, report, self.looks)
        return sequential.next_seeds(report, cell_of_run, self.plan)


def shared_level(comparisons: list[dict[str, Any]]) -> float | None:
    levels = {c["confidence"] for c in comparisons if c["confidence"] is not None}
    return 0.95 if not levels else (levels.pop() if len(levels) == 1 else None)


def build_report(
    dirs: list[Path],
    out_dir: Path,
    tolerance: float | None = None,
    familywise: str = DEFAULT_FAMILYWISE,
    forecast_steps: int | None = None,
) -> dict[str, Any]:
    """Write report.md, report.json and the plots for the runs under ``dirs``; return the report.

    ``tolerance`` is in the unit of the task's quality metric; None takes each task's default.
    ``familywise``: Holm across the report's comparisons (``holm``) or each at its own level
    (``none``; report.familywise). An evidence sweep's directory (its evidence.json) is judged at
    the levels of its looks, and says so. ``forecast_steps``: the length the runs' signals are
    forecast to (None: 10x each run's)."""
    plans = [plan for plan in map(read_plan, dirs) if plan is not None]
    # Over several sweeps' directories the strictest plan judges all (its levels are lower).
    found = (Plan(**recorded["plan"]) for recorded in plans)
    plan = min(found, key=lambda p: p.alpha(p.max_seeds, None), default=None)
    report, metrics = assemble(dirs, out_dir, tolerance, familywise, plan, forecast_steps)
    report["evidence_sweep"] = plans[0] if len(plans) == 1 else None
    if report["evidence_sweep"] is not None:
        # Runs the sweep's last look never saw: judged by the plan's levels, never at 95%.
        recorded = report["evidence_sweep"]["jobs"]
        report["evidence_sweep"]["runs_after_last_look"] = max(0, len(report["runs"]) - recorded)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The table is on disk before any plot is tried.
    write_report(out_dir, report)
    report["plots"], report["plot_errors"] = draw_plots(report["runs"], metrics, out_dir)
    plot_forecasts(report["forecasts"], metrics, out_dir)
    write_report(out_dir, report)
    return report


class SweepReport(Callback):
    """Builds report.md, report.json and the plots in the sweep directory when a multirun ends,
    after the interleaved speed trial (``report.speed_trial``), and with ``report.wandb=true``
    the sweep's W&B Report."""

    def __init__(
        self,
        speed_trial: Callable[[Path, frozenset[str]], Any] | None = None,
        predict_sweep: Callable[[Path, list[str], frozenset[str]], Any] | None = None,
    ) -> None:
        """``speed_trial(sweep_dir, trusted)`` writes the sweep's speed.json,
        ``predict_sweep(sweep_dir, devices, trusted)`` its predicted.json (report.predict):
        conf/config.yaml hands in amp_exp.speed.sweep.time_sweep and
        amp_exp.predict.sweep.predict_sweep, which build models, a layer above the report's."""
        self.sweep_dir = Path()
        self.settings = ReportConfig()
        self.speed_trial = speed_trial
        self.predict_sweep = predict_sweep
        # The code the sweep's own command line and config name: all the trial may import.
        self.trusted: frozenset[str] = frozenset()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Resolving the sweep directory now pins its ${now:...} to the one the jobs use.
        self.sweep_dir = Path(config.hydra.sweep.dir).absolute()
        self.trusted = named_code(config)
        report = OmegaConf.to_container(config.report, resolve=True)
        self.settings = ReportConfig(**{key.name: report[key.name] for key in fields(ReportConfig)})
        launcher = str(config.hydra.launcher.get("_target_", ""))
        if self.settings.speed_trial and launcher.endswith("SlurmLauncher"):
            # This process runs where the sweep was submitted, not on the jobs' nodes.
            log.info(
                "report.speed_trial: not under SLURM; time a node with python -m amp_exp.speed"
            )
            self.settings.speed_trial = False
        if self.settings.wandb and importlib.util.find_spec("wandb_workspaces") is None:
            from amp_exp.report.wandb_report import MISSING_LIBRARY

            # Said now rather than after hours of training; the sweep runs all the same.
            log.warning("report.wandb=true: %s; the sweep runs without it", MISSING_LIBRARY)
        # Hydra skips on_multirun_end when a job failed (the sweeper re-raises the first failure
        # once the jobs are done), so the report is also built at exit; on_multirun_end cancels it.
        atexit.register(self.build_at_exit)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self.build_at_exit)
        self.build()

    def build(self) -> None:
        """The speed trial, the predictions and the report; a signal during the trial stops it,
        the report shows what it measured, and then the signal stops the sweep (``Stopped``:
        it exits 128 + N)."""
        rank = worker_rank()
        if rank is not None and not rank.is_main:
            return  # under torchrun every rank runs the sweep; rank 0 alone writes its report

        stopped, predict = self.time_speed(), self.settings.predict
        if stopped is None and predict and self.predict_sweep is not None:
            # A prediction is an extra column: without it the report is the measured one.
            attempt("prediction", self.predict_sweep, self.sweep_dir, predict, self.trusted)
        self.report()
        if stopped is not None:
            raise stopped

    def build_at_exit(self) -> None:
        """``build`` as the process exits, where an exception no longer sets its status."""
        try:
            self.build()
        except Stopped as stopped:
            print(f"amp_exp: stopped by {stopped.received.name}", file=sys.stderr)
            logging.shutdown()
            os._exit(128 + stopped.received)

    def time_speed(self) -> Stopped | None:
        """The sweep's speed trial, stopped by a preemption signal (which is returned)."""
        if not (self.settings.speed_trial and self.speed_trial is not None):
            return None
        try:
            with stop_on_signals():
                # Without it the report shows the jobs' own timings, labelled as such.
                attempt("speed trial", self.speed_trial, self.sweep_dir, self.trusted)
        except Stopped as stopped:
            log.error(
                "speed trial stopped by %s: the report shows the rounds it measured",
                stopped.received.name,
            )
            return stopped
        return None

    def report(self) -> None:
        # The report is a by-product: it never turns a finished sweep into a failed one.
        settings = self.settings
        report = attempt(
            "sweep report",
            build_report,
            [self.sweep_dir],
            self.sweep_dir,
            settings.tolerance,
            settings.familywise,
            settings.forecast_steps,
        )
        if report is None:
            return
        for line in report["verdicts"]:
            log.info("%s", line)
        log.info("sweep report: %s", self.sweep_dir / "report.md")
        if settings.wandb:
            from amp_exp.report.wandb_report import publish_report

            # Like the report itself: a dashboard that cannot be made never fails the sweep.
            dirs, timeout = [self.sweep_dir], settings.wandb_timeout
            url = attempt("W&B report", publish_report, dirs, self.sweep_dir, report, timeout, True)
            if url is not None:
                log.info("W&B report: %s", url)


def attempt(what: str, step: Callable[..., Any], *args: Any) -> Any:
    """``step(*args)``, or None with a warning ("no speed trial: ...") where it fails: the sweep's
    optional parts never fail the sweep. A signal (``Stopped``) passes through."""
    try:
        return step(*args)
    except Exception as error:
        log.warning("no %s: %s", what, error)
        return None
