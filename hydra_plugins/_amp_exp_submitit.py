"""amp_exp's submitit launchers: the plugin's, with a requeue that resumes.

Hydra instantiates a launcher only from a class defined in the ``hydra_plugins`` package, so the
classes live here, with their behaviour; ``amp_exp.config.store`` registers them. This module
imports nothing from amp_exp. The leading underscore keeps Hydra's plugin discovery from importing
it (which would fail without the optional hydra-submitit-launcher).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
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
def _local_parameter_accepted(name: str) -> Iterator[None]:
    from submitit.local.local import LocalExecutor

    original = LocalExecutor.__dict__["_valid_parameters"]
    accepted = original.__func__(LocalExecutor) | {name}
    LocalExecutor._valid_parameters = classmethod(lambda cls: accepted)  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalExecutor._valid_parameters = original  # type: ignore[method-assign]


class SlurmLauncher(ResumeOnRequeue, plugin.SlurmLauncher):
    """``hydra/launcher=submitit_slurm`` (and ``slurm``, amp_exp's preset)."""


class LocalLauncher(ResumeOnRequeue, LocalSignalDelay, plugin.LocalLauncher):
    """``hydra/launcher=submitit_local``: the same jobs, run by submitit on this machine."""
