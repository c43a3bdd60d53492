"""Hydra's submitit launchers, with a checkpoint hook that makes a requeued job resume.

When SLURM (or submitit's local controller) warns a job with SIGUSR2 before its time limit or on
preemption, the run saves a checkpoint and hands the signal to submitit (``amp_exp.signals``),
which calls the launcher's ``checkpoint`` hook and requeues what it returns. The plugin's hook
requeues the job as it was submitted, which would start it over; ours adds ``resume=auto``, so the
requeued job continues from its own checkpoint, in its own output directory (the master config,
resolver cache included, travels with the job, so the timestamp in ``hydra.sweep.dir`` resolves
to the same directory).

The launcher classes themselves live in ``hydra_plugins._amp_exp_submitit``, where Hydra requires
them. Nothing here imports submitit until a sweep launches.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
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
def _local_parameter_accepted(name: str) -> Iterator[None]:
    from submitit.local.local import LocalExecutor

    original = LocalExecutor.__dict__["_valid_parameters"]
    accepted = original.__func__(LocalExecutor) | {name}
    LocalExecutor._valid_parameters = classmethod(lambda cls: accepted)  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalExecutor._valid_parameters = original  # type: ignore[method-assign]


@dataclass
class SlurmConf(SlurmQueueConf):
    _target_: str = f"{LAUNCHERS_MODULE}.SlurmLauncher"


@dataclass
class LocalConf(LocalQueueConf):
    _target_: str = f"{LAUNCHERS_MODULE}.LocalLauncher"
    # submitit's LocalExecutor takes these two, with these defaults; the plugin's LocalQueueConf
    # leaves them out. SIGUSR2 comes this many seconds before timeout_min...
    signal_delay_s: int = 30
    # ...and a job is requeued at most this many times after timing out.
    max_num_timeout: int = 3


def register_launchers() -> None:
    """Store ``hydra/launcher=submitit_slurm|submitit_local`` with our launchers as targets.

    Hydra's plugin discovery executes every ``hydra_plugins`` module, even one imported before
    (hydra 1.3 on Python 3.10+), and the plugin's ``config`` module stores its own entries under
    these names: so discover the plugins first (once per process), then replace those entries.
    """
    from hydra_plugins._amp_exp_submitit import LocalLauncher, SlurmLauncher

    plugins = Plugins.instance()
    store = ConfigStore.instance()
    for name, launcher, node in (
        ("submitit_slurm", SlurmLauncher, SlurmConf),
        ("submitit_local", LocalLauncher, LocalConf),
    ):
        plugins.register(launcher)
        store.store(group="hydra/launcher", name=name, node=node, provider="amp_exp")
