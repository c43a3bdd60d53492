"""The evidence sweeper's stopping rule: seeds added only where a verdict is still open.

Every cell (a model, a setting and a precision) runs ``evidence.min_seeds`` seeds; then, at each
look, a cell whose verdict against fp32 is still open gets its next seed, with its fp32 pair, and
a decided cell stays frozen, until ``evidence.max_seeds``. The verdicts are the report's own
(report/decision.py), each claim at the one-sided level of its look: group-sequential boundaries
for the paired t-statistic, O'Brien-Fleming-like (strict early, close to 2.5% at the last look:
0.04%, 0.34%, 0.94% and 1.79% at n = 2..5), calibrated by simulation so that a true difference
on the tolerance crosses some look's boundary 2.5% of the time (scripts/calibrate_rules.py writes
them and their simulated rates to calibration.json; docs/sweeps.md compares them with
Bonferroni's). The looks are planned, n = min_seeds .. max_seeds, never the looks a cell took;
a resumed sweep keeps the recorded levels and may not raise max_seeds, which would add looks the
levels did not pay for. Accuracy cells look first at 3 seeds (with the spread floored at one
eval example, 2 cannot decide), and their boundaries are calibrated for looks from 3, so no
level is spent on a look that cannot decide.

Plain data in and out: the sweeper (hydra_plugins/_amp_exp_evidence.py) launches the jobs and
writes evidence.json through ``record``; the report reads it back (``read_plan``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from amp_exp.config.adaptive import EvidenceConfig
from amp_exp.config.cross_checks import check_resumed_plan
from amp_exp.errors import ConfigError, first_line
from amp_exp.report.compare import BASELINE, cell_key, group_cells
from amp_exp.report.runs import NUMBER, Nullable, conforms
from amp_exp.report.stats import Verdict, calibration
from amp_exp.results.files import EVIDENCE_JSON, UntrustedFile, damaged, read_json, write_json
from amp_exp.tasks.metrics import ToleranceUnit

# The verdicts another seed may still change: nothing claimed, or only the one-sided not_worse.
OPEN = {Verdict.inconclusive.value, Verdict.not_worse.value, Verdict.single_seed.value}
# With one eval example's floor, no verdict of an accuracy is possible below this many seeds.
ACCURACY_FIRST_LOOK = 3
# The design an evidence sweep is measured against: every cell 3 seeds (MLPerf's least).
FIXED_SEEDS = 3
RULE = "group-sequential, O'Brien-Fleming-like levels calibrated by simulation"


# The settings that plan the looks: the evidence sweeper's, unless a command names its own.
PLAN_SETTINGS = ("evidence.min_seeds", "evidence.max_seeds")


def boundaries(
    first: int, last: int, settings: tuple[str, str] = PLAN_SETTINGS
) -> dict[str, float]:
    """The calibrated one-sided level of each look n = first .. last, by n."""
    found = calibration()["boundaries"].get(f"{first}-{last}")
    if found is None:
        planned = sorted(calibration()["boundaries"], key=lambda key: int(key.split("-")[1]))
        raise ConfigError(
            f"{settings[0]}={first} {settings[1]}={last}: no calibrated boundaries for "
            f"that plan; the two within {planned[0]} .. {planned[-1]}"
        )
    return {str(n): alpha for n, alpha in zip(found["looks"], found["alphas"], strict=True)}


@dataclass(frozen=True)
class Plan:
    min_seeds: int
    max_seeds: int
    # Each look's one-sided level by n: cells that look from min_seeds, and accuracy cells
    # (from ``ACCURACY_FIRST_LOOK``). Recorded, so that a resumed sweep keeps them.
    levels: dict[str, float]
    accuracy_levels: dict[str, float]

    @classmethod
    def of(cls, min_seeds: int, max_seeds: int, settings: tuple[str, str] = PLAN_SETTINGS) -> Plan:
        """``settings``: the names of min_seeds and max_seeds in the command that plans."""
        first = min(max(min_seeds, ACCURACY_FIRST_LOOK), max_seeds)
        return cls(
            min_seeds,
            max_seeds,
            boundaries(min_seeds, max_seeds, settings),
            boundaries(first, max_seeds, settings),
        )

    @property
    def looks(self) -> int:
        return len(self.levels)

    def alpha(self, n: int, unit: str | None) -> float:
        """The one-sided level of a claim on ``n`` seeds: its look's; below the first look (no
        look: a report read early) the first's, beyond the last planned the last's."""
        table = self.accuracy_levels if unit == ToleranceUnit.points.value else self.levels
        looks = sorted(table, key=int)
        n = min(max(n, int(looks[0])), int(looks[-1]))
        return table[str(n)]

    def shown(self) -> str:
        """The levels as the sweeper's log and the report state them."""
        return ", ".join(f"{float(a):.2%} at n={n}" for n, a in self.levels.items())


