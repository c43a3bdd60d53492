"""amp_exp's submitit launchers: the plugin's, with a requeue that resumes.

``hydra/launcher=submitit_slurm|submitit_local`` are Hydra's submitit launchers with amp_exp's
classes, whose requeued jobs resume. When SLURM (or submitit's local controller) warns a job with
SIGUSR2 before its time limit or on preemption, the run saves a checkpoint and hands the signal to
submitit (``runtime.signals``), which calls the launcher's ``checkpoint`` hook and requeues what it
returns. amp_exp's hook adds ``resume=auto``, so the requeued job continues from its own
checkpoint in its own output directory (the master config, resolver cache included, travels with
the job, so the timestamp in ``hydra.sweep.dir`` resolves to the same directory).

Hydra instantiates a launcher only from a class defined in the ``hydra_plugins`` package, so the
classes live here, with their behaviour and their config nodes (``LAUNCHERS``); the entry point
(``amp_exp.__main__``) registers them when the optional plugin is installed. This module imports
nothing from amp_exp at import time. The leading underscore keeps Hydra's plugin discovery from
importing it (which would fail without the optional hydra-submitit-launcher).
"""

from __future__ import annotations

import copy
import os
import queue
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf

RESUME_KEY = "resume"
LAUNCHERS_MODULE = "hydra_plugins._amp_exp_submitit"


def with_resume(overrides: Sequence[str]) -> list[str]:
    """A job's overrides plus ``resume=auto``, unless they already say what ``resume`` is."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    if any(o.key_or_group == RESUME_KEY for o in parsed):
        return list(overrides)
    return [*overrides, f"{RESUME_KEY}=auto"]


class ResumeOnRequeue:
    """Mixin for the plugin's launchers: the requeued job resumes instead of starting over."""

    def __call__(self, sweep_overrides: Sequence[str], *args: Any, **kwargs: Any) -> JobReturn:
        # SLURM may also requeue a job itself (a node failure, preemption in requeue mode) and
        # rerun it as submitted, without our hook; its restart count gives that away.
        if int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0:
            sweep_overrides = with_resume(sweep_overrides)
        return super().__call__(sweep_overrides, *args, **kwargs)  # type: ignore[misc]

    def checkpoint(self, sweep_overrides: Sequence[str], *args: Any, **kwargs: Any) -> Any:
        # submitit calls this with the arguments of the job's __call__; the first are its overrides.
        return super().checkpoint(with_resume(sweep_overrides), *args, **kwargs)  # type: ignore[misc]


class LocalSignalDelay:
    """Mixin for the plugin's local launcher: ``signal_delay_s`` reaches submitit's controller.

    The controller sends SIGUSR2 ``signal_delay_s`` before ``timeout_min``, but the plugin builds
    an AutoExecutor, which only passes on the parameters ``LocalExecutor._valid_parameters()``
    lists, and in submitit 1.5 that is ``setup`` alone ("Unknown argument 'signal_delay_s'").
    """

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        with _local_parameter_accepted("signal_delay_s"):
            return super().launch(job_overrides, initial_job_idx)  # type: ignore[misc]


@contextmanager
def _local_parameter_accepted(*names: str) -> Iterator[None]:
    from submitit.local.local import LocalExecutor

    original = LocalExecutor.__dict__["_valid_parameters"]
    accepted = original.__func__(LocalExecutor) | set(names)
    LocalExecutor._valid_parameters = classmethod(lambda cls: accepted)  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalExecutor._valid_parameters = original  # type: ignore[method-assign]


def node_gpus() -> int:
    """The GPUs this node's jobs share (the sweep's process imported torch already)."""
    import torch

    return torch.cuda.device_count()


