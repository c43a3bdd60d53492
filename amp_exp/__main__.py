"""Entry point: ``python -m amp_exp [overrides]`` and the ``amp-exp`` console script."""

from __future__ import annotations

import contextlib
import gc
import logging
import shlex
import signal
import sys
from importlib.util import find_spec
from pathlib import Path

import hydra
from hydra._internal.utils import run_and_report
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.types import RunMode
from omegaconf import DictConfig

from amp_exp.config.plain import plain_run_config, to_plain_dict
from amp_exp.config.precisions import REFERENCE
from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME, check_overrides
from amp_exp.config.store import SUBMITIT_PLUGIN, register_configs
from amp_exp.config.values import validate
from amp_exp.errors import (
    EXPECTED_ERRORS,
    WRITES_NOTHING,
    NumericalFault,
    RuntimeFault,
)
from amp_exp.launch import worker_rank
from amp_exp.results.contract import enter
from amp_exp.results.ownership import FollowRank0, claim
from amp_exp.results.sweep import sweep_job
from amp_exp.runtime.quiet import quiet_unactionable

log = logging.getLogger("amp_exp")

# Exit statuses: 0 done; 2 bad config or hardware request, 3 numerical fault, 4 runtime fault
# (amp_exp.errors; the message says what to do); 128 + N when signal N stopped the run after a
# checkpoint (143 SIGTERM, 130 SIGINT, 138 SIGUSR1, 140 SIGUSR2); under submitit, SIGUSR2
# requeues the job instead (amp_exp/runtime/signals.py).


# What each look of an evidence sweep runs: the report's verdicts, recorded, naming the next
# seeds. Named for Hydra to build, as conf/config.yaml names the sweep report's speed trial: the
# report is imported only when an evidence sweep starts.
EVIDENCE_LOOKS = {"_target_": "amp_exp.report.assemble.EvidenceLooks", "_partial_": True}


def register_plugins() -> None:
    """``hydra/sweeper=evidence`` (seeds only where a verdict is open), ``hydra/sweeper=basic``
    replaced by Hydra's own whose resumed jobs find their own directories
    (results/placement.py), and, when the optional plugin is installed,
    ``hydra/launcher=submitit_slurm|submitit_local|node``, whose requeued jobs resume.

    Hydra's plugin discovery executes every ``hydra_plugins`` module, even one imported before
    (hydra 1.3 on Python 3.10+), replacing the basic sweeper's class and config entry, and the
    submitit plugin's ``config`` module stores its own entries under our launchers' names: so
    discover the plugins first (once per process), then import and register ours over them (a
    sweeper built on the basic sweeper's class from before discovery is no longer its subclass)."""
    plugins = Plugins.instance()
    from hydra_plugins._amp_exp_evidence import (
        EvidenceSweeper,
        EvidenceSweeperConf,
        PlacedSweeper,
        PlacedSweeperConf,
    )

    entries = {
        ("hydra/sweeper", "evidence"): (EvidenceSweeper, EvidenceSweeperConf(looks=EVIDENCE_LOOKS)),
        ("hydra/sweeper", "basic"): (PlacedSweeper, PlacedSweeperConf),
    }
    if find_spec(SUBMITIT_PLUGIN) is not None:
        from hydra_plugins._amp_exp_submitit import LAUNCHERS

        entries |= {("hydra/launcher", name): found for name, found in LAUNCHERS.items()}
    store = ConfigStore.instance()
    for (group, name), (plugin, node) in entries.items():
        plugins.register(plugin)
        store.store(group=group, name=name, node=node, provider="amp_exp")


# At import, not in main(): a submitit job unpickles hydra_main and composes its config without
# ever calling main().
register_configs()
register_plugins()
quiet_unactionable()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=CONFIG_NAME)
def hydra_main(cfg: DictConfig) -> float | None:
    """One job: validate, train, and return the final loss for sweepers that optimize it."""
    from amp_exp.results.summary import record_failure
    from amp_exp.run import train
    from amp_exp.tasks.workload import declared_metrics

    # A log record that train.log cannot take (a full disk) must not print a traceback of its
    # own: the run meets the same disk where it writes its results, and says so in one line.
    logging.raiseExceptions = False
    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    validated = None
    try:
        validated = validate(cfg)
        summary = train(validated, output_dir, sweep=sweep_job(hydra_cfg))
    except Exception as caught:
        error = caught
        # fp32 has nothing to keep in fp32: its faults are the model's or the optimizer's.
        if isinstance(error, NumericalFault) and validated.precision.name != REFERENCE:
            error = with_sensitivity_hint(error, list(hydra_cfg.overrides.task))
        # Every run leaves a summary.json, so a sweep report shows this one as failed. Once
        # validated, the config has what validation inferred (the task).
        rank = worker_rank()
        if (rank is None or rank.is_main) and not isinstance(error, WRITES_NOTHING):
            config = to_plain_dict(cfg) if validated is None else plain_run_config(validated)
            declared = None if validated is None else declared_metrics(validated.task).as_dict()
            try:
                record_failure(output_dir, config, error, declared)
            except RuntimeFault as unrecorded:  # the full disk that failed the run, say
                if not isinstance(error, RuntimeFault):
                    log.warning("%s", unrecorded)
        if hydra_cfg.mode == RunMode.MULTIRUN or not isinstance(error, EXPECTED_ERRORS):
            raise  # in a sweep, Hydra records this job as failed and runs the others
        log.error("%s", error)
        sys.exit(error.exit_status)
    if summary["stop_signal"] is not None:
        sys.exit(128 + signal.Signals[summary["stop_signal"]])
    return summary["final_loss"]


def with_sensitivity_hint(fault: NumericalFault, overrides: list[str]) -> NumericalFault:
    """The fault, ending with the command that finds which modules to keep in fp32: this
    run's overrides, but for where Hydra writes and what it resumes."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "resume="))]
    command = shlex.join(["python", "-m", "amp_exp.sensitivity", *kept, "sensitivity.repair=true"])
    return NumericalFault(f"{fault}. To find the modules to keep in fp32: {command}")


def main() -> None:
    """Pre-flight, then the command's directory claimed, then Hydra: a command refused at any
    of the first two steps has written nothing (results/ownership.py)."""
    # What is imported by now (torch, Hydra: some 300,000 objects) lives as long as the process:
    # kept out of the garbage collector's later full passes, each of which would walk it all
    # again (0.15 s of CPU apiece on this project's machine; a few come before the first step).
    gc.freeze()
    # A run stops on a signal after its step, through its own handler (runtime/signals.py).
    sys.exit(enter("amp_exp", launch_run, signals=False))


def launch_run() -> int | None:
    with contextlib.ExitStack() as held:
        try:
            launch = check_overrides(sys.argv[1:])
            done = None if launch is None else held.enter_context(claim(launch))
        except FollowRank0 as refused:
            return refused.exit_status  # rank 0 said why, in one line
        if done is not None:
            print(f"amp_exp: {done}")
            return None
        if launch is None or launch.composed is None:  # --cfg, --help, or a sweep: Hydra composes
            hydra_main()
        else:  # one run, from the config the pre-flight composed; errors reported as Hydra does
            composed = launch.composed
            run_and_report(lambda: composed.run(hydra_main))
    return None


if __name__ == "__main__":
    main()
