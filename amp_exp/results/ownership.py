"""Who owns a directory: one process at a time (its lock), and never over finished results.

- **One process at a time.** The lock is ``flock`` on ``LOCK_FILE`` in the directory, so the
  operating system releases it when the process dies, however it dies: a SIGKILLed run never
  leaves a stale lock behind. The file names the holder (pid and host), so a second process can
  say who is in the way. A process may take the lock of a directory it already holds:
  ``python -m amp_exp`` takes it in its pre-flight, before Hydra writes anything there, and the
  run takes it again when it starts. Two ``flock`` calls on two descriptors of one file conflict
  even within one process, so this process's locks are counted here instead.
- **A finished result is never overwritten.** Each command leaves a mark once its result is whole
  (``RESULT_FILES``; a training run's is a completed summary.json). A directory holding another
  command's result is refused; one holding the command's own takes only ``--force`` or, for a
  command that can continue, a resume. A run directory that holds a completed run, or the
  checkpoints of a run that can go on, takes only ``resume=auto`` of that run (``resume``); a
  completed run asked for the same training again has nothing to do, and one that saved no
  checkpoint cannot train further. A sweep directory that holds jobs of an earlier sweep takes
  only a sweep with ``resume=auto`` of the experiments it planned.
- **A refused command writes nothing.** The rules are checked before the lock is taken (its file
  holds its holder) and again under it; what was made for the lock is removed on refusal.
  ``python -m amp_exp`` applies them in its pre-flight (``claim``), before Hydra writes anything
  there (``.hydra/*.yaml``, ``train.log``): Hydra has no hook between choosing a job's directory
  and writing into it, so the pre-flight claims the directory Hydra will choose, resolved as Hydra
  resolves it. ``run.train`` applies them again under the same lock, for the jobs of a sweep and
  for runs started otherwise (a requeued SLURM job, a test calling ``train``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from amp_exp.config.cross_checks import check_resumed_plan
from amp_exp.config.plain import plain_run_config
from amp_exp.config.preflight import Launch
from amp_exp.config.schema import RunConfig
from amp_exp.errors import RunRefused, RuntimeFault, first_line
from amp_exp.launch import FAILED, rank0_decides, worker_rank
from amp_exp.results.checkpoint import candidates
from amp_exp.results.files import (
    EVIDENCE_JSON,
    MULTIRUN_SPEC,
    PREDICT_JSON,
    SENSITIVITY_JSON,
    SPEED_JSON,
    open_data,
    read_json,
)
from amp_exp.results.recorded import job_config
from amp_exp.results.resume import (
    check_same_experiment,
    checkpoint_at,
    nothing_to_do,
    resume_target,
    trained_values,
)
from amp_exp.results.summary import completed_summary

LOCK_FILE = ".amp_exp.lock"
# The flag with which a measuring command replaces its own finished results.
FORCE_FLAG = "--force"
# The file each measuring command writes last, once its result is whole: while it is absent the
# command did not finish there. A training run's mark is a completed summary.json.
RESULT_FILES = {
    "amp_exp.speed": SPEED_JSON,
    "amp_exp.sensitivity": SENSITIVITY_JSON,
    "amp_exp.predict": PREDICT_JSON,
}
# Less free space than this and Hydra cannot even write the job's config files before the run
# starts (about 10 KB), let alone its metrics, summary and checkpoints.
MIN_FREE_BYTES = 2**20
# Jobs of a sweep that differ in it alone are replicates; an evidence sweep chooses it.
REPLICATE_KEY = "seed"
# rank0_decides's answers: go ahead, or nothing to do (and why).
GO, DONE = "go", "done: "

# Directory -> [descriptor, how many holders in this process].
_held: dict[Path, list[int]] = {}


class RunDirectoryBusy(RunRefused):
    """Another live process is running in this directory; nothing here was touched."""


def busy(directory: Path, holder: str) -> RunDirectoryBusy:
    return RunDirectoryBusy(
        f"{directory} is in use by {holder}; wait for it to finish, or give this run its own "
        "directory (hydra.run.dir=...)"
    )


class FollowRank0(Exception):
    """Rank 0 refused the command and said why; this rank exits with its status, silently."""

    def __init__(self, exit_status: int) -> None:
        super().__init__(exit_status)
        self.exit_status = exit_status


def _holder(fd: int) -> str:
    """The holder a lock file names."""
    return os.read(fd, 200).decode(errors="replace").strip() or "another process"


def holder_of(directory: Path) -> str | None:
    """Who holds ``directory``'s lock now (another process), or None; creates nothing."""
    key = directory.resolve()
    if key in _held:
        return None
    try:
        fd = os.open(key / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file (no run ever held it), or one no run took: _acquire refuses it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)  # also drops the shared lock, if it was granted
    return None


def refuse_if_busy(directory: Path) -> None:
    holder = holder_of(directory)
    if holder is not None:
        raise busy(directory, holder)


