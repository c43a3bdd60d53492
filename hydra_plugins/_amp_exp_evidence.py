"""``hydra/sweeper=evidence``: seeds added only to the cells whose verdict is still open; and
``hydra/sweeper=basic``, Hydra's own, whose resumed jobs each find their own directory.

A Hydra sweeper that launches in batches, as Hydra's Optuna and Ax sweepers do: the first batch
runs ``evidence.min_seeds`` seeds of every cell (each combination of the swept values, Hydra's
basic expansion, fp32 among them); after each batch it builds the report's verdicts at the level
of its looks and launches the next seed of each open cell with its fp32 pair (the rule, the plan
and evidence.json: amp_exp/report/sequential.py), until no cell is open. The launcher is the
sweep's own (basic, joblib, submitit), so a batch may run in parallel.

Resumed (``resume=auto``), it plans again from its command line and replays its looks: each look's
verdicts come from the jobs of that look and those before it, so a sweep killed at any point and
resumed takes the looks, seeds and verdicts the uninterrupted sweep takes. Each job goes to the
directory that holds what it trains (results/placement.py); a job completed there is not launched
again, any other (killed, stopped) is. Nothing a job directory holds becomes an override: a job's
overrides come from the sweep's command line and config alone.

Hydra instantiates a sweeper only from a class in the ``hydra_plugins`` package; the leading
underscore keeps its plugin discovery from importing this module in every Hydra process. The
entry point (``amp_exp.__main__``) registers it and hands in the looks (``Looks``), the report's
verdicts: this module runs jobs and never reads a result itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("amp_exp")

SEED = "seed"
Cell = tuple[str, ...]


@dataclass
class EvidenceSweeperConf:
    _target_: str = "hydra_plugins._amp_exp_evidence.EvidenceSweeper"
    # What to sweep, as the basic sweeper's params (a preset's precision: fp32,bf16,...).
    params: dict[str, str] | None = None
    # A ``Looks`` factory, as a ``_target_`` with ``_partial_: true``: the entry point names it.
    looks: Any = None


@dataclass
class PlacedSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins._amp_exp_evidence.PlacedSweeper"


class PlacedSweeper(BasicSweeper):
    """Hydra's basic sweeper; resumed in a directory that holds its jobs, it sends each job to
    the directory that holds what it trains, and launches none whose run completed there
    (results/placement.py). A fresh sweep is numbered as Hydra numbers it."""

    placement: Any = None

    def get_job_batch(self) -> list[list[str]]:
        from amp_exp.results.placement import numbered

        batch = [list(job) for job in super().get_job_batch()]
        if self.placement is None:
            self.placement = placement_of(self.config, self.hydra_context)
        if not self.placement.held or not numbered(self.config):
            return batch
        return [placed for job in batch if (placed := self.placement.place(job)[1]) is not None]


def placement_of(config: DictConfig, hydra_context: HydraContext) -> Any:
    from amp_exp.results.placement import Placement

    def compose(overrides: list[str]) -> DictConfig:
        return hydra_context.config_loader.load_sweep_config(config, overrides)

    return Placement(Path(config.hydra.sweep.dir), compose)


class Looks(Protocol):
    """What the sweeper asks at each look; built with ``sweep_dir``, ``min_seeds``, ``max_seeds``,
    ``tolerance`` and ``familywise`` (amp_exp/report/assemble.py ``EvidenceLooks``)."""

    # The seeds every cell runs before the first look: the plan's (a resumed sweep's recorded).
    min_seeds: int

    def shown(self) -> str:
        """The plan, as the sweep's log states it."""

    def look(self, cell_of_run: dict[str, Cell]) -> dict[Cell, int]:
        """Judge the jobs so far (each run directory's name and the cell it belongs to), record
        the look, and return the next seed of each cell still open."""


class EvidenceSweeper(Sweeper):
    def __init__(
        self, params: dict[str, str] | None = None, looks: Callable[..., Looks] | None = None
    ) -> None:
        super().__init__()
        self.params = params or {}
        self.looks = looks
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        from hydra.core.plugins import Plugins

        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def cells(self, arguments: list[str]) -> list[Cell]:
        """Every combination of the swept values, each a cell; the seeds are the sweeper's."""
        from amp_exp.config.precisions import REFERENCE
        from amp_exp.errors import ConfigError

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        # A preset's fixed seeds (experiment=precision_evidence: seed 0,1,2) are what this
        # sweeper replaces; seeds asked for on the command line contradict it, and are refused.
        preset = {key: value for key, value in self.params.items() if key != SEED}
        if len(preset) < len(self.params):
            log.info(
                "evidence sweep: the preset's seed=%s gives way to evidence.min_seeds and "
                "evidence.max_seeds",
                self.params[SEED],
            )
        overrides = parser.parse_overrides([*(f"{k}={v}" for k, v in preset.items()), *arguments])
        for override in overrides:
            if override.key_or_group == SEED:
                raise ConfigError(
                    f"{override.input_line}: the evidence sweeper chooses the seeds "
                    "(evidence.min_seeds, evidence.max_seeds); leave seed out"
                )
        (combinations,) = BasicSweeper.split_arguments(overrides, None)
        if not any(o.startswith(f"precision={REFERENCE}") for c in combinations for o in c):
            raise ConfigError(
                f"hydra/sweeper=evidence compares each precision with {REFERENCE}: sweep "
                f"precision={REFERENCE},... (e.g. precision={REFERENCE},bf16)"
            )
        return [tuple(c) for c in combinations]

    def sweep(self, arguments: list[str]) -> list[list[JobReturn]]:
        cfg = self.config
        sweep_dir = Path(cfg.hydra.sweep.dir)
        cells = self.cells(arguments)
        # The pre-flight refused a resume that raises max_seeds (results/ownership.py).
        looks = self.looks(
            sweep_dir=sweep_dir,
            min_seeds=cfg.evidence.min_seeds,
            max_seeds=cfg.evidence.max_seeds,
            tolerance=cfg.report.tolerance,
            familywise=cfg.report.familywise,
        )
        placement = placement_of(cfg, self.hydra_context)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, sweep_dir / "multirun.yaml")
        log.info("evidence sweep: %d cells, %s", len(cells), looks.shown())
        wanted = {cell: list(range(looks.min_seeds)) for cell in cells}
        returns: list[list[JobReturn]] = []
        # Each job's directory (its name in the report) and the cell it belongs to.
        cell_of_run: dict[str, Cell] = {}
        job_idx, n_looks = 0, 0
        while wanted:
            batch = []
            for cell, seeds in wanted.items():
                for seed in seeds:
                    name, placed = placement.place([*cell, f"{SEED}={seed}"])
                    cell_of_run[name] = cell
                    if placed is not None:
                        batch.append(placed)
            if batch:
                returns.append(list(self.launcher.launch(batch, initial_job_idx=job_idx)))
                job_idx += len(batch)
            wanted = {cell: [seed] for cell, seed in looks.look(cell_of_run).items()}
            n_looks += 1
            log.info("evidence sweep, look %d: %d more jobs", n_looks, len(wanted))
        # As Hydra's basic sweeper: a failed job fails the sweep, once every look has run.
        for results in returns:
            for result in results:
                _ = result.return_value
        return returns