# What ``record`` writes into evidence.json, by field (report/runs.py ``conforms``).
EVIDENCE_KINDS = {
    "plan": {
        "min_seeds": int,
        "max_seeds": int,
        # A sweep planned by an earlier rule lacks them: ``start`` says so.
        "levels": Nullable({str: NUMBER}),
        "accuracy_levels": Nullable({str: NUMBER}),
    },
    "rule": str,
    "looks": [{str: {"n": int, "verdict": str, "open": bool}}],
    "seeds": {str: int},
    "jobs": int,
    "fixed_jobs": int,
    "steps": int,
    "steps_per_job": Nullable(int),
}


def read_plan(directory: Path) -> dict[str, Any] | None:
    """evidence.json of an evidence sweep's directory: its plan, looks and seeds; None elsewhere.
    One that is not as ``record`` writes it stops the sweep or the report in one line (exit 2):
    its plan sets the level of every interval, so no guess can stand in for it."""
    path = directory / EVIDENCE_JSON
    try:
        recorded = read_json(path)
    except FileNotFoundError:
        return None
    except UntrustedFile:
        raise
    except (OSError, ValueError) as error:
        raise damaged(path, first_line(str(error)) or type(error).__name__) from None
    if not conforms(recorded, EVIDENCE_KINDS):
        raise damaged(path, "its fields are not those amp_exp writes there")
    return recorded


def start(sweep_dir: Path, min_seeds: int, max_seeds: int) -> Plan:
    """The sweep's plan, or the one a sweep resumed in ``sweep_dir`` recorded."""
    planned = Plan.of(min_seeds, max_seeds)
    recorded = read_plan(sweep_dir)
    if recorded is None:
        return planned
    check_resumed_plan(EvidenceConfig(min_seeds, max_seeds), recorded.get("plan"))
    try:
        before = Plan(**recorded["plan"])
    except TypeError:
        raise ConfigError(
            f"{sweep_dir / EVIDENCE_JSON}: this sweep was planned under an earlier stopping rule "
            "whose levels it does not record; start a new sweep (another hydra.sweep.dir)"
        ) from None
    # A lower max_seeds takes fewer looks than were paid for: valid, and the levels stay.
    return Plan(before.min_seeds, max_seeds, before.levels, before.accuracy_levels)


def still_open(comparison: dict[str, Any], plan: Plan) -> bool:
    """Whether a cell gets another seed: its verdict is open (or, for accuracy, not yet
    judged) and it has not reached max_seeds."""
    n = comparison["n_attempted"]
    if n >= plan.max_seeds:
        return False
    if comparison["unit"] == ToleranceUnit.points.value and n < ACCURACY_FIRST_LOOK:
        return True
    return comparison["verdict"] in OPEN


def next_seeds(
    report: dict[str, Any], cell_of_run: dict[str, tuple[str, ...]], plan: Plan
) -> dict[tuple[str, ...], int]:
    """The sweep cell (its overrides but the seed) and seed of each job of the next look: the
    next seed of every open comparison's cell and, where it has not run it, of its fp32 pair.
    ``cell_of_run`` names the sweep cell of each of the report's runs."""
    cells: dict[tuple[str, str, str], set[tuple[str, ...]]] = {}
    seeds: dict[tuple[str, ...], set[int]] = {}
    for row in report["runs"]:
        cell = cell_of_run[row["run"]]
        cells.setdefault(cell_key(row), set()).add(cell)
        seeds.setdefault(cell, set()).add(row["seed"])
    wanted: dict[tuple[str, ...], int] = {}
    for found in report["comparisons"]:
        if not still_open(found, plan):
            continue
        pairs = cells.get((found["model"], found["setting"], BASELINE), set())
        for cell in cells[cell_key(found)]:
            seed = max(seeds[cell]) + 1
            wanted[cell] = seed
            wanted.update({pair: seed for pair in pairs if seed not in seeds[pair]})
    return wanted


def record(
    sweep_dir: Path, plan: Plan, report: dict[str, Any], looks: list[dict[str, Any]]
) -> dict[str, Any]:
    """Write evidence.json: the plan and its level, each look's verdicts, and what the sweep
    spent against a fixed 3-seed design; ``looks`` gains this look."""
    looks.append(
        {
            "|".join(cell_key(c)): {
                "n": c["n_attempted"],
                "verdict": c["verdict"],
                "open": still_open(c, plan),
            }
            for c in report["comparisons"]
        }
    )
    cells = group_cells(report["runs"])
    seeds = {"|".join(key): {row["seed"] for row in rows} for key, rows in cells.items()}
    steps = [row["steps"] for row in report["runs"] if row.get("steps")]
    found = {
        "plan": asdict(plan),
        "rule": RULE,
        "looks": looks,
        "seeds": {cell: len(s) for cell, s in seeds.items()},
        "jobs": sum(len(s) for s in seeds.values()),
        "fixed_jobs": FIXED_SEEDS * len(seeds),
        "steps": sum(steps),
        "steps_per_job": max(steps) if steps else None,
    }
    write_json(sweep_dir / EVIDENCE_JSON, found)
    return found
