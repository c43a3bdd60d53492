"""A Hydra callback for the requeue test, run inside the submitit job (see test_slurm.py).

The first attempt of a job says when it trains (it writes its pid to ``marker`` before its first
optimizer step), so that the test sends it SIGUSR2 as SLURM warns a job before its time limit,
at once rather than after a fixed delay; it then trains slowly, at a known pace, so that it is
still training when the signal comes, however fast the machine. The requeued attempts
(``resume=auto``, which amp_exp's launcher adds) train at full speed and write no marker.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SlowFirstAttempt(Callback):
    def __init__(self, seconds_per_step: float, marker: str) -> None:
        self.seconds_per_step = seconds_per_step
        self.marker = Path(marker)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if "resume=auto" in config.hydra.overrides.task:
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def pace(*_: Any) -> None:
            if not self.marker.exists():
                # Written whole, then renamed: the test never reads half a pid.
                partial = self.marker.with_suffix(".partial")
                partial.write_text(str(os.getpid()))
                partial.rename(self.marker)
            time.sleep(self.seconds_per_step)

        register_optimizer_step_pre_hook(pace)