class RunDirectoryLock:
    """The directory's lock, held for the block; this process may take it again meanwhile."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory.resolve()
        self.path = self.directory / LOCK_FILE

    def __enter__(self) -> RunDirectoryLock:
        if self.directory in _held:
            _held[self.directory][1] += 1
        else:
            _held[self.directory] = [self._acquire(), 1]
        return self

    def _acquire(self) -> int:
        # The holder's line is written into the lock: open_data refuses a link planted in its
        # place (the line would land in whatever it points at) and a FIFO, in one line.
        try:
            fd = open_data(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as error:
            raise self._unwritable(error) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise busy(self.directory, holder) from None
        except OSError as error:  # a full disk: no run can keep its results here
            os.close(fd)
            raise self._unwritable(error) from None
        return fd

    def _unwritable(self, error: OSError) -> RuntimeFault:
        reason = error.strerror or first_line(str(error))
        return RuntimeFault(
            f"cannot write {self.path} ({reason}); free some space there or choose another "
            "directory"
        )

    def __exit__(self, *exc: object) -> None:
        held = _held[self.directory]
        held[1] -= 1
        if held[1] == 0:
            # Closing releases the flock; the file stays, so a reader never races its removal.
            os.close(held[0])
            del _held[self.directory]


def finished_results(directory: Path) -> dict[str, str]:
    """Each command whose finished result ``directory`` holds, with that result in words."""
    found = {}
    completed = completed_summary(directory)
    if completed is not None:
        found["amp_exp"] = f"a completed run ({completed.get('steps')} steps)"
    if (directory / MULTIRUN_SPEC).is_file():
        # A sweep's own directory: its jobs, report and speed trial belong together, and a
        # command's files written among them would be taken for the sweep's.
        found["amp_exp -m"] = f"a sweep's results ({MULTIRUN_SPEC})"
    for command, name in RESULT_FILES.items():
        if (directory / name).is_file():
            found[command] = f"the finished results of python -m {command} ({name})"
    return found


def holdings(directory: Path) -> str | None:
    """What in ``directory`` a new run would overwrite, in words; None if nothing."""
    finished = finished_results(directory)
    if finished:
        return "; ".join(finished.values())
    found = candidates(directory)
    if found:
        return f"the checkpoints of a run that can go on ({found[0].relative_to(directory)})"
    return None


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
        refuse_if_busy(directory)
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
def hold_output(directory: Path, check: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold ``directory`` while the block writes into it, once ``check`` allows it. Alone, for a
    command whose files go beside others' results by design (the report beside its runs), only
    another process there refuses it (exit 2); the directories it reads are not held: they may
    be read-only, or in use."""
    with contextlib.ExitStack() as held:
        hold_directory(directory.expanduser().resolve(), check, held)
        yield


def claim_directory(
    command: str,
    directory: Path,
    force: bool = False,
    resumable: bool = False,
    resumes: bool = False,
) -> contextlib.AbstractContextManager[None]:
    """Hold ``directory`` for ``command`` (a measuring command) while the block runs. Another
    command's finished results refuse it (exit 2), and so do its own unless ``force`` replaces
    them or it ``resumes`` them (``resumable``: it can); a busy directory exit 2, a full one exit
    4, with nothing in it created or changed."""
    directory = directory.expanduser().resolve()

    def check() -> None:
        finished = finished_results(directory)
        others = [held for owner, held in finished.items() if owner != command]
        if others:
            raise RunRefused(
                f"{directory} holds {'; '.join(others)}; python -m {command} would mix its files "
                "with them: give it its own directory (hydra.run.dir=...)"
            )
        if command in finished and not (force or resumes):
            raise RunRefused(
                f"{directory} holds {finished[command]}; they stay as they are: give this one "
                "its own directory (hydra.run.dir=...), "
                f"{'continue them with resume=auto, ' if resumable else ''}or pass {FORCE_FLAG} "
                "to replace them"
            )

    return hold_output(directory, check)


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
    found = checkpoint_at(cfg, target, look=True)
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
        refuse_if_busy(job)
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
        found = read_json(path)  # read as data: the file may be anything
    except (OSError, ValueError) as error:
        raise RunRefused(f"{path} cannot be read ({error}); nothing was changed") from None
    return found if isinstance(found, dict) else {}


def check_same_sweep(jobs: list[RunConfig], directory: Path) -> None:
    """Refuse a sweep resumed in ``directory`` where a job directory holds an experiment this
    sweep does not plan: what it trains (resume.trained_values, the seed aside) must be a
    combination of the sweep's values. ``jobs`` use every value of every swept key."""
    values: dict[str, list[Any]] = {}
    for cfg in jobs:
        for key, value in trained_values(plain_run_config(cfg)).items():
            if value not in values.setdefault(key, []):
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
