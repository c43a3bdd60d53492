"""Entry point: ``python -m amp_exp [overrides]`` and the ``amp-exp`` console script."""

from __future__ import annotations

import gc
import logging
import signal
import sys
from pathlib import Path

import hydra
from hydra._internal.utils import run_and_report
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from amp_exp.config.plain import plain_run_config, to_plain_dict
from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME, check_overrides
from amp_exp.config.store import register_configs
from amp_exp.config.validate import validate
from amp_exp.errors import (
    EXIT_CONFIG_ERROR,
    EXPECTED_ERRORS,
    ConfigError,
    RunRefused,
    RuntimeFault,
)
from amp_exp.runtime.ranks import worker_rank
from amp_exp.runtime.sweep import sweep_job

log = logging.getLogger("amp_exp")

# Exit statuses: 0 done; 2 bad config or hardware request, 3 numerical fault, 4 runtime fault
# (amp_exp.errors; the message says what to do); 128 + N when signal N stopped the run after a
# checkpoint (143 SIGTERM, 130 SIGINT, 138 SIGUSR1, 140 SIGUSR2); under submitit, SIGUSR2
# requeues the job instead (amp_exp/runtime/signals.py).


# At import, not in main(): a submitit job unpickles hydra_main and composes its config without
# ever calling main().
register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=CONFIG_NAME)
def hydra_main(cfg: DictConfig) -> float | None:
    """One job: validate, train, and return the final loss for sweepers that optimize it."""
    from amp_exp.results.summary import record_failure
    from amp_exp.run import train

    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    validated = None
    try:
        validated = validate(cfg)
        summary = train(validated, output_dir, sweep=sweep_job(hydra_cfg))
    except Exception as error:
        # Every run leaves a summary.json, so a sweep report shows this one as failed. Once
        # validated, the config has what validation inferred (the task).
        rank = worker_rank()
        if (rank is None or rank.is_main) and not isinstance(error, RunRefused):
            config = to_plain_dict(cfg) if validated is None else plain_run_config(validated)
            try:
                record_failure(output_dir, config, error)
            except RuntimeFault as unrecorded:  # the full disk that failed the run, say
                log.warning("%s", unrecorded)
        if hydra_cfg.mode == RunMode.MULTIRUN or not isinstance(error, EXPECTED_ERRORS):
            raise  # in a sweep, Hydra records this job as failed and runs the others
        log.error("%s", error)
        sys.exit(error.exit_status)
    if summary["stop_signal"] is not None:
        sys.exit(128 + signal.Signals[summary["stop_signal"]])
    return summary["final_loss"]


def main() -> None:
    # What is imported by now (torch, Hydra: some 300,000 objects) lives as long as the process:
    # kept out of the garbage collector's later full passes, each of which would walk it all
    # again (0.15 s of CPU apiece on this project's machine; a few come before the first step).
    gc.freeze()
    try:
        composed = check_overrides(sys.argv[1:])
    except ConfigError as error:
        print(f"amp_exp: error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    if composed is None:  # a sweep, or --cfg, --help and the like: Hydra composes on its own
        hydra_main()
    else:  # one run, from the config the pre-flight composed; errors reported as Hydra does
        run_and_report(lambda: composed.run(hydra_main))


if __name__ == "__main__":
    main()
