"""``hydra/launcher=submitit_slurm|submitit_local``: Hydra's submitit launchers, registered with
amp_exp's classes, whose requeued jobs resume.

When SLURM (or submitit's local controller) warns a job with SIGUSR2 before its time limit or on
preemption, the run saves a checkpoint and hands the signal to submitit (``runtime.signals``),
which calls the launcher's ``checkpoint`` hook and requeues what it returns. amp_exp's hook adds
``resume=auto``, so the requeued job continues from its own checkpoint in its own output directory
(the master config, resolver cache included, travels with the job, so the timestamp in
``hydra.sweep.dir`` resolves to the same directory).

The launcher classes live in ``hydra_plugins._amp_exp_submitit``, where Hydra requires them; this
module only registers them. Nothing here imports submitit until a sweep launches.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf

LAUNCHERS_MODULE = "hydra_plugins._amp_exp_submitit"


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
