"""The repair search: which modules to keep in fp32 so that a precision trains, proven by runs.

Each candidate set is verified by a short training run in the target precision (``run.train``,
the same engine as any run, in its own directory under ``verify/``), against one fp32 run of the
same steps. A run passes when it completes without a loss-scale collapse (NumericalFault), skips
at most ``sensitivity.max_skipped_steps`` steps, and ends with a loss within
``sensitivity.loss_tolerance`` (relative) of fp32's over the same last log interval.

The search: the modules as given first (``precision.keep_fp32``, possibly none); then the
ranking's most sensitive 1, 2, 4, ... modules added until a run passes; then each added module,
least sensitive first, taken out again if the run still passes without it. At most
``sensitivity.max_trials`` runs in the target precision; a set already tried is not run again.
If every ranked module kept in fp32 still fails, the search stops and says so.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amp_exp.config.precisions import REFERENCE, spec_of
from amp_exp.config.schema import RunConfig, WandbMode
from amp_exp.errors import NumericalFault
from amp_exp.results.files import METRICS_FILE
from amp_exp.run import train
from amp_exp.sensitivity.reference import Reference
from amp_exp.training.keep_fp32 import is_within, outermost

log = logging.getLogger("amp_exp")
VERIFY_DIR = "verify"
# Above this share of the FLOPs in fp32, a precision has not been made to train, fp32 has.
MOST_FLOPS = 0.5


@dataclass
class Trial:
    """One verification run and its verdict."""

    precision: str
    keep_fp32: list[str]
    run_dir: str
    status: str
    final_loss: float | None = None
    skipped_steps: int | None = None
    loss_scale: float | None = None
    passed: bool = False
    why: str = ""


def verification_config(cfg: RunConfig, precision: str, keep: list[str]) -> RunConfig:
    """``cfg`` as a short, quiet run: no W&B, no checkpoints, no evaluation, no resume."""
    run = copy.deepcopy(cfg)
    run.precision.name = precision
    run.precision.keep_fp32 = list(keep)
    steps = cfg.sensitivity.verify_steps
    run.trainer.max_steps, run.trainer.epochs = steps, None
    run.trainer.log_every = min(run.trainer.log_every, steps)
    run.trainer.eval_every = None
    run.checkpoint.every_steps = None
    run.diagnostics.underflow_every = 0
    run.wandb.mode = WandbMode.disabled
    run.resume = None
    return run


def last_train_row(run_dir: Path) -> dict[str, Any]:
    """The newest train row of a run that stopped before writing its summary."""
    path = run_dir / METRICS_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return next((row for row in reversed(rows) if row.get("kind") == "train"), {})


def verify(cfg: RunConfig, precision: str, keep: list[str], run_dir: Path) -> Trial:
    """One short run of ``cfg`` in ``precision`` with ``keep`` in fp32 (not yet judged)."""
    try:
        summary = train(verification_config(cfg, precision, keep), run_dir)
    except NumericalFault as fault:
        row = last_train_row(run_dir)
        return Trial(
            precision,
            keep,
            str(run_dir),
            "numerical_fault",
            skipped_steps=row.get("skipped_steps"),
            loss_scale=row.get("scale"),
            why=f"stopped: {fault}",
        )
    return Trial(
        precision,
        keep,
        str(run_dir),
        summary["status"],
        summary["final_loss"],
        summary["skipped_steps"],
        summary["loss_scale"],
    )


def judge(trial: Trial, reference: Trial, cfg: RunConfig) -> Trial:
    """Set ``trial.passed`` and say why, against the fp32 reference run."""
    settings = cfg.sensitivity
    if trial.status != "completed":
        trial.why = trial.why or f"the run ended {trial.status}"
        return trial
    if trial.skipped_steps is not None and trial.skipped_steps > settings.max_skipped_steps:
        trial.why = (
            f"{trial.skipped_steps} skipped steps, more than sensitivity.max_skipped_steps="
            f"{settings.max_skipped_steps}"
        )
        return trial
    if trial.loss_scale is not None and trial.loss_scale < cfg.precision.min_scale:
        trial.why = f"loss scale {trial.loss_scale:g} fell below precision.min_scale"
        return trial
    loss, expected = trial.final_loss, reference.final_loss
    if loss is None or expected is None or not math.isfinite(loss):
        trial.why = f"final loss {loss} is not a finite number"
        return trial
    gap = abs(loss - expected) / abs(expected)
    trial.passed = gap <= settings.loss_tolerance
    trial.why = (
        f"final loss {loss:.4f} vs fp32 {expected:.4f} ({100 * gap:.1f}%, tolerance "
        f"{100 * settings.loss_tolerance:g}%), {trial.skipped_steps} skipped steps"
    )
    return trial


def override_line(keep: list[str]) -> str:
    """The override to paste into a command, quoted for the shell (``[`` is a glob there)."""
    return f"'precision.keep_fp32=[{','.join(keep)}]'"


class Search:
    """The trials of one repair, memoized by the set kept, bounded by ``max_trials``."""

    def __init__(self, cfg: RunConfig, precision: str, verify_dir: Path, reference: Trial) -> None:
        self.cfg, self.precision, self.verify_dir = cfg, precision, verify_dir
        self.reference = reference
        self.trials: list[Trial] = []
        self.tried: dict[frozenset[str], Trial] = {}

    @property
    def trials_left(self) -> int:
        return self.cfg.sensitivity.max_trials - len(self.trials)

    def passes(self, keep: list[str]) -> bool | None:
        """Whether a run with ``keep`` in fp32 passes; None once no trial is left."""
        key = frozenset(keep)
        if key in self.tried:
            return self.tried[key].passed
        if self.trials_left == 0:
            return None
        number = len(self.trials) + 1
        log.info(
            "repair trial %d/%d: %s with %s",
            number,
            self.cfg.sensitivity.max_trials,
            self.precision,
            override_line(keep) if keep else "nothing kept in fp32",
        )
        run_dir = self.verify_dir / f"trial_{number:02d}"
        trial = judge(verify(self.cfg, self.precision, keep, run_dir), self.reference, self.cfg)
        verdict = "passed" if trial.passed else "failed"
        log.info("repair trial %d: %s: %s", number, verdict, trial.why)
        self.trials.append(trial)
        self.tried[key] = trial
        return trial.passed


def judge_reference(trial: Trial) -> Trial:
    trial.passed = trial.status == "completed" and trial.final_loss is not None
    trial.why = "the fp32 reference" if trial.passed else f"fp32 itself failed: {trial.why}"
    return trial


def search(run: Search, given: list[str], candidates: list[str]) -> tuple[list[str] | None, str]:
    """The set to keep (None: none found) and what the search concluded."""
    if not run.reference.passed:
        return None, f"the fp32 reference run did not train ({run.reference.why}): nothing to match"
    outcome = run.passes(given)
    if outcome and given:
        return given, (
            f"the run passes with the {len(given)} module(s) precision.keep_fp32 keeps in fp32; "
            "whether fewer would do was not searched (the given set is never pruned)"
        )
    if outcome:
        return given, "the run passes as it is: no module needs to be kept in fp32"
    found, size = None, 1
    while found is None and outcome is not None:
        keep = outermost([*given, *candidates[:size]])
        outcome = run.passes(keep)
        if outcome:
            found = keep
        elif size >= len(candidates):
            return None, (
                f"nothing helps: with all {len(candidates)} ranked modules kept in fp32 the "
                f"{run.precision} run still fails; the cause lies outside the measured "
                "modules (the loss, parameter-free ops, the optimizer or the learning rate)"
            )
        size *= 2
    if found is None:
        return None, "no passing set within sensitivity.max_trials; raise it to search further"
    # Least sensitive first: the likeliest to be unneeded.
    for name in [n for n in reversed(candidates) if n in found and n not in given]:
        fewer = [kept for kept in found if kept != name]
        outcome = run.passes(fewer)
        if outcome is None:
            break
        if outcome:
            found = fewer
    return found, f"verified: {run.precision} trains with these modules in fp32"


def next_up(precision: str) -> str:
    """The next precision up (its facts' ``repair_to``: bf16, fp32's range with more bits than
    fp8 or fp16), else fp32."""
    return spec_of(precision).repair_to or REFERENCE


def is_sliver(keep: list[str], kept_share: float | None, candidates: list[str]) -> bool:
    """Whether the kept set leaves the precision only a sliver of the model: more than
    ``MOST_FLOPS`` of its FLOPs, or every ranked module."""
    every = bool(candidates) and all(is_within(name, keep) for name in candidates)
    return every or (kept_share is not None and kept_share > MOST_FLOPS)


def sliver_conclusion(precision: str, keep: list[str], kept_share: float | None) -> str:
    share = "every ranked module" if kept_share is None else f"{kept_share:.0%} of the FLOPs"
    return (
        f"{precision} does not train here beyond a sliver of the model: the run passes only "
        f"with {len(keep)} module(s) in fp32, {share}; use precision={next_up(precision)} "
        "instead"
    )


def repair(
    cfg: RunConfig,
    precision: str,
    candidates: list[str],
    reference: Reference,
    given: list[str],
    output_dir: Path,
) -> dict[str, Any]:
    """repair.json's content. ``candidates``: the ranked modules, most sensitive first."""
    log.info(
        "repair: searching which modules keep %s training, at most %d runs of %d steps",
        precision,
        cfg.sensitivity.max_trials,
        cfg.sensitivity.verify_steps,
    )
    verify_dir = output_dir / VERIFY_DIR
    log.info("repair: the fp32 reference run")
    fp32 = judge_reference(verify(cfg, REFERENCE, [], verify_dir / "fp32"))
    run = Search(cfg, precision, verify_dir, fp32)
    keep, conclusion = search(run, given, [name for name in candidates if name not in given])
    kept_share = reference.flop_share(keep or [])
    sliver = keep is not None and is_sliver(keep, kept_share, candidates)
    if sliver:
        conclusion = sliver_conclusion(precision, keep, kept_share)
    # A sliver's override is in repair.json; the line recommends the precision instead.
    shown = f": {override_line(keep)}" if keep and not sliver else ""
    log.info("repair: %s%s", conclusion, shown)
    return {
        "precision": precision,
        # A set that keeps (nearly) everything in fp32 proves fp32 trains, not the precision.
        "verified": keep is not None and not sliver,
        "recommended_precision": next_up(precision) if sliver else None,
        "keep_fp32": keep,
        "override": override_line(keep) if keep else None,
        "low_precision_flop_share": None if kept_share is None else 1 - kept_share,
        "conclusion": conclusion,
        "criteria": {
            "verify_steps": cfg.sensitivity.verify_steps,
            "max_skipped_steps": cfg.sensitivity.max_skipped_steps,
            "loss_tolerance": cfg.sensitivity.loss_tolerance,
            "min_scale": cfg.precision.min_scale,
        },
        "reference": vars(run.reference),
        "trials": [vars(trial) for trial in run.trials],
        "trials_left": run.trials_left,
    }
