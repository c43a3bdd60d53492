"""Entry point: ``python -m amp_exp.sensitivity [overrides]``.

The same overrides as a run (``python -m amp_exp``), composed by Hydra from the same conf/ and
checked by the same pre-flight, plus ``sensitivity.*`` (config/values.py,
config/cross_checks.py). Its Hydra run directory lies under outputs/sensitivity/ unless
``hydra.run.dir`` says otherwise; exit statuses
are a run's (2 config, 3 numerical, 4 runtime, 128 + N after signal N). ``resume=auto`` in the
same directory continues an interrupted repair.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME
from amp_exp.config.store import register_configs
from amp_exp.config.values import validate
from amp_exp.results import contract

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
    contract.run_job(lambda: run_sensitivity(validate(cfg), output_dir))


def main() -> None:
    contract.start(
        "amp_exp.sensitivity",
        hydra_main,
        ENTRY_OVERRIDES,
        multirun_refusal="the sensitivity command measures one configuration; drop -m and run it "
        "once per configuration",
        single_process="the sensitivity command runs in one process; start it without torchrun",
        # An interrupted repair goes on from its recorded trials (sensitivity/repair.py).
        resumable=True,
    )


if __name__ == "__main__":
    main()
