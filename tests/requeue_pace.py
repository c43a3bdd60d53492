"""A Hydra callback for the requeue test, run inside the submitit job (see test_slurm.py).

The first attempt of a job trains slowly, at a known pace, so it is still training when submitit's
local controller sends SIGUSR2, however fast the machine; the requeued attempts (``resume=auto``,
which amp_exp's launcher adds) train at full speed, so the job finishes in a bounded time.
"""

from __future__ import annotations

import time
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SlowFirstAttempt(Callback):
    def __init__(self, seconds_per_step: float) -> None:
        self.seconds_per_step = seconds_per_step

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if "resume=auto" in config.hydra.overrides.task:
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(lambda *_: time.sleep(self.seconds_per_step))
