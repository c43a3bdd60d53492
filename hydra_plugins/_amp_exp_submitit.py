"""amp_exp's submitit launchers: the plugin's, with a requeue that resumes.

Hydra instantiates a launcher only from a class defined in the ``hydra_plugins`` package, so the
classes live here, with their behaviour; ``amp_exp.config.store`` registers them. This module
imports nothing from amp_exp at import time. The leading underscore keeps Hydra's plugin
discovery from importing it (which would fail without the optional hydra-submitit-launcher).
"""

from __future__ import annotations

import copy
import os
import queue
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin

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
    from amp_exp.config.launch import PARALLEL_JOBS_ENV

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
