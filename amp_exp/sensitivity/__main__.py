"""Entry point: ``python -m amp_exp.sensitivity [overrides]``.

The same overrides as a run (``python -m amp_exp``), composed by Hydra from the same conf/ and
checked by the same pre-flight, plus ``sensitivity.*`` (config/sensitivity.py). Its Hydra run
directory lies under outputs/sensitivity/ unless ``hydra.run.dir`` says otherwise; exit statuses
are a run's (2 config, 3 numerical, 4 runtime).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME, check_overrides
from amp_exp.config.store import register_configs
from amp_exp.config.validate import validate
from amp_exp.errors import EXIT_CONFIG_ERROR, EXPECTED_ERRORS, ConfigError

log = logging.getLogger("amp_exp")

# Ahead of the user's overrides, which win over them as any later override does.
ENTRY_OVERRIDES = [
    "hydra.job.name=sensitivity",
    "hydra.run.dir=outputs/sensitivity/${amp_exp.launch_time:%Y-%m-%d}/"
    "${amp_exp.launch_time:%H-%M-%S}",
]

register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=CONFIG_NAME)
def hydra_main(cfg: DictConfig) -> None:
    from amp_exp.sensitivity.command import run_sensitivity

    output_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run_sensitivity(validate(cfg), output_dir)
    except EXPECTED_ERRORS as error:
        log.error("%s", error)
        sys.exit(error.exit_status)


def main() -> None:
    argv = sys.argv[1:]
    try:
        if {"-m", "--multirun"} & set(argv):
            raise ConfigError(
                "the sensitivity command measures one configuration; drop -m and run it once "
                "per configuration"
            )
        if os.environ.get("WORLD_SIZE", "1") != "1":
            raise ConfigError(
                "the sensitivity command runs in one process; start it without torchrun"
            )
        check_overrides([*ENTRY_OVERRIDES, *argv])
    except ConfigError as error:
        print(f"amp_exp.sensitivity: error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    sys.argv[1:] = [*ENTRY_OVERRIDES, *argv]
    hydra_main()


if __name__ == "__main__":
    main()
