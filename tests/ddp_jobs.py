"""Several jobs of tests/ddp_worker.py in one torchrun launch, one after another (``run_jobs``).

A launch costs about 7 s of CPU before its ranks train (torchrun's agent, each rank's fork and
its import of amp_exp) and seconds of wall time while they meet, so a test file whose checks are
about ranks starts its jobs together. Each job runs as ddp_worker.py would run it alone: its own
output directory, process group and injected faults; what ddp_worker patches for a job is put
back before the next. Its ranks' states move from OUTPUT_DIR/rank<r>.pt to STATES/<job>.rank<r>.pt
(a later job may write into the same directory, as a resume does), and a job whose ranks have all
saved theirs is skipped, so that a worker group torchrun restarts goes on with the job it failed
in.

Usage: torchrun --standalone --nproc_per_node=2 tests/ddp_jobs.py STATES JOBS_JSON, where
JOBS_JSON is a list of ddp_worker.py command lines (OUTPUT_DIR, then its options and overrides).
"""

from __future__ import annotations

import json
import os
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
    (amp_exp.build, "meter"),
    (Throughput, "_now"),
    (run, "build"),
    (run, "train_built"),
    (workload, "make_task"),
)
RANKS = (0, 1)


def state_file(states: Path, job: int, rank: int) -> Path:
    return states / f"{job}.rank{rank}.pt"


def run_jobs(states: Path, *jobs: list[str], restarts: int = 0) -> list[dict[int, dict]]:
    """Each job's ranks' final states (as ddp_worker.py saves them), from one two-rank launch;
    ``jobs``: ddp_worker.py command lines, ``states``: where their states go."""
    states.mkdir(parents=True, exist_ok=True)
    torchrun(f"--max-restarts={restarts}", __file__, str(states), json.dumps(jobs))
    return [
        {rank: torch.load(state_file(states, job, rank), weights_only=False) for rank in RANKS}
        for job in range(len(jobs))
    ]


def main() -> None:
    states, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for job, args in enumerate(jobs):
        if all(state_file(states, job, r).is_file() for r in range(world_size)):
            continue  # done before torchrun restarted the group
        kept = [(owner, name, vars(owner)[name]) for owner, name in PATCHED]
        sys.argv = [ddp_worker.__file__, *args]
        try:
            ddp_worker.main()
        finally:
            for owner, name, value in kept:
                setattr(owner, name, value)
        os.replace(Path(args[0]) / f"rank{rank}.pt", state_file(states, job, rank))


if __name__ == "__main__":
    main()
