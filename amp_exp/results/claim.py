"""Whether a command may run in a run directory, decided before anything is written there.

What a directory holds decides what may run in it:

- **A finished result is never overwritten.** A directory that holds a completed run's
  summary.json, or the checkpoints of a run that can go on, takes only a resume of that run
  (``resume=auto``): a fresh start, or a resume from somewhere else, is refused (exit 2). A
  completed run asked for the same training again has nothing to do; one that saved no checkpoint
  cannot train further. A sweep directory that holds jobs of an earlier sweep takes only a sweep
  with ``resume=auto``.
- **A resume continues one experiment,** from the newest checkpoint that loads, which must be of
  the same experiment (``resume_rules``); when checkpoints exist and none of them loads, the
  command stops (exit 4).

``python -m amp_exp`` applies these rules in its pre-flight (``claim``), holding the directory's
lock, before Hydra writes anything there (``.hydra/*.yaml``, ``train.log``), so a refused command
writes nothing. Hydra has no hook between choosing a job's directory and writing into it; the
pre-flight claims the directory Hydra will choose, resolved as Hydra resolves it. ``run.train``
applies the same rules again under the same lock, for the jobs of a sweep and for runs started
otherwise (a requeued SLURM job, a test calling ``train``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from amp_exp.config.commands import check_resumed_plan
from amp_exp.config.plain import plain_run_config
from amp_exp.config.preflight import Launch
from amp_exp.config.schema import RunConfig
from amp_exp.errors import ConfigError, NoCheckpointLoads, RunRefused, RuntimeFault
from amp_exp.results.checkpoint import (
    UnusableCheckpoints,
    candidates,
    checkpoint_dir,
    load_newest_valid,
)
from amp_exp.results.files import EVIDENCE_JSON
from amp_exp.results.finished import finished_results
from amp_exp.results.lock import (
    LOCK_FILE,
    RunDirectoryBusy,
    RunDirectoryLock,
    busy_message,
    holder_of,
)
from amp_exp.results.recorded import job_config
from amp_exp.results.resume_rules import config_changes, trained_values
from amp_exp.results.summary import completed_summary
from amp_exp.runtime.launch import FAILED, rank0_decides, worker_rank

# Less free space than this and Hydra cannot even write the job's config files before the run
# starts (about 10 KB), let alone its metrics, summary and checkpoints.
MIN_FREE_BYTES = 2**20
# Jobs of a sweep that differ in it alone are replicates; an evidence sweep chooses it.
REPLICATE_KEY = "seed"
# rank0_decides's answers: go ahead, or nothing to do (and why).
GO, DONE = "go", "done: "


class FollowRank0(Exception):
    """Rank 0 refused the command and said why; this rank exits with its status, silently."""

    def __init__(self, exit_status: int) -> None:
        super().__init__(exit_status)
        self.exit_status = exit_status


def resume_target(cfg: RunConfig, directory: Path) -> Path | None:
    """What ``resume=`` points at: the run directory (auto), a path, or None (a fresh start)."""
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        return directory.resolve()
    target = Path(cfg.resume).expanduser().resolve()
    if not target.exists():
        raise ConfigError(f"resume={cfg.resume}: no such file or directory")
    return target


def check_same_experiment(cfg: RunConfig, saved: Any, source: str) -> list[str]:
    """Refuse ``cfg`` if it changes what ``saved`` (a plain config) trained; returns the changes
    it may make."""
    saved = saved if isinstance(saved, dict) else {}
    refused, allowed = config_changes(saved, plain_run_config(cfg))
    if refused:
        raise RunRefused(
            f"resume={cfg.resume}: {source} belongs to another experiment "
            f"({'; '.join(refused)}); these cannot change on resume, so resume with the "
            f"{source.removeprefix('the ')}'s values or start a new run directory"
        )
    return allowed


def find_checkpoint(
    cfg: RunConfig, target: Path, look: bool = False
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint a resume starts from, of the same experiment; None when ``resume=auto``
    finds none at all. ``look``: only a look at it (load_newest_valid)."""
    try:
        found = load_newest_valid(target, look)
    except UnusableCheckpoints as error:
        raise NoCheckpointLoads(
            f"resume={cfg.resume}: no checkpoint in {checkpoint_dir(target)} loads ({error}); "
            "nothing was changed. Move the files away to start over"
        ) from None
    if found is None:
        if cfg.resume != "auto":
            raise ConfigError(f"resume={cfg.resume}: no usable checkpoint there")
        return None
    check_same_experiment(cfg, found[1].get("config"), "the checkpoint")
    return found