def job_setup(gpus: int, n_jobs: int, threads: int) -> list[str]:
    """Shell lines each job starts with: how many jobs share the node, and on a CPU node its
    share of the cores, so that n_jobs jobs do not fight over them (torch reads OMP_NUM_THREADS
    for its intra-op pool)."""
    from amp_exp.launch import PARALLEL_JOBS_ENV

    lines = [f"export {PARALLEL_JOBS_ENV}={n_jobs}"]
    if not gpus:
        lines += [f"export {name}={threads}" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")]
    return lines


class SlurmLauncher(ResumeOnRequeue, plugin.SlurmLauncher):
    """``hydra/launcher=submitit_slurm`` (and ``slurm``, amp_exp's preset)."""


class LocalLauncher(ResumeOnRequeue, LocalSignalDelay, plugin.LocalLauncher):
    """``hydra/launcher=submitit_local``: the same jobs, run by submitit on this machine."""


class NodeLauncher(LocalLauncher):
    """``hydra/launcher=node``: a sweep's jobs in parallel on this node, queued, one per GPU.

    Each job runs in a process of its own through submitit's local executor, which sets its
    CUDA_VISIBLE_DEVICES from ``visible_gpus``: here the one GPU of the slot the job holds, so
    no two running jobs share a device. On a CPU node ``n_jobs`` jobs run at once, each with
    ``threads_per_job`` threads (the cores over n_jobs by default). The rest wait for a slot.
    """

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        gpus = node_gpus() if self.params.get("gpus") is None else int(self.params["gpus"])
        n_jobs = self.params.get("n_jobs") or max(gpus, 1)
        if gpus:
            n_jobs = min(n_jobs, gpus)
        threads = self.params.get("threads_per_job") or max((os.cpu_count() or 1) // n_jobs, 1)
        slots: queue.Queue[int] = queue.Queue()
        for slot in range(n_jobs):
            slots.put(slot)

        def run(index: int, overrides: Sequence[str]) -> JobReturn:
            slot = slots.get()
            try:
                one = copy.copy(self)
                one.params = {
                    key: value
                    for key, value in self.params.items()
                    if key not in ("n_jobs", "gpus", "threads_per_job")
                }
                one.params["gpus_per_node"] = 1 if gpus else 0
                one.params["visible_gpus"] = [slot] if gpus else []
                one.params["setup"] = [
                    *self.params.get("setup", []),
                    *job_setup(gpus, n_jobs, threads),
                ]
                # The plugin's own launch, for one job: its controller process sets the env.
                (result,) = plugin.BaseSubmititLauncher.launch(one, [overrides], index)
                return result
            finally:
                slots.put(slot)

        # visible_gpus too: LocalExecutor reads it, AutoExecutor does not pass it on.
        accepted = _local_parameter_accepted("signal_delay_s", "visible_gpus")
        with accepted, ThreadPoolExecutor(n_jobs) as pool:
            futures = [
                pool.submit(run, initial_job_idx + i, overrides)
                for i, overrides in enumerate(job_overrides)
            ]
            return [future.result() for future in futures]


@dataclass
class SlurmConf(SlurmQueueConf):
    _target_: str = f"{LAUNCHERS_MODULE}.SlurmLauncher"


@dataclass
class LocalConf(LocalQueueConf):
    _target_: str = f"{LAUNCHERS_MODULE}.LocalLauncher"
    # submitit's LocalExecutor takes these two, with these defaults; the plugin's
    # LocalQueueConf leaves them out. SIGUSR2 comes this many seconds before timeout_min...
    signal_delay_s: int = 30
    # ...and a job is requeued at most this many times after timing out.
    max_num_timeout: int = 3


@dataclass
class NodeConf(LocalConf):
    _target_: str = f"{LAUNCHERS_MODULE}.NodeLauncher"
    # Jobs at once: null = one per GPU (all of them), or 1 on a CPU node; never more than
    # the GPUs. The rest are queued.
    n_jobs: int | None = None
    # null = torch.cuda.device_count(); 0 runs the jobs on the CPU.
    gpus: int | None = None
    # A CPU job's threads (OMP_NUM_THREADS); null = the cores over n_jobs.
    threads_per_job: int | None = None


# ``hydra/launcher=<name>``: each launcher's class and config node, registered by the entry point
# in place of the optional plugin's entries of the same names.
LAUNCHERS = {
    "submitit_slurm": (SlurmLauncher, SlurmConf),
    "submitit_local": (LocalLauncher, LocalConf),
    "node": (NodeLauncher, NodeConf),
}
