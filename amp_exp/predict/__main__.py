"""``python -m amp_exp.predict [overrides]``: what each precision would cost per training step on
a GPU not at hand, from a roofline of one traced step (amp_exp/predict/roofline.py).

Composed by Hydra exactly as a run (``model=... dataset=... trainer.*``, the same checks before
anything is built), plus ``predict.*``: the devices of devices.py's table, the precisions
(fp32 and bf16, the speedups' baselines, always among them), the GPUs the batch is spread over
and their interconnect. The model is built on the meta device, so nothing is allocated: Llama-3
8B predicts on a laptop. Writes predict.md and predict.json into its run directory:

    python -m amp_exp.predict model=gpt2_small dataset=synthetic_tokens 'predict.devices=[b200]'
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from amp_exp.config.plain import plain_run_config
from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME
from amp_exp.config.schema import RunConfig
from amp_exp.config.store import register_configs
from amp_exp.config.values import validate
from amp_exp.predict.markdown import prediction_markdown
from amp_exp.predict.predict import predict_trace
from amp_exp.predict.trace import trace_step
from amp_exp.results import contract
from amp_exp.results.files import PREDICT_JSON, PREDICT_MD, write_json, write_text

log = logging.getLogger("amp_exp")

# Its own log file name, and no .hydra/ folder: a report of the directories around it must not
# take the prediction's directory for a training run that was killed (predict.json keeps the
# config).
HYDRA_OVERRIDES = ["hydra.job.name=predict", "hydra.output_subdir=null"]

register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=CONFIG_NAME)
def predict_main(cfg: DictConfig) -> None:
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    contract.run_job(lambda: write_prediction(validate(cfg), output_dir))


def write_prediction(cfg: RunConfig, output_dir: Path) -> None:
    """predict.md, then predict.json (the finished mark), and a line per device and precision."""
    found = predict_trace(cfg, trace_step(cfg))
    write_text(output_dir / PREDICT_MD, prediction_markdown(found))
    write_json(output_dir / PREDICT_JSON, {**found, "config": plain_run_config(cfg)})
    for key, device in found["devices"].items():
        for precision, row in device["precisions"].items():
            if row["why"]:
                log.info("%s %s: not predicted: %s", key, precision, row["why"])
                continue
            log.info(
                "%s %s: predicted %.4g s a step (x/÷ %.2f), %.3gx bf16, %.3gx fp32 (x/÷ %.2f), "
                "max batch %d",
                key,
                precision,
                row["step_time_s"],
                found["interval_factors"]["throughput"],
                row["speedup_vs_bf16"],
                row["speedup_vs_fp32"],
                found["interval_factors"]["speedup"],
                row["max_batch"],
            )
    log.info("prediction: %s", output_dir / PREDICT_MD)


def main() -> None:
    contract.start(
        "amp_exp.predict",
        predict_main,
        HYDRA_OVERRIDES,
        multirun_refusal="python -m amp_exp.predict predicts its devices and precisions in one "
        "process: list them in predict.devices=[...] and predict.precisions=[...] instead of "
        "sweeping with -m",
    )


if __name__ == "__main__":
    main()
