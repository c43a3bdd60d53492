"""Verifying one set of modules kept in fp32: its seeds trained in the target precision, judged
against fp32's seeds by the sweep report's own paired verdict (report/evidence.py's comparison,
by report/decision.py's rule, worded by report/words.py).

A set passes only when that verdict is ``matches``: the interval of the paired differences of the
task's quality metric (eval loss, relative, for a language model) lies inside the tolerance, and
no seed failed (a failed seed makes the verdict ``unstable``, which overrides the statistics).
Each run is ``sensitivity.verify_steps`` long with fp16's growth interval cut to
``sensitivity.verify_growth_interval``, so that the loss scale grows and late overflows happen.

Seeds are added as the evidence sweeper adds them, by its rule (report/sequential.py): the first
look at ``sensitivity.verify_seeds``, then, while the verdict is open (every seed trained without
a fault, but nothing is decided), one seed more, up to ``sensitivity.max_verify_seeds``; every
look's interval is at the plan's calibrated level for that look, so that looking again does not
raise the rate of false ``matches``. An undecided set gets more evidence before the search calls
it failed.

Each seed trains in its own directory, ``<trial>/seed_<n>``, with the same engine as any run
(``run.train``). A seed whose directory already holds a completed run (a resumed search) is read,
not trained again. A trial's record, ``trial.json``, is written last and atomically: a trial
without one was interrupted, and is run again, never counted.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amp_exp.config.plain import plain_run_config
from amp_exp.config.schema import RunConfig, WandbMode
from amp_exp.errors import NumericalFault
from amp_exp.report.compare import comparison_rows
from amp_exp.report.evidence import gather
from amp_exp.report.runs import find_runs
from amp_exp.report.sequential import Plan
from amp_exp.report.stats import Verdict
from amp_exp.report.words import quality_phrase
from amp_exp.results.contract import Stopped
from amp_exp.results.files import METRICS_FILE, damaged, read_json, write_json
from amp_exp.results.loggers import read_rows
from amp_exp.results.summary import Status, completed_summary, record_failure
from amp_exp.run import train
from amp_exp.tasks.workload import declared_metrics

log = logging.getLogger("amp_exp")
TRIAL_FILE = "trial.json"


@dataclass
class SeedRun:
    """One seed's verification run, as it ended."""

    seed: int
    run_dir: str
    status: str
    final_loss: float | None = None
    quality: float | None = None
    skipped_steps: int | None = None
    loss_scale: float | None = None
    # Whether the logged loss scale rose at least once (None: the precision scales no loss).
    scale_grew: bool | None = None
    why: str = ""


@dataclass
class Trial:
    """One configuration's seeds and the paired verdict on them against fp32's."""

    precision: str
    keep_fp32: list[str]
    run_dir: str
    seeds: list[dict[str, Any]] = field(default_factory=list)
    verdict: str | None = None
    passed: bool = False
    why: str = ""
    # The tolerance the verdict used, in the unit of the task's quality metric.
    tolerance: dict[str, Any] | None = None
    # Each look of the sequential rule: its seeds, verdict and one-sided level; the last settled.
    looks: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, trial_dir: Path) -> Trial | None:
        """The trial recorded in ``trial_dir``; None when it never finished there."""
        path = trial_dir / TRIAL_FILE
        if not path.is_file():
            return None
        recorded = read_json(path)
        try:
            return cls(**recorded)
        except TypeError:  # not an object, or fields this class never wrote
            raise damaged(path, "its fields are not those amp_exp writes there") from None

    def save(self) -> None:
        write_json(Path(self.run_dir) / TRIAL_FILE, vars(self))


def verify_seeds(cfg: RunConfig, count: int | None = None) -> list[int]:
    """The seeds of a look at ``count`` seeds (the first look's, ``verify_seeds``, by default)."""
    count = cfg.sensitivity.verify_seeds if count is None else count
    return [cfg.seed + offset for offset in range(count)]


def verification_plan(cfg: RunConfig) -> Plan:
    """The evidence sweeper's plan for looks at verify_seeds .. max_verify_seeds seeds; one
    without calibrated levels stops the command in one line (exit 2)."""
    settings = cfg.sensitivity
    return Plan.of(
        settings.verify_seeds,
        settings.max_verify_seeds,
        ("sensitivity.verify_seeds", "sensitivity.max_verify_seeds"),
    )


def verification_config(cfg: RunConfig, precision: str, keep: list[str], seed: int) -> RunConfig:
    """``cfg`` as one short, quiet verification run: evaluated once at its end (the verdict's
    metric), no W&B, no checkpoints, no resume."""
    settings = cfg.sensitivity
    run = copy.deepcopy(cfg)
    run.seed = seed
    run.precision.name = precision
    run.precision.keep_fp32 = list(keep)
    run.precision.growth_interval = settings.verify_growth_interval
    run.trainer.max_steps, run.trainer.epochs = settings.verify_steps, None
    # A row at least every growth interval, so that a growth of the scale shows in the rows.
    run.trainer.log_every = min(run.trainer.log_every, settings.verify_growth_interval)
    run.trainer.eval_every = 0
    run.checkpoint.every_steps = None
    run.diagnostics.underflow_every = 0
    run.wandb.mode = WandbMode.disabled
    run.resume = None
    return run


