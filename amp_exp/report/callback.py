"""Hydra callbacks, registered under ``hydra.callbacks`` in conf/config.yaml."""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from amp_exp.config.schema import ReportConfig
from amp_exp.results.contract import Stopped, stop_on_signals
from amp_exp.results.sweep import named_code
from amp_exp.runtime.launch import worker_rank

log = logging.getLogger("amp_exp")


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
        self.settings = ReportConfig(
            tolerance=config.report.tolerance,
            wandb=config.report.wandb,
            wandb_timeout=config.report.wandb_timeout,
            speed_trial=config.report.speed_trial,
            familywise=config.report.familywise,
            predict=list(config.report.predict),
            forecast_steps=config.report.forecast_steps,
        )
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

        stopped = self.time_speed()
        if stopped is None and self.settings.predict and self.predict_sweep is not None:
            try:
                self.predict_sweep(self.sweep_dir, self.settings.predict, self.trusted)
            except Exception as error:
                # A prediction is an extra column: without it the report is the measured one.
                log.warning("no prediction: %s", error)
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
                self.speed_trial(self.sweep_dir, self.trusted)
        except Stopped as stopped:
            log.error(
                "speed trial stopped by %s: the report shows the rounds it measured",
                stopped.received.name,
            )
            return stopped
        except Exception as error:
            # Without it the report shows the jobs' own timings, labelled as such.
            log.warning("no speed trial: %s", error)
        return None

    def report(self) -> None:
        from amp_exp.report.assemble import build_report

        try:
            report = build_report(
                [self.sweep_dir],
                self.sweep_dir,
                self.settings.tolerance,
                self.settings.familywise,
                self.settings.forecast_steps,
            )
        except Exception as error:
            # The report is a by-product: it never turns a finished sweep into a failed one.
            log.warning("no sweep report: %s", error)
            return
        for line in report["verdicts"]:
            log.info("%s", line)
        log.info("sweep report: %s", self.sweep_dir / "report.md")
        if self.settings.wandb:
            self.publish(report)

    def publish(self, report: dict[str, Any]) -> None:
        from amp_exp.report.wandb_report import publish_report

        try:
            url = publish_report(
                [self.sweep_dir],
                self.sweep_dir,
                report,
                self.settings.wandb_timeout,
                require_online=True,
            )
        except Exception as error:
            # Like the report itself: a dashboard that cannot be made never fails the sweep.
            log.warning("no W&B report: %s", error)
            return
        log.info("W&B report: %s", url)
