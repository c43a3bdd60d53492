"""Hydra registration: the schemas in the ConfigStore, amp_exp's resolvers and launchers.

``hydra/launcher=submitit_slurm|submitit_local`` are Hydra's submitit launchers, registered with
amp_exp's classes, whose requeued jobs resume. When SLURM (or submitit's local controller) warns a
job with SIGUSR2 before its time limit or on preemption, the run saves a checkpoint and hands the
signal to submitit (``runtime.signals``), which calls the launcher's ``checkpoint`` hook and
requeues what it returns. amp_exp's hook adds ``resume=auto``, so the requeued job continues from
its own checkpoint in its own output directory (the master config, resolver cache included,
travels with the job, so the timestamp in ``hydra.sweep.dir`` resolves to the same directory).
The launcher classes live in ``hydra_plugins._amp_exp_submitit``, where Hydra requires them; this
module only registers them, and only when the optional plugin is installed. Nothing here imports
submitit until a sweep launches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib.util import find_spec

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from omegaconf import OmegaConf

from amp_exp.config.help import help_text
from amp_exp.config.launch import register_resolvers
from amp_exp.config.schema import SCHEMAS, PredictConfig, RunConfig, SensitivityConfig

SCHEMA_GROUP = "schema"
# Optional: hydra/launcher=slurm and submitit_*.
SUBMITIT_PLUGIN = "hydra_plugins.hydra_submitit_launcher"


def register_configs() -> None:
    """Store the schemas under ``schema/<group>/`` so they never show up as group options, and
    register the resolvers conf/config.yaml uses."""
    register_resolvers()
    OmegaConf.register_new_resolver("amp_exp.help", help_text, replace=True)
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(group=f"{SCHEMA_GROUP}/{group}", name=name, node=schema)
    store.store(group=f"{SCHEMA_GROUP}/sensitivity", name="sensitivity", node=SensitivityConfig)
    store.store(group=f"{SCHEMA_GROUP}/predict", name="predict", node=PredictConfig)
    register_evidence_sweeper()
    # hydra/launcher=submitit_*: jobs that resume when requeued, if the optional plugin is there.
    if find_spec(SUBMITIT_PLUGIN) is not None:
        register_launchers()


def register_evidence_sweeper() -> None:
    """``hydra/sweeper=evidence``: seeds added only where a verdict is open (report/sequential);
    and ``hydra/sweeper=basic`` replaced by Hydra's own whose resumed jobs find their own
    directories (results/placement.py). Plugins are discovered first: discovery executes Hydra's
    core plugin modules again, replacing the basic sweeper's class and config entry."""
    plugins = Plugins.instance()
    from hydra_plugins._amp_exp_evidence import (
        EvidenceSweeper,
        EvidenceSweeperConf,
        PlacedSweeper,
        PlacedSweeperConf,
    )

    store = ConfigStore.instance()
    for sweeper, name, node in (
        (EvidenceSweeper, "evidence", EvidenceSweeperConf),
        (PlacedSweeper, "basic", PlacedSweeperConf),
    ):
        plugins.register(sweeper)
        store.store(group="hydra/sweeper", name=name, node=node, provider="amp_exp")


LAUNCHERS_MODULE = "hydra_plugins._amp_exp_submitit"


@functools.cache
def launcher_confs() -> dict[str, type]:
    """``hydra/launcher=``'s node for each launcher, our launcher class as its target (built on
    first use: the optional plugin's queue configs are their bases)."""
    from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf

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

    return {"submitit_slurm": SlurmConf, "submitit_local": LocalConf, "node": NodeConf}


def register_launchers() -> None:
    """Store ``hydra/launcher=submitit_slurm|submitit_local`` with our launchers as targets.

    Hydra's plugin discovery executes every ``hydra_plugins`` module, even one imported before
    (hydra 1.3 on Python 3.10+), and the plugin's ``config`` module stores its own entries under
    these names: so discover the plugins first (once per process), then replace those entries.
    """
    from hydra_plugins._amp_exp_submitit import LocalLauncher, NodeLauncher, SlurmLauncher

    plugins = Plugins.instance()
    store = ConfigStore.instance()
    confs = launcher_confs()
    launchers = {"submitit_slurm": SlurmLauncher, "submitit_local": LocalLauncher}
    for name, launcher in {**launchers, "node": NodeLauncher}.items():
        plugins.register(launcher)
        store.store(group="hydra/launcher", name=name, node=confs[name], provider="amp_exp")
