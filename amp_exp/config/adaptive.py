"""The settings of what adapts to what it finds (their rules: config/values.py): the evidence
sweeper's seeds, the speed trial's stopping rule and trainer.compile=auto. A leaf, like the
schema that includes them (config/schema.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# trainer.compile's value besides true and false: compile on CUDA where the precision's row says
# it needs compiling to be fast (config/precisions.py's compile_on_cuda: fp8), eager elsewhere.
# The field is typed Any (a bool or this, checked in config/values.py): OmegaConf 2.3's Union
# nodes fail Hydra's merge.
COMPILE_AUTO = "auto"
# The speed trial's warm-up ends when the step times of two consecutive windows of this many
# steps show no trend (training/timing.py).
SPEED_WARMUP_WINDOW = 5


@dataclass
class SpeedStopping:
    """The speed trial's stopping rule (capability/ratio.py): from ``speed.rounds``, a look every 10
    rounds, stopping once the 97.5% interval of the mean log ratio is within
    +-``target_halfwidth``, or at ``max_rounds`` ("target not reached")."""

    # Even, so that each side runs first in exactly half the rounds: the first look's rounds.
    rounds: int = 10
    max_rounds: int = 20
    # ln 1.05: the speedup known within 5% either way.
    target_halfwidth: float = math.log(1.05)
    # Time each precision eager ([false]), compiled ([true]) or both ([false,true]), each against
    # eager fp32; null = as trainer.compile decides for each precision.
    compile: list[bool] | None = None


@dataclass
class EvidenceConfig:
    """The evidence sweeper (``hydra/sweeper=evidence``, hydra_plugins/_amp_exp_evidence.py):
    seeds added only to the cells whose verdict is still open."""

    # Seeds every cell runs before the first look (accuracy cells look first at 3: with one eval
    # example's floor, 2 seeds cannot decide).
    min_seeds: int = 2
    # The most seeds a cell runs. The looks planned, n = min_seeds .. max_seeds, set each look's
    # calibrated level (report/sequential.py); a resumed sweep may not raise it.
    max_seeds: int = 5
