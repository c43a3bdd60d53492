"""The repair search: which modules to keep in fp32 so that a precision trains, proven by runs.

Each candidate set is a trial: ``sensitivity.verify_seeds`` seeds in the target precision,
judged against the same seeds of fp32 (trained once, shared by every trial) by the sweep
report's paired verdict (sensitivity/verify.py). A set passes only on ``matches``. A trial whose
seeds all train but whose verdict is still open is settled before the search moves on: it gets
one seed more at a time (fp32 too, where it has not run it), up to
``sensitivity.max_verify_seeds``, under the evidence sweeper's sequential rule
(report/sequential.py): an undecided set needs more evidence, not a larger set.

The search: the modules as given first (``precision.keep_fp32``, possibly none); then the
ranking's most sensitive 1, 2, 4, ... modules added until a set passes; then each added module,
least sensitive first, taken out again only if the set without it passes too (the same
evidence). At most ``sensitivity.max_trials`` trials; a set already tried is not run again. If
every ranked module kept in fp32 still fails, the search stops and says so.

It stops and resumes like a run. A signal stops it after the current step of the current seed
(its handler is the run's: runtime/signals.py; the command exits 128 + N), and the interrupted
trial is not recorded, so never counted. ``resume=auto`` in the same directory replays the
recorded trials (``trial.json``, written atomically as each finishes), reads the seeds that
completed, and runs on from the interrupted trial: the search is deterministic given the
trials' outcomes, so it ends where an uninterrupted one would.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from amp_exp.config.plain import flatten_config, plain_run_config
from amp_exp.config.precisions import REFERENCE, get
from amp_exp.config.schema import RunConfig
from amp_exp.errors import RunRefused
from amp_exp.report.sequential import OPEN, RULE, Plan, still_open
from amp_exp.report.stats import Verdict
from amp_exp.results.files import read_json, write_json
from amp_exp.sensitivity.reference import Reference
from amp_exp.sensitivity.verify import (
    Trial,
    judge,
    judge_reference,
    train_seeds,
    verification_plan,
    verify_seeds,
)
from amp_exp.training.keep_fp32 import is_within, outermost

log = logging.getLogger("amp_exp")
VERIFY_DIR = "verify"
REFERENCE_DIR = REFERENCE
# What a search was started with; a resume must ask for the same, but for RESUMABLE.
SEARCH_FILE = "search.json"
# What a resume may change: whether to repair, how much to show, and how far to search.
RESUMABLE = (
    "config.sensitivity.repair",
    "config.sensitivity.show",
    "config.sensitivity.max_trials",
)
# Above this share of the FLOPs in fp32, a precision has not been made to train, fp32 has.
MOST_FLOPS = 0.5


def override_line(keep: list[str]) -> str:
    """The override to paste into a command, quoted for the shell (``[`` is a glob there)."""
    return f"'precision.keep_fp32=[{','.join(keep)}]'"


def trial_dir(verify_dir: Path, number: int) -> Path:
    return verify_dir / f"trial_{number:02d}"


class Search:
    """The trials of one repair, memoized by the set kept, bounded by ``max_trials``; those a
    resumed search finds recorded are replayed, not run again."""

    def __init__(self, cfg: RunConfig, precision: str, verify_dir: Path, reference: Trial) -> None:
        self.cfg, self.precision, self.verify_dir = cfg, precision, verify_dir
        self.reference = reference
        self.plan = verification_plan(cfg)
        self.trials: list[Trial] = []
        while (found := Trial.load(trial_dir(verify_dir, len(self.trials) + 1))) is not None:
            self.trials.append(found)
        self.recorded, self.replayed = len(self.trials), set[int]()
        self.tried: dict[frozenset[str], Trial] = {frozenset(t.keep_fp32): t for t in self.trials}

    @property
    def trials_left(self) -> int:
        return self.cfg.sensitivity.max_trials - len(self.trials)

    def passes(self, keep: list[str]) -> bool | None:
        """Whether the set ``keep`` in fp32 passes; None once no trial is left."""
        key = frozenset(keep)
        if key in self.tried:
            found = self.tried[key]
            number = self.trials.index(found) + 1
            if number <= self.recorded and number not in self.replayed:
                self.replayed.add(number)
                verdict = "passed" if found.passed else "failed"
                log.info("repair trial %d (recorded before): %s: %s", number, verdict, found.why)
            return found.passed
        if self.trials_left <= 0:
            return None
        number = len(self.trials) + 1
        log.info(
            "repair trial %d/%d: %s with %s, %d seeds",
            number,
            self.cfg.sensitivity.max_trials,
            self.precision,
            override_line(keep) if keep else "nothing kept in fp32",
            self.cfg.sensitivity.verify_seeds,
        )
        trial = self.settle(
            Trial(self.precision, list(keep), str(trial_dir(self.verify_dir, number)))
        )
        trial.save()
        verdict = "passed" if trial.passed else "failed"
        log.info("repair trial %d: %s: %s", number, verdict, trial.why)
        self.trials.append(trial)
        self.tried[key] = trial
        return trial.passed

    def settle(self, trial: Trial) -> Trial:
        """Train and judge the trial look by look, as the evidence sweeper does a cell: a seed
        more (and fp32's of it) while the verdict is open, until it is decided or
        max_verify_seeds is reached."""
        count = self.plan.min_seeds
        while True:
            seeds = verify_seeds(self.cfg, count)
            self.reference = extend_reference(self.cfg, self.reference, seeds)
            train_seeds(self.cfg, trial, seeds)
            comparison = judge(trial, self.reference, self.cfg.sensitivity.tolerance, self.plan)
            if not self.reference.passed or not still_open(comparison, self.plan):
                return trial
            log.info(
                "repair: %s on %d seeds is %s at the look's level (%.2f%% one-sided); "
                "one seed more, as the sequential rule allows",
                self.precision,
                comparison["n_attempted"],
                trial.verdict,
                100 * trial.looks[-1]["level"],
            )
            count += 1


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
        return None, (
            "no passing set within sensitivity.max_trials; raise it to search further "
            "(with resume=auto, from these trials on)"
        )
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
    return get(precision).spec.repair_to or REFERENCE


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


def start_search(cfg: RunConfig, verify_dir: Path, plan: dict[str, Any]) -> None:
    """Record what the search is asked (``plan``), or, resumed, check that it is what the
    recorded search was asked: its trials answer only that."""
    path = verify_dir / SEARCH_FILE
    if cfg.resume == "auto" and path.is_file():
        check_unchanged(read_json(path), plan, verify_dir, "a repair search")
        log.info("repair: resuming the search recorded in %s", verify_dir)
        return
    # Not resumed: --force said to replace what an earlier command left here.
    shutil.rmtree(verify_dir, ignore_errors=True)
    write_json(path, plan)


def check_unchanged(recorded: dict[str, Any], plan: dict[str, Any], where: Path, what: str) -> None:
    """Refuse to resume ``where``, which holds ``what`` of ``recorded``, when ``plan`` asks for
    another configuration: the flat keys whose values differ, but for ``resume`` (how to start,
    not what is asked) and ``RESUMABLE``."""
    old, new = flatten_config(recorded), flatten_config(plan)
    skipped = {"config.resume", *RESUMABLE}
    keys = [key for key in dict.fromkeys([*old, *new]) if key not in skipped]
    changed = [key for key in keys if old.get(key) != new.get(key)]
    if changed:
        raise RunRefused(
            f"resume=auto: {where} holds {what} of another configuration "
            f"({', '.join(changed)} changed); resume it with its values, or give this one "
            "its own directory (hydra.run.dir=...)"
        )


def fp32_reference(cfg: RunConfig, verify_dir: Path) -> Trial:
    """fp32's seeds, trained once and shared by every trial (recorded like a trial)."""
    recorded = Trial.load(verify_dir / REFERENCE_DIR)
    if recorded is not None:
        log.info("repair: the fp32 reference (recorded before): %s", recorded.why)
        return recorded
    log.info("repair: the fp32 reference, %d seeds", cfg.sensitivity.verify_seeds)
    reference = Trial(REFERENCE, [], str(verify_dir / REFERENCE_DIR))
    return extend_reference(cfg, reference, verify_seeds(cfg))


def extend_reference(cfg: RunConfig, reference: Trial, seeds: list[int]) -> Trial:
    """fp32's reference with every seed of ``seeds`` trained, recorded again when it grew."""
    ran = {seed["seed"] for seed in reference.seeds}
    if set(seeds) <= ran:
        return reference
    if ran:
        log.info("repair: the fp32 reference, seed(s) %s added", sorted(set(seeds) - ran))
    reference = judge_reference(train_seeds(cfg, reference, seeds))
    reference.save()
    return reference


def settled_phrase(settled: dict[str, Any], plan: Plan) -> str:
    """How the sequential rule ended the trial: decided at a look, or still open at the last;
    nothing where a failed seed decided it."""
    if settled["level"] is None:
        return ""
    at = (
        f"{settled['seeds']} seeds, the one-sided level {settled['level']:.2%} of look "
        f"{settled['look']}"
    )
    if settled["seeds"] >= plan.max_seeds and settled["verdict"] in OPEN:
        return (
            f"; still {settled['verdict']} on {at}, the last sensitivity.max_verify_seeds "
            "allows: raise it for more evidence"
        )
    return f" ({settled['verdict']} on {at} of the sequential rule)"


def repair(
    cfg: RunConfig,
    precision: str,
    candidates: list[str],
    reference: Reference,
    given: list[str],
    output_dir: Path,
) -> dict[str, Any]:
    """repair.json's content. ``candidates``: the ranked modules, most sensitive first."""
    settings = cfg.sensitivity
    log.info(
        "repair: searching which modules keep %s training, at most %d trials of %d to %d seeds "
        "x %d steps (growth interval %d), each judged against fp32's seeds by the report's "
        "verdict, a seed more while it is open (%s)",
        precision,
        settings.max_trials,
        settings.verify_seeds,
        settings.max_verify_seeds,
        settings.verify_steps,
        settings.verify_growth_interval,
        RULE,
    )
    verify_dir = output_dir / VERIFY_DIR
    plan = {
        "config": plain_run_config(cfg),
        "precision": precision,
        "given": given,
        "candidates": candidates,
    }
    start_search(cfg, verify_dir, plan)
    run = Search(cfg, precision, verify_dir, fp32_reference(cfg, verify_dir))
    keep, conclusion = search(run, given, [name for name in candidates if name not in given])
    kept_share = reference.flop_share(keep or [])
    sliver = keep is not None and is_sliver(keep, kept_share, candidates)
    if sliver:
        conclusion = sliver_conclusion(precision, keep, kept_share)
    # The evidence: the chosen set's trial, or, when none passed, the last one tried.
    final = run.tried.get(frozenset(keep)) if keep is not None else None
    final = final or (run.trials[-1] if run.trials else None)
    if keep is None and final is not None and final.verdict != Verdict.unstable.value:
        # The runs train: "nothing helps" would blame the model for what the evidence did not show.
        conclusion = (
            f"no set was verified: the {precision} runs of the last set tried train, but "
            f"the verdict on them is {final.verdict}, not matches (see why)"
        ) + ("; raise sensitivity.max_trials to search further" if run.trials_left <= 0 else "")
    # The look of the sequential rule that settled the verdict (the trial's last): seeds,
    # verdict, one-sided level (None where a failed seed forced the verdict).
    settled = {"look": len(final.looks), **final.looks[-1]} if final and final.looks else None
    if settled is not None:
        conclusion += settled_phrase(settled, run.plan)
    # A sliver's override is in repair.json; the line recommends the precision instead.
    shown = f": {override_line(keep)}" if keep and not sliver else ""
    log.info("repair: %s%s", conclusion, shown)
    if final is not None:
        log.info("repair: the verdict: %s", final.why)
    return {
        "precision": precision,
        # Only the report's matches on every seed verifies, and a set that keeps (nearly)
        # everything in fp32 proves fp32 trains, not the precision.
        "verified": keep is not None and not sliver,
        "verdict": None if final is None else final.verdict,
        "why": run.reference.why if final is None else final.why,
        "recommended_precision": next_up(precision) if sliver else None,
        "keep_fp32": keep,
        "override": override_line(keep) if keep else None,
        "low_precision_flop_share": None if kept_share is None else 1 - kept_share,
        "conclusion": conclusion,
        # The look of the sequential rule that decided the verdict above.
        "settled_by": settled,
        "criteria": {
            "rule": "the sweep report's paired verdict against fp32 is matches (docs/sweeps.md)",
            "sequential": {"rule": RULE, **asdict(run.plan)},
            # The first look's seeds; an open verdict adds one at a time up to max_seeds.
            "seeds": verify_seeds(cfg),
            "max_seeds": settings.max_verify_seeds,
            "steps": settings.verify_steps,
            "growth_interval": settings.verify_growth_interval,
            # As the verdict resolved it: sensitivity.tolerance, or the task's default.
            "tolerance": None if final is None else final.tolerance,
            "min_scale": cfg.precision.min_scale,
        },
        "reference": vars(run.reference),
        "trials": [vars(trial) for trial in run.trials],
        "trials_left": run.trials_left,
    }
