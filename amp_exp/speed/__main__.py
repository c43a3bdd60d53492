"""``python -m amp_exp.speed [overrides]``: how much faster than fp32 each precision trains a model.

Composed by Hydra exactly as a run (``model=... dataset=... trainer.device=...``, the same
checks before anything is built), plus ``speed.*``: the precisions to time (fp32, the baseline,
always among them), the warm-up's cap, steps per round and rounds (amp_exp/speed/trial.py). Writes
speed.json and speed.md into its run directory and prints each speedup with its 97.5% interval:

    python -m amp_exp.speed model=resnet18 'speed.precisions=[fp32,bf16,fp16]'
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from amp_exp.config.plain import plain_run_config
from amp_exp.config.precisions import REFERENCE
from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME
from amp_exp.config.schema import RunConfig
from amp_exp.config.store import register_configs
from amp_exp.config.values import validate
from amp_exp.results import contract
from amp_exp.results.files import SPEED_JSON, SPEED_MD, write_json, write_text
from amp_exp.speed.trial import run_trial, show_speedup, trial_markdown

log = logging.getLogger("amp_exp")

# Its own log file name, and no .hydra/ folder: a report of the directories around it must not
# take the trial's directory for a training run that was killed (speed.json keeps the config).
HYDRA_OVERRIDES = ["hydra.job.name=speed", "hydra.output_subdir=null"]

register_configs()


def candidates(cfg: RunConfig) -> dict[str, RunConfig]:
    """The run in each precision of ``speed.precisions``, fp32 first."""
    configs = {p: copy.deepcopy(cfg) for p in dict.fromkeys([REFERENCE, *cfg.speed.precisions])}
    for precision, config in configs.items():
        config.precision.name = precision
    return configs


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=CONFIG_NAME)
def speed_main(cfg: DictConfig) -> None:
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    contract.run_job(lambda: time_precisions(validate(cfg), output_dir))


def time_precisions(cfg: RunConfig, output_dir: Path) -> None:
    """The trial of ``cfg``'s precisions; speed.json, speed.md and a line per speedup."""
    trial = run_trial(candidates(cfg), cfg.speed)
    write_json(output_dir / SPEED_JSON, {"trials": [trial], "config": plain_run_config(cfg)})
    write_text(output_dir / SPEED_MD, trial_markdown([trial]))
    for label, found in trial["speedup"].items():
        log.info("%s: %s fp32's speed over %d rounds", label, show_speedup(found), found["rounds"])
    log.info("speed trial: %s", output_dir / SPEED_MD)


def main() -> None:
    contract.start(
        "amp_exp.speed",
        speed_main,
        HYDRA_OVERRIDES,
        multirun_refusal="python -m amp_exp.speed times its precisions in one process: list them "
        "in speed.precisions=[...] instead of sweeping with -m",
    )


if __name__ == "__main__":
    main()