def nothing_to_do(cfg: RunConfig, step: Any) -> str:
    return (
        f"resume={cfg.resume}: this run completed at step {step}; nothing to do, its results "
        "stay as they are"
    )


def holdings(directory: Path) -> str | None:
    """What in ``directory`` a new run would overwrite, in words; None if nothing."""
    finished = finished_results(directory)
    if finished:
        return "; ".join(finished.values())
    found = candidates(directory)
    if found:
        return f"the checkpoints of a run that can go on ({found[0].relative_to(directory)})"
    return None


def asks_for_the_same(cfg: RunConfig, completed: dict[str, Any], world_size: int) -> bool:
    """Whether ``cfg`` trains as long as the completed run did: it then has nothing to do."""
    config = completed.get("config")
    trainer = config.get("trainer") if isinstance(config, dict) else None
    if not isinstance(trainer, dict):
        return False
    asked = (cfg.trainer.max_steps, cfg.trainer.epochs, world_size)
    return asked == (trainer.get("max_steps"), trainer.get("epochs"), completed.get("world_size"))


def check_directory(cfg: RunConfig, directory: Path, world_size: int) -> str | None:
    """Raise if ``cfg`` may not run in ``directory`` as it stands (``RunRefused``, or
    ``RuntimeFault`` when no checkpoint loads); returns why there is nothing to do, or None."""
    directory = directory.resolve()
    target = resume_target(cfg, directory)
    resumes_here = target is not None and (target == directory or directory in target.parents)
    if not resumes_here and (held := holdings(directory)):
        raise RunRefused(
            f"{directory} holds {held}; a new run there would overwrite it: continue it with "
            "resume=auto (a larger trainer.max_steps trains on), or give this run its own "
            "directory (hydra.run.dir=...)"
        )
    if target is None:
        return None
    found = find_checkpoint(cfg, target, look=True)
    completed = completed_summary(directory) if resumes_here else None
    if completed is None:
        return None
    if found is None:
        check_same_experiment(cfg, completed.get("config"), "the completed run")
    if asks_for_the_same(cfg, completed, world_size):
        return nothing_to_do(cfg, completed.get("steps"))
    if found is None:
        raise RunRefused(
            f"resume={cfg.resume}: {directory} holds a run that completed at step "
            f"{completed.get('steps')} and saved no checkpoint to go on from; give a longer run "
            "its own directory"
        )
    return None


def check_sweep_directory(jobs: list[RunConfig], directory: Path) -> None:
    """A sweep never overwrites the jobs of an earlier sweep there; ``resume=auto`` continues
    them, as the sweep they belong to: each job directory must hold an experiment of this sweep,
    and an evidence sweep keeps its recorded plan. A job directory in use stops the sweep before
    its first job."""
    if not directory.is_dir():
        return
    held = []
    for job in sorted(path for path in directory.iterdir() if path.is_dir()):
        holder = holder_of(job)
        if holder is not None:
            raise RunDirectoryBusy(busy_message(job, holder))
        if holdings(job):
            held.append(job.name)
    if held and any(cfg.resume != "auto" for cfg in jobs):
        raise RunRefused(
            f"hydra.sweep.dir={directory} holds the results of an earlier sweep (jobs "
            f"{', '.join(held)}); a new sweep there would overwrite them: continue it with "
            "resume=auto, or give this sweep its own directory (hydra.sweep.dir=...)"
        )
    check_same_sweep(jobs, directory)
    plan = read_evidence_plan(directory)
    if plan is not None:
        check_resumed_plan(jobs[0].evidence, plan.get("plan"))


def read_evidence_plan(directory: Path) -> dict[str, Any] | None:
    """An evidence sweep's evidence.json in ``directory``, or None where there is none."""
    path = directory / EVIDENCE_JSON
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise RunRefused(f"{path} cannot be read ({error}); nothing was changed") from None
    return found if isinstance(found, dict) else {}


