"""The settings of what adapts to what it finds (their rules: config/commands.py): the evidence
sweeper's seeds, the speed trial's stopping rule and trainer.compile=auto. A leaf, like the
schema that includes them (config/schema.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# trainer.compile's value besides true and false: compile on CUDA where the precision's row says
# it needs compiling to be fast (config/precisions.py's compile_on_cuda: fp8), eager elsewhere.
# The field is typed Any (a bool or this, checked in config/validate.py): OmegaConf 2.3's Union
# nodes fail Hydra's merge.
COMPILE_AUTO = "auto"


@dataclass
class SpeedStopping:
    """The speed trial's stopping rule (speed/ratio.py): from ``speed.rounds``, a look every 10
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
    # The most seeds a cell runs. The looks planned, max_seeds - min_seeds + 1, set the level of
    # every look's interval (Bonferroni: 1 - 0.05 / looks); a resumed sweep may not raise it.
    max_seeds: int = 5


def check_resumed_plan(evidence: EvidenceConfig, recorded: object) -> None:
    """Raise ``ConfigError`` unless an evidence sweep resumed with ``evidence`` keeps the plan it
    recorded (evidence.json's ``plan``): the same min_seeds, and max_seeds no higher. The looks
    planned set every look's level; more seeds would add looks the level did not pay for."""
    from amp_exp.errors import ConfigError

    plan = recorded if isinstance(recorded, dict) else {}
    before = (plan.get("min_seeds"), plan.get("max_seeds"))
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in before):
        raise ConfigError(
            f"evidence.json holds no plan this sweep can read ({plan!r}); resume only a sweep "
            "amp_exp wrote there, or start a new sweep"
        )
    if evidence.max_seeds > before[1] or evidence.min_seeds != before[0]:
        raise ConfigError(
            f"evidence.min_seeds={evidence.min_seeds} evidence.max_seeds={evidence.max_seeds}: "
            f"this sweep was planned with min_seeds={before[0]} and max_seeds={before[1]}, and "
            "its looks' level holds only for those; resume it with them, or start a new sweep"
        )
