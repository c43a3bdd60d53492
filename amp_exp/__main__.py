"""Entry point: ``python -m amp_exp [overrides]`` and the ``amp-exp`` console script."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from amp_exp.cli import CONF_DIR, CONFIG_NAME, check_overrides
from amp_exp.config import ConfigError, register_configs, to_plain_dict, validate
from amp_exp.ranks import worker_rank
from amp_exp.sweep import sweep_job

log = logging.getLogger("amp_exp")


# Exit statuses: 0 done, 2 bad config or hardware request, 3 numerical fault (see the message),
# 128 + N when signal N stopped the run after a checkpoint (143 SIGTERM, 130 SIGINT, 138 SIGUSR1,
# 140 SIGUSR2); under submitit, SIGUSR2 requeues the job instead (amp_exp/signals.py).
EXIT_CONFIG_ERROR = 2
EXIT_NUMERICAL_FAULT = 3


# At import, not in main(): a submitit job unpickles hydra_main and composes its config without
# ever calling main().
register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=CONFIG_NAME)
def hydra_main(cfg: DictConfig) -> float | None:
    """One job: validate, train, and return the final loss for sweepers that optimize it."""
    from amp_exp.engine import NumericalFault
    from amp_exp.run import failure_summary, train, write_json

    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        summary = train(validate(cfg), output_dir, sweep=sweep_job(hydra_cfg))
    except Exception as error:
        # Every run leaves a summary.json, so a sweep report shows this one as failed.
        rank = worker_rank()
        if rank is None or rank.is_main:
            write_json(output_dir / "summary.json", failure_summary(to_plain_dict(cfg), error))
        one_line = isinstance(error, (ConfigError, NumericalFault))
        if hydra_cfg.mode == RunMode.MULTIRUN or not one_line:
            raise  # in a sweep, Hydra records this job as failed and runs the others
        log.error("%s", error)
        sys.exit(EXIT_CONFIG_ERROR if isinstance(error, ConfigError) else EXIT_NUMERICAL_FAULT)
    if summary["stop_signal"] is not None:
        sys.exit(128 + signal.Signals[summary["stop_signal"]])
    return summary["final_loss"]


def main() -> None:
    try:
        check_overrides(sys.argv[1:])
    except ConfigError as error:
        print(f"amp_exp: error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    hydra_main()


if __name__ == "__main__":
    main()
