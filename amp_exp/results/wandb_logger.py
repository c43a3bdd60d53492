"""Weights & Biases logging that never costs the run its speed, its files or its secrets.

``wandb`` is imported here only, and only when W&B is enabled: it adds about 0.5 s to start-up.
Every call into W&B is contained. A failure logs one warning and the run goes on; metrics.jsonl
stays the complete record. An online run that cannot start (no API key, no server) falls back to
an offline run in the Hydra output directory, which ``wandb sync`` uploads later.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from amp_exp.config.cross_checks import resolve_mode
from amp_exp.config.schema import RunConfig, WandbConfig, WandbMode
from amp_exp.errors import first_line
from amp_exp.results.dashboard import (
    AUDIT_COLUMNS,
    AUDIT_TABLE,
    METRIC_GROUPS,
    SKIP_RATE,
    SUMMARIES,
    X_AXIS,
    audit_rows,
    audit_summary,
    run_config,
    run_group,
    run_name,
    run_tags,
    wandb_metrics,
)
from amp_exp.results.files import WANDB_RUN_ID_FILE, read_data
from amp_exp.results.loggers import TRAIN
from amp_exp.results.sweep import SweepJob

log = logging.getLogger("amp_exp")

NO_API_KEY = "no API key is configured (set WANDB_API_KEY or run `wandb login`)"


def describe(error: BaseException) -> str:
    message = first_line(str(error))
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def wandb_settings(wandb_cfg: WandbConfig, mode: WandbMode) -> dict[str, Any]:
    return {
        # An online attempt needs online global settings, or login() refuses under
        # WANDB_MODE=offline even when wandb.mode=online says otherwise.
        "mode": "offline" if mode is WandbMode.offline else "online",
        # Our one-line messages replace W&B's console output. Silence also turns off W&B's
        # terminal prompt for an API key, and its lookup of the user name, which costs 5 s per
        # call when the server cannot be reached.
        "silent": True,
        "init_timeout": wandb_cfg.init_timeout,
        "finish_timeout": wandb_cfg.finish_timeout,
        "save_code": wandb_cfg.save_code,
        "disable_code": not wandb_cfg.save_code,
        "disable_git": not wandb_cfg.save_code,
        "x_save_requirements": wandb_cfg.save_code,
        # W&B's metadata holds the command line, the program path, the host and the user name.
        "x_disable_meta": not wandb_cfg.save_metadata,
    }


def start_run(
    wandb: Any, mode: WandbMode, wandb_cfg: WandbConfig, init_args: dict[str, Any]
) -> Any:
    """An online run if possible, else an offline one, else None; says which in one line."""
    fallback = None
    try:
        wandb.setup(settings=wandb.Settings(**wandb_settings(wandb_cfg, mode)))
        if mode is not WandbMode.offline:
            try:
                # Without credentials, wandb.init would ask for a key at a terminal prompt that
                # waits forever and only KeyboardInterrupt leaves; so look first, never prompt.
                if wandb.login(prompt=False, verify=False):
                    run = wandb.init(mode="online", **init_args)
                    log.info("W&B: logging online to %s", run.url)
                    return run
                fallback = NO_API_KEY
            except Exception as error:
                fallback = f"could not start online ({describe(error)})"
        run = wandb.init(mode="offline", **init_args)
    except Exception as error:
        log.warning("W&B: could not start a run (%s); training goes on without it", describe(error))
        return None
    sync_dir = run.settings.sync_dir
    expected = fallback is None or (mode is WandbMode.auto and fallback == NO_API_KEY)
    log.log(
        logging.INFO if expected else logging.WARNING,
        "W&B: %slogging offline to %s; upload it later with `wandb sync %s`",
        f"{fallback}, so " if fallback else "",
        sync_dir,
        sync_dir,
    )
    return run


def open_wandb_logger(
    cfg: RunConfig,
    output_dir: Path,
    precision: str,
    device_type: str,
    total_steps: int,
    sweep: SweepJob | None,
    resumed_run_dir: Path | None = None,
    parallelism: dict[str, Any] | None = None,
) -> WandbLogger | None:
    """A logger for the run's W&B run, or None when W&B is disabled or cannot start at all.

    A run resumed from a checkpoint continues the W&B run whose id its run directory kept, so
    the dashboard shows one unbroken curve.
    """
    mode = resolve_mode(cfg.wandb.mode, os.environ)
    if mode is WandbMode.disabled:
        return None
    # W&B's own crash reporting can hold the process about 10 s at exit without a network.
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    import wandb

    init_args = {
        "project": cfg.wandb.project,
        "entity": cfg.wandb.entity,
        "group": run_group(cfg, sweep),
        "name": run_name(cfg, precision, sweep),
        "tags": run_tags(cfg, precision, device_type),
        "job_type": "train",
        "config": run_config(cfg, precision, parallelism),
        "dir": str(output_dir),
        # Jobs of a basic-launcher multirun share a process; each must get its own run.
        "reinit": "finish_previous",
    }
    id_file = resumed_run_dir / WANDB_RUN_ID_FILE if resumed_run_dir else None
    if id_file is not None and id_file.is_file():
        try:
            init_args.update(id=read_data(id_file).decode("utf-8").strip(), resume="allow")
        except ValueError as error:  # a planted link, bytes that are no id: W&B is optional
            log.warning("%s; this run starts a new W&B run", first_line(str(error)))
    run = start_run(wandb, mode, cfg.wandb, init_args)
    if run is None:
        return None
    (output_dir / WANDB_RUN_ID_FILE).write_text(run.id, encoding="utf-8")
    return WandbLogger(wandb, run, cfg.wandb.log_every, total_steps)


class WandbLogger:
    """Sends the engine's rows to a W&B run. A W&B failure is logged once, never raised."""

    def __init__(self, wandb: Any, run: Any, log_every: int | None, total_steps: int) -> None:
        self._wandb, self.run = wandb, run
        self.log_every, self.total_steps = log_every, total_steps
        self.failed = False
        # Set to 1 when training raised, so the dashboard shows the run as failed, not finished.
        self.exit_code = 0
        self._last_step = self._last_skipped = 0
        # W&B refuses a step lower than one it has seen: the audit table goes at the last one.
        self._last_logged: int | None = None
        with self._contained("define metrics"):
            run.define_metric(X_AXIS)
            for pattern in METRIC_GROUPS:
                run.define_metric(pattern, step_metric=X_AXIS)
            for key, summary in SUMMARIES.items():
                run.define_metric(key, step_metric=X_AXIS, summary=summary)

    @contextlib.contextmanager
    def _contained(self, action: str) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            if not self.failed:
                log.warning(
                    "W&B: could not %s (%s); W&B logging stops here, metrics.jsonl has every row",
                    action,
                    describe(error),
                )
            self.failed = True

    def _is_logged(self, row: dict[str, Any]) -> bool:
        is_occasional = row["kind"] != TRAIN  # eval and diagnostics rows are few: W&B gets them all
        if is_occasional or self.log_every is None:
            return True
        return row["step"] % self.log_every == 0 or row["step"] == self.total_steps

    def _metrics(self, row: dict[str, Any]) -> dict[str, Any]:
        metrics = wandb_metrics(row)
        if "skipped_steps" in row:
            # The share of optimizer steps skipped since the last W&B row: bursts of overflow
            # show up here, while amp/skipped_steps counts them all.
            steps = row["step"] - self._last_step
            metrics[SKIP_RATE] = (row["skipped_steps"] - self._last_skipped) / steps
            self._last_step, self._last_skipped = row["step"], row["skipped_steps"]
        return metrics

    def log(self, row: dict[str, Any]) -> None:
        if self.failed or not self._is_logged(row):
            return
        with self._contained(f"log step {row['step']}"):
            self.run.log(self._metrics(row), step=row["step"])
            self._last_logged = row["step"]

    def record_summary(self, summary: dict[str, Any]) -> None:
        """Put the run's AMP health verdicts where the runs table can compare them."""
        if self.failed:
            return
        overflow = summary.get("first_overflow")
        checks = summary.get("checks") or {}
        health = {
            "amp/suggested_init_scale": summary.get("suggested_init_scale"),
            "amp/first_overflow_step": overflow["step"] if overflow else None,
            "amp/checks_passed": all(c["passed"] is not False for c in checks.values()),
            "amp/stale_weight_frac": summary.get("stale_weight_frac"),
            "perf/state_bytes": summary.get("state_bytes"),
            # The best loss the data allows, to read eval/loss against.
            "eval/loss_floor": summary.get("loss_floor"),
        }
        audit = summary.get("precision_audit") or {}
        health |= audit_summary(audit)
        with self._contained("write the summary"):
            self.run.summary.update({k: v for k, v in health.items() if v is not None})
        if audit.get("modules"):
            with self._contained("log the audit table"):
                table = self._wandb.Table(columns=list(AUDIT_COLUMNS), data=audit_rows(audit))
                self.run.log({AUDIT_TABLE: table}, step=self._last_logged)

    def close(self) -> None:
        with self._contained("finish the run"):
            self.run.finish(exit_code=self.exit_code)
        # Offline, finish() can return before the run file is complete; teardown waits for it.
        with self._contained("shut W&B down"):
            self._wandb.teardown()