def check_same_sweep(jobs: list[RunConfig], directory: Path) -> None:
    """Refuse a sweep resumed in ``directory`` where a job directory holds an experiment this
    sweep does not plan: what it trains (resume_rules.trained_values, the seed aside) must be a
    combination of the sweep's values. ``jobs`` use every value of every swept key."""
    planned = [trained_values(plain_run_config(cfg)) for cfg in jobs]
    values: dict[str, list[Any]] = {}
    for job in planned:
        for key, value in job.items():
            values.setdefault(key, [])
            if value not in values[key]:
                values[key].append(value)
    for job in sorted(path for path in directory.iterdir() if path.is_dir()):
        recorded = job_config(job)
        if not recorded:
            continue
        found = trained_values(recorded)
        differ = [
            f"{key}: {json.dumps(found.get(key))} -> {json.dumps(values.get(key, [None])[0])}"
            for key in sorted(values.keys() | found.keys())
            if key != REPLICATE_KEY and found.get(key) not in values.get(key, [None])
        ]
        if differ:
            raise RunRefused(
                f"hydra.sweep.dir={directory}: job {job.name} holds an experiment this sweep "
                f"does not plan ({'; '.join(differ[:3])}); resume the sweep with the values it "
                "ran, or give this sweep its own directory (hydra.sweep.dir=...)"
            )


def check_free_space(directory: Path) -> None:
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    # Some network and FUSE file systems report no sizes at all (f_blocks 0): nothing to judge.
    if stats.f_blocks and free < MIN_FREE_BYTES:
        raise RuntimeFault(
            f"{directory} has {free // 1024} KiB free, and a run needs at least "
            f"{MIN_FREE_BYTES // 2**20} MiB for its config, log and results; free some space "
            "or choose another directory"
        )


def make_directory(directory: Path) -> Path | None:
    """Create ``directory``; returns the topmost folder that did not exist before, or None."""
    top = next((p for p in reversed([directory, *directory.parents]) if not p.exists()), None)
    if top is not None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise RuntimeFault(f"cannot create {directory} ({error.strerror})") from None
    return top


def unmake_directory(directory: Path, top: Path | None) -> None:
    """Undo ``make_directory`` for a refused command: what it made holds only the lock file."""
    if top is None:
        return
    with contextlib.suppress(OSError):
        (directory / LOCK_FILE).unlink()
    for folder in [directory, *directory.parents]:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only empty folders go
        if folder == top:
            return


def hold_directory(
    directory: Path, check: Callable[[], str | None], held: contextlib.ExitStack
) -> str | None:
    """Take ``directory``'s lock into ``held`` once ``check`` (which raises to refuse, or says
    why there is nothing to do) allows the command there; returns what ``check`` said.

    ``check`` runs first without the lock, whose file holds its holder, so a refused command
    leaves even that file as it was, and again under the lock, where no other process can change
    the directory; a refusal then undoes what was made, so a refused command has written nothing.
    """
    if directory.is_dir():
        holder = holder_of(directory)
        if holder is not None:
            raise RunDirectoryBusy(busy_message(directory, holder))
        done = check()
        if done is not None:
            return done
    made = make_directory(directory)
    try:
        held.enter_context(RunDirectoryLock(directory))
        check_free_space(directory)
        return check()
    except BaseException:
        held.close()
        unmake_directory(directory, made)
        raise


@contextlib.contextmanager
def claim(launch: Launch) -> Iterator[str | None]:
    """Hold the command's run (or sweep) directory for as long as the command runs, once its
    rules allow the command there; yields why there is nothing to do, or None. When refused it
    raises, having written nothing; under torchrun rank 0 decides and the others follow."""
    if not launch.output_dir.resolved:
        yield None  # the job's directory is known only inside the job: the run checks it there
        return
    directory = Path(launch.output_dir.value).expanduser().resolve()
    rank = worker_rank()

    def check() -> str | None:
        if launch.multirun:
            check_sweep_directory(launch.jobs, directory)
            return None
        return check_directory(launch.jobs[0], directory, rank.world_size if rank else 1)

    with contextlib.ExitStack() as held:

        def decide() -> str:
            done = hold_directory(directory, check, held)
            return GO if done is None else DONE + done

        verdict = rank0_decides(decide)
        if verdict.startswith(FAILED):
            raise FollowRank0(int(verdict.split()[-1]))
        yield verdict.removeprefix(DONE) if verdict.startswith(DONE) else None
