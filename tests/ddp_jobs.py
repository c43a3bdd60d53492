"""Several jobs of tests/ddp_worker.py in one torchrun launch, one after another (``run_jobs``).

A launch costs about 7 s of CPU before its ranks train (torchrun's agent, each rank's fork and
its import of amp_exp) and seconds of wall time while they meet, so a test file whose checks are
about ranks starts its jobs together. Each job runs as ddp_worker.py would run it alone: its own
output directory, process group and injected faults; what ddp_worker patches for a job, and the
environment, are put back before the next. Its ranks' states move from OUTPUT_DIR/rank<r>.pt to
STATES/<job>.rank<r>.pt (a later job may write into the same directory, as a resume does), and a
job whose ranks have all saved theirs is skipped, so that a worker group torchrun restarts goes on
with the job it failed in.

Jobs that several test files want (``declare``) run in one launch for the whole test session
(``shared_jobs``), as each file's own would: with pytest-xdist, the first worker to ask starts
it and the others wait for its states.

Usage: torchrun --standalone --nproc_per_node=2 tests/ddp_jobs.py STATES JOBS_JSON, where
JOBS_JSON is a list of ddp_worker.py command lines (OUTPUT_DIR, then its options and overrides),
or of another worker script's, named first (a path ending in .py).
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import sys
from pathlib import Path

import torch

import amp_exp.build
import amp_exp.run as run
import ddp_worker
from amp_exp.tasks import workload
from amp_exp.training.meters import Throughput
from helpers.torchrun import torchrun

# What ddp_worker.main replaces for its job's faults and meters.
PATCHED = (
    (amp_exp.build, "Meter"),
    (Throughput, "_now"),
    (run, "build"),
    (run, "train_built"),
    (workload, "make_task"),
)
RANKS = (0, 1)


def state_file(states: Path, job: int, rank: int) -> Path:
    return states / f"{job}.rank{rank}.pt"


def run_jobs(
    states: Path, *jobs: list[str], restarts: int = 0, timeout: int = 300
) -> list[dict[int, dict]]:
    """Each job's ranks' final states (as ddp_worker.py saves them), from one two-rank launch;
    ``jobs``: ddp_worker.py command lines, ``states``: where their states go; ``timeout``: the
    launch's, in seconds."""
    states.mkdir(parents=True, exist_ok=True)
    torchrun(f"--max-restarts={restarts}", __file__, str(states), json.dumps(jobs), timeout=timeout)
    return [
        {rank: torch.load(state_file(states, job, rank), weights_only=False) for rank in RANKS}
        for job in range(len(jobs))
    ]


# The session's shared jobs, by name: (the worker script, or None for ddp_worker.py; its output
# directory's name; the worker's options and overrides), in the order the test modules declared
# them (every xdist worker imports them all, in one order).
DECLARED: dict[str, tuple[str | None, str, list[str]]] = {}


def declare(name: str, *args: str, directory: str | None = None, script: Path | None = None) -> str:
    """Adds a job to the session's shared launch: ``args`` as ddp_worker.py (or another worker
    ``script`` that saves OUTPUT_DIR/rank<r>.pt as it does) takes them after OUTPUT_DIR, which is
    ``directory`` (a resume names its stop's) or ``name``. Returns name."""
    DECLARED[name] = (script and str(script), directory or name, list(args))
    return name


def declare_stop_and_resume(
    name: str, *run: str, signal_at: int, stop: tuple[str, ...] = (), stop_signal: str | None = None
) -> tuple[str, str, str]:
    """Three jobs of ``run``: NAME_straight uninterrupted; NAME_stopped by ``stop_signal``
    (ddp_worker's default when None) to rank 1 during call ``signal_at`` of its loss, with ``stop``
    added; NAME_resumed in the stopped job's directory with ``stop`` and resume=auto. Returns
    their names: (straight, stopped, resumed)."""
    signal = ("--stop-signal", stop_signal) if stop_signal else ()
    directory = f"{name}_interrupted"
    return (
        declare(f"{name}_straight", *run),
        declare(
            f"{name}_stopped",
            "--signal-at",
            str(signal_at),
            *signal,
            *run,
            *stop,
            directory=directory,
        ),
        declare(f"{name}_resumed", *run, *stop, "resume=auto", directory=directory),
    )


def shared_jobs(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The root of the shared jobs' output directories and each declared job's ranks' final
    states, by name, from one two-rank launch per test session (``tmp_path_factory``: the
    session's). The ranks run this file and import neither pytest nor filelock."""
    import pytest
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by the workers of one session
    key = hashlib.sha256(json.dumps(DECLARED).encode()).hexdigest()[:12]
    root, names = base / f"shared_jobs_{key}", list(DECLARED)
    failed, done = root / "failed.txt", root / "done"
    with FileLock(f"{root}.lock"):
        if failed.is_file():
            pytest.fail(f"the shared launch failed in another worker: {failed.read_text()}")
        if not done.is_file():
            try:
                run_jobs(
                    root / "states",
                    *(
                        [*filter(None, [script]), str(root / directory), *args]
                        for script, directory, args in DECLARED.values()
                    ),
                    # A job whose rank dies in the first attempt wants torchrun's restart.
                    restarts=int(any("--die-at" in args for *_, args in DECLARED.values())),
                    # Some twenty jobs one after another: minutes on a loaded machine.
                    timeout=1200,
                )
            except Exception as error:  # a failed job, or the launch ran out of time
                root.mkdir(parents=True, exist_ok=True)
                failed.write_text(str(error)[-3000:])
                raise
            done.touch()
    return root, {
        name: {
            rank: torch.load(state_file(root / "states", job, rank), weights_only=False)
            for rank in RANKS
        }
        for job, name in enumerate(names)
    }


def main() -> None:
    states, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for job, args in enumerate(jobs):
        if all(state_file(states, job, r).is_file() for r in range(world_size)):
            continue  # done before torchrun restarted the group
        kept = [(owner, name, vars(owner)[name]) for owner, name in PATCHED]
        environment = dict(os.environ)  # ddp_worker --probe points XDG_CACHE_HOME elsewhere
        script = args.pop(0) if args[0].endswith(".py") else None
        sys.argv = [script or ddp_worker.__file__, *args]
        try:
            if script is None:
                ddp_worker.main()
            else:
                runpy.run_path(script, run_name="__main__")
        finally:
            for owner, name, value in kept:
                setattr(owner, name, value)
            os.environ.clear()
            os.environ.update(environment)
        os.replace(Path(args[0]) / f"rank{rank}.pt", state_file(states, job, rank))


if __name__ == "__main__":
    main()