def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows, _ = read_rows(run_dir / METRICS_FILE)
    return [row for row in rows if row.get("kind") == "train"]


def seed_record(seed: int, run_dir: Path, summary: dict[str, Any]) -> SeedRun:
    quality = (summary.get("task_metrics") or {}).get("quality")
    scales = [row["scale"] for row in train_rows(run_dir) if row.get("scale") is not None]
    return SeedRun(
        seed,
        str(run_dir),
        summary["status"],
        summary["final_loss"],
        summary.get(quality) if quality else None,
        summary["skipped_steps"],
        summary["loss_scale"],
        any(later > earlier for earlier, later in itertools.pairwise(scales)) if scales else None,
    )


def train_seed(cfg: RunConfig, run_dir: Path) -> SeedRun:
    """One verification run (``cfg`` from ``verification_config``), or the completed one its
    directory holds. A numerical fault is recorded in its summary.json as a failed run's is, so
    that the report's rules read it as the unstable seed it is."""
    done = completed_summary(run_dir)
    if done is not None:
        log.info("repair: %s completed before; read, not trained again", run_dir)
        return seed_record(cfg.seed, run_dir, done)
    try:
        summary = train(cfg, run_dir)
    except NumericalFault as fault:
        record_failure(run_dir, plain_run_config(cfg), fault, declared_metrics(cfg.task).as_dict())
        rows = train_rows(run_dir)
        last = rows[-1] if rows else {}
        return SeedRun(
            cfg.seed,
            str(run_dir),
            "numerical_fault",
            skipped_steps=last.get("skipped_steps"),
            loss_scale=last.get("scale"),
            why=f"stopped: {fault}",
        )
    if summary["stop_signal"] is not None:
        # The search stops with the run, whatever handler the signal displaced (none, called
        # in-process): a trial cut short is no evidence, and is never judged.
        raise Stopped(signal.Signals[summary["stop_signal"]])
    return seed_record(cfg.seed, run_dir, summary)


def train_seeds(cfg: RunConfig, trial: Trial, seeds: list[int]) -> Trial:
    """Train those of ``seeds`` the trial has not run yet (it stays unjudged). After a seed that
    failed, the rest are not run: every attempted seed counts, so the verdict is ``unstable``
    whatever they do."""
    ran = {seed["seed"] for seed in trial.seeds}
    if any(seed["status"] != Status.completed.value for seed in trial.seeds):
        return trial
    for seed in [seed for seed in seeds if seed not in ran]:
        run = verification_config(cfg, trial.precision, trial.keep_fp32, seed)
        found = train_seed(run, Path(trial.run_dir) / f"seed_{seed}")
        trial.seeds.append(vars(found))
        if found.status != Status.completed.value:
            trial.why = f"seed {seed} {found.why or f'ended {found.status}'}"
            break
    return trial


def judge(trial: Trial, reference: Trial, tolerance: float | None, plan: Plan) -> dict[str, Any]:
    """Set the trial's verdict, ``passed`` and why, and record the look; returns the report's
    comparison of the trial's seeds against fp32's (report/evidence.py), at the level of the
    plan's look at as many seeds (fp32 may have run more: only pairs count)."""
    parent = Path(trial.run_dir).parent
    runs = find_runs([Path(reference.run_dir), Path(trial.run_dir)])
    # No report.assign_settings: the runs differ in precision, the set kept and the seed alone,
    # and precision.keep_fp32 would make fp32 a setting of its own with nothing to pair.
    rows = comparison_rows(runs, parent)
    metrics = {os.path.relpath(run.path, parent): run.metrics for run in runs}
    _, (comparison,) = gather(rows, metrics, tolerance, trials=[], alpha=plan.alpha)
    trial.verdict, n = comparison["verdict"], comparison["n_attempted"]
    # A verdict its seeds forced (a failed seed: unstable) is no claim at a level.
    level = None if comparison["seed_verdict"] else plan.alpha(n, comparison["unit"])
    trial.looks.append({"seeds": n, "verdict": trial.verdict, "level": level})
    trial.passed = trial.verdict == Verdict.matches.value
    trial.why = quality_phrase(comparison)
    trial.tolerance = {
        "metric": comparison["metric"],
        "unit": comparison["unit"],
        "value": comparison["tolerance"],
    }
    grew = [seed["scale_grew"] for seed in trial.seeds if seed["scale_grew"] is not None]
    if grew and not any(grew):
        trial.why += "; the loss scale never grew in these runs"
    return comparison


def judge_reference(reference: Trial) -> Trial:
    """fp32's seeds: usable when every one completed with a finite loss and quality metric."""
    failed = [seed for seed in reference.seeds if seed["status"] != Status.completed.value]
    reference.passed = not failed and all(
        seed["final_loss"] is not None and seed["quality"] is not None for seed in reference.seeds
    )
    reference.verdict = None
    reference.why = (
        f"the fp32 reference, {len(reference.seeds)} seeds"
        if reference.passed
        else f"fp32 itself failed: {reference.why or 'no finite loss or eval metric'}"
    )
    return reference
