"""amp_exp's submitit launchers: the plugin's, with a requeue that resumes (amp_exp.launchers).

Hydra instantiates a launcher only from a class defined in the ``hydra_plugins`` package, so the
classes live here and their behaviour in ``amp_exp.launchers``. The leading underscore keeps
Hydra's plugin discovery from importing this module (which would fail without the optional
hydra-submitit-launcher): ``amp_exp.launchers.register_launchers`` registers the classes.
"""

from __future__ import annotations

from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin

from amp_exp.launchers import LocalSignalDelay, ResumeOnRequeue


class SlurmLauncher(ResumeOnRequeue, plugin.SlurmLauncher):
    """``hydra/launcher=submitit_slurm`` (and ``slurm``, amp_exp's preset)."""


class LocalLauncher(ResumeOnRequeue, LocalSignalDelay, plugin.LocalLauncher):
    """``hydra/launcher=submitit_local``: the same jobs, run by submitit on this machine."""
