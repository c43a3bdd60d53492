"""The speed trial at the end of a sweep: one trial per model and setting that ran fp32 and some
other precision, written to the sweep's speed.json (and speed.md) before its report is built.

The report callback (report/assemble.py) receives ``time_sweep`` from conf/config.yaml rather
than importing it: the trial builds models (``amp_exp.build``), a layer above the report's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from amp_exp.config.plain import flatten_config, run_config_from_plain
from amp_exp.config.schema import RunConfig
from amp_exp.errors import ConfigError
from amp_exp.report.compare import BASELINE, assign_settings, precision_label, subject
from amp_exp.report.runs import Run, find_runs
from amp_exp.results.files import SPEED_JSON, SPEED_MD, SUMMARY_FILE, write_json, write_text
from amp_exp.results.sweep import CODE_KEYS

log = logging.getLogger("amp_exp")


def trial_config(run: Run, trusted: frozenset[str] = frozenset()) -> RunConfig:
    """The job's config, in the precision it ran (a job of precision=auto names its choice).
    The code it names must be among ``trusted``, what the sweep's own command line and config
    name (results.sweep.named_code): a summary.json is data, never a name to import."""
    config = run.summary["config"]
    flat = flatten_config(config)
    foreign = [
        f"{key}={flat[key]}" for key in CODE_KEYS if flat.get(key) and flat[key] not in trusted
    ]
    if foreign:
        raise ConfigError(
            f"{run.path / SUMMARY_FILE} names {', '.join(foreign)}, which this sweep's command "
            "line and config do not; code is imported only from what the command names"
        )
    cfg = run_config_from_plain(config)
    cfg.precision.name = run.precision
    return cfg


def trial_groups(runs: list[Run]) -> dict[tuple[str, str], dict[str, Run]]:
    """Per model and setting that completed fp32 and another precision: one completed job of each
    precision label (the first seed's: the speed of a precision does not depend on the seed)."""
    groups: dict[tuple[str, str], dict[str, Run]] = {}
    for run in runs:
        if run.completed and "config" in run.summary:
            group = groups.setdefault((run.model, run.setting), {})
            group.setdefault(precision_label(run.summary), run)
    return {key: jobs for key, jobs in groups.items() if BASELINE in jobs and len(jobs) > 1}


def stand_in(jobs: dict[str, Run]) -> str | None:
    """What a single-process trial stands in for when the jobs ran under torchrun: the sweep's
    own process cannot time their world size and strategy, so the figure is labelled."""
    summary = jobs[BASELINE].summary
    world_size = summary.get("world_size", 1)
    if world_size == 1:
        return None
    return f"single-process stand-in for {summary.get('strategy')} on {world_size} ranks"


def time_sweep(sweep_dir: Path, trusted: frozenset[str] = frozenset()) -> Path | None:
    """Run the sweep's trials and write speed.json and speed.md; returns speed.json's path, or
    None when no model and setting ran fp32 and another precision. A trial that fails is recorded
    with its error, and the report of that group falls back to the jobs' own timings. A signal
    (``TrialStopped``) ends the trials: what they measured is written, marked as stopped, and the
    signal goes on to the caller. ``trusted``: the code the sweep's command line and config name
    (``trial_config``)."""
    from amp_exp.speed.trial import TrialStopped, run_trial, trial_markdown

    runs = find_runs([sweep_dir])
    assign_settings(runs)
    trials: list[dict[str, Any]] = []

    def write() -> Path:
        write_json(sweep_dir / SPEED_JSON, {"trials": trials})
        write_text(sweep_dir / SPEED_MD, trial_markdown(trials))
        return sweep_dir / SPEED_JSON

    for (model, setting), jobs in trial_groups(runs).items():
        where = subject(model, setting)
        log.info("speed trial: %s in %s, interleaved", ", ".join(jobs), where)
        try:
            configs = {label: trial_config(run, trusted) for label, run in jobs.items()}
            trial = run_trial(configs, configs[BASELINE].speed, stand_in(jobs))
        except TrialStopped as stopped:
            trials.append({**stopped.trial, "model": model, "setting": setting})
            write()
            raise
        except Exception as error:
            log.warning("speed trial of %s failed: %s", where, error)
            trial = {"error": f"{type(error).__name__}: {error}"}
        trials.append({**trial, "model": model, "setting": setting})
    return write() if trials else None
