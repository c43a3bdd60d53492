"""Which worker of a data-parallel job this process is, and the names all workers must agree on.

torchrun starts one process per rank and each one composes its own Hydra config. The run
directory must be the same for all of them, so its timestamp cannot be each process's own clock:
the first worker to ask publishes its launch time in torchrun's rendezvous store and every worker
uses that one. This module stays free of torch at import time because Hydra resolves these names
before a run starts.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from omegaconf import OmegaConf

from amp_exp.errors import ConfigError

# Under the agent's store, beside torchrun's own keys; the run id keeps separate jobs apart, and
# leaving out the restart count keeps a worker group restarted by torchrun in the same directory.
LAUNCH_TIME_KEY = "amp_exp/launch_time/{run_id}"
# Rank 0's verdict on a command, per attempt: a worker group torchrun restarts asks again.
VERDICT_KEY = "amp_exp/verdict/{run_id}/{attempt}"
FAILED = "failed"
# Each worker's host and pid, so that a rank whose peer died can say which one.
PID_KEY = "amp_exp/pid/{run_id}/{attempt}/{rank}"
STORE_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class WorkerRank:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# A process that trains by itself: all of the data is its share.
ALONE = WorkerRank(0, 1, 0)


def worker_rank() -> WorkerRank | None:
    """This process's place in a data-parallel job, or None when it trains alone.

    torchrun describes it in RANK, WORLD_SIZE and LOCAL_RANK; a submitit job with several tasks
    (SLURM's ntasks, or the local executor's tasks_per_node) in submitit's job environment.
    """
    if "WORLD_SIZE" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR"):
        import submitit

        job = submitit.JobEnvironment()
        if job.num_tasks <= 1:
            return None
        return WorkerRank(job.global_rank, job.num_tasks, job.local_rank)
    world_size = environment_int("WORLD_SIZE", "1")
    if world_size < 1:
        # Not one process either: a 0 trained alone would hide a launcher's mistake.
        raise ConfigError(f"WORLD_SIZE={world_size} must be 1 or more; {TORCHRUN_SETS_THEM}")
    if world_size == 1:
        return None
    if "RANK" not in os.environ:
        raise ConfigError(f"WORLD_SIZE={world_size} is set but RANK is not; {TORCHRUN_SETS_THEM}")
    rank, local_rank = environment_int("RANK"), environment_int("LOCAL_RANK", "0")
    # Out of range, a rank no other waits for: the process group would hang until its timeout.
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"RANK={rank} must lie in 0 to {world_size - 1} (WORLD_SIZE={world_size}); "
            f"{TORCHRUN_SETS_THEM}"
        )
    if local_rank < 0:
        raise ConfigError(f"LOCAL_RANK={local_rank} must be 0 or more; {TORCHRUN_SETS_THEM}")
    return WorkerRank(rank, world_size, local_rank)


TORCHRUN_SETS_THEM = "start data-parallel runs with torchrun, which sets them"


def environment_int(name: str, default: str | None = None) -> int:
    """The whole number in environment variable ``name``; ConfigError (exit 2) in one line
    where it is not one, not int()'s traceback."""
    value = os.environ.get(name, default)
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a whole number; {TORCHRUN_SETS_THEM}") from None


def torchrun_store(timeout: timedelta | None = None):
    """A client of the key-value store torchrun's agent keeps for its workers (waiting up to
    ``timeout``, or torch's default), or None when this process is not a torchrun worker."""
    if worker_rank() is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed import TCPStore

    waits = {} if timeout is None else {"timeout": timeout}
    return TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, **waits
    )


@functools.cache
def launch_time() -> datetime:
    """When this job started: the same instant in every worker of a torchrun job."""
    now = datetime.now()
    store = torchrun_store(STORE_TIMEOUT)
    if store is None:
        return now
    key = LAUNCH_TIME_KEY.format(run_id=os.environ.get("TORCHELASTIC_RUN_ID", "none"))
    # compare_set with an empty expected value writes only if the key is absent: first one wins.
    agreed = store.compare_set(key, "", now.isoformat())
    return datetime.fromisoformat(agreed.decode())


def rank0_decides(decide: Callable[[], str]) -> str:
    """``decide()`` on rank 0, and what it returned on every other worker of a torchrun job.

    For what one process must decide for all, before anything else runs: the others wait for
    the answer in torchrun's store. Outside torchrun (or its agent's store) every process
    decides for itself. If rank 0 raises, the others get ``failed <its exit status>``.
    """
    rank, store = worker_rank(), torchrun_store(STORE_TIMEOUT)
    if rank is None or store is None:
        return decide()
    key = _attempt_key(VERDICT_KEY)
    if not rank.is_main:
        return store.get(key).decode()
    try:
        verdict = decide()
    except BaseException as error:
        store.set(key, f"{FAILED} {getattr(error, 'exit_status', 1)}")
        raise
    store.set(key, verdict)
    return verdict


def _attempt_key(template: str, **names: object) -> str:
    return template.format(
        run_id=os.environ.get("TORCHELASTIC_RUN_ID", "none"),
        attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        **names,
    )


def publish_pid() -> None:
    """Say in torchrun's store which process on which host this worker is (nothing outside)."""
    rank, store = worker_rank(), torchrun_store(STORE_TIMEOUT)
    if rank is not None and store is not None:
        store.set(_attempt_key(PID_KEY, rank=rank.rank), f"{socket.gethostname()} {os.getpid()}")


def peer_pids() -> dict[int, int]:
    """The pid of every other worker of this torchrun attempt on this host that published one."""
    rank, store = worker_rank(), torchrun_store(STORE_TIMEOUT)
    if rank is None or store is None:
        return {}
    found = {}
    for other in range(rank.world_size):
        key = _attempt_key(PID_KEY, rank=other)
        if other != rank.rank and store.check([key]):
            host, _, pid = store.get(key).decode().rpartition(" ")
            if host == socket.gethostname():
                found[other] = int(pid)
    return found


# Set by hydra/launcher=node (hydra_plugins/_amp_exp_submitit.py) in each job it runs.
PARALLEL_JOBS_ENV = "AMP_EXP_PARALLEL_JOBS"


def launch_slot() -> dict[str, object]:
    """How many jobs shared this node with this one, the device it was given and its threads:
    a job timed beside others was timed under contention (the report says so)."""
    return {
        "parallel_jobs": int(os.environ.get(PARALLEL_JOBS_ENV, "1")),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def log_file_suffix() -> str:
    """Workers share the run directory; each one but rank 0 logs to a file of its own."""
    rank = worker_rank()
    return "" if rank is None or rank.is_main else f".rank{rank.rank}"


def register_resolvers() -> None:
    """``${amp_exp.launch_time:%H-%M-%S}`` and ``${amp_exp.log_suffix:}`` for conf/config.yaml."""
    # Cached like Hydra's ${now:}: a submitit job rebuilds its config from the launcher's and
    # copies only cached values over, so only a cached sweep directory stays the launcher's.
    OmegaConf.register_new_resolver(
        "amp_exp.launch_time",
        lambda pattern: launch_time().strftime(pattern),
        replace=True,
        use_cache=True,
    )
    OmegaConf.register_new_resolver("amp_exp.log_suffix", log_file_suffix, replace=True)
