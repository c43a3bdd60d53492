"""The evidence sweeper's stopping rule: seeds added only where a verdict is still open.

Every cell (a model, a setting and a precision) runs ``evidence.min_seeds`` seeds; then, at each
look, a cell whose verdict against fp32 is still open gets its next seed, with its fp32 pair, and
a decided cell stays frozen, until ``evidence.max_seeds``. The verdicts are the report's own
(report/evidence.py, report/stats.py), at a stricter level: Bonferroni over the planned looks,
L = max_seeds - min_seeds + 1 (n = min_seeds .. max_seeds), each look's interval at
1 - 0.05 / L, so 0.025 / L per side. By the union bound a false claim on either side, over every
look a cell may take, stays below 2.5% whatever the looks find (simulated: tests/
test_evidence_sweeper.py). L is the number planned, never the looks a cell took; a resumed sweep
keeps the recorded L and may not raise max_seeds, which would add looks the level did not pay
for. Accuracy cells look first at 3 seeds: with the spread floored at one eval example, 2 cannot
decide; they plan L looks all the same, which only makes them stricter.

Plain data in and out: the sweeper (hydra_plugins/_amp_exp_evidence.py) launches the jobs and
writes evidence.json through ``record``; the report reads it back (``read_plan``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from amp_exp.config.adaptive import EvidenceConfig
from amp_exp.config.commands import check_resumed_plan
from amp_exp.errors import first_line
from amp_exp.report.compare import BASELINE
from amp_exp.report.runs import NUMBER, Nullable, conforms
from amp_exp.report.stats import CONFIDENCE, Verdict
from amp_exp.results.files import EVIDENCE_JSON, UntrustedFile, damaged, read_json, write_json
from amp_exp.tasks.metrics import ToleranceUnit

# The verdicts another seed may still change: nothing claimed, or only the one-sided not_worse.
OPEN = {Verdict.inconclusive.value, Verdict.not_worse.value, Verdict.single_seed.value}
# With one eval example's floor, no verdict of an accuracy is possible below this many seeds.
ACCURACY_FIRST_LOOK = 3
# The design an evidence sweep is measured against: every cell 3 seeds (MLPerf's least).
FIXED_SEEDS = 3
RULE = "Bonferroni over the planned looks"


@dataclass(frozen=True)
class Plan:
    min_seeds: int
    max_seeds: int
    # Planned, n = min_seeds .. max_seeds; recorded, so that a resumed sweep keeps it.
    looks: int

    @classmethod
    def of(cls, min_seeds: int, max_seeds: int) -> Plan:
        return cls(min_seeds, max_seeds, max_seeds - min_seeds + 1)

    @property
    def confidence(self) -> float:
        """Each look's interval level: 1 - 0.05 / L (98.75% at L = 4)."""
        return 1 - (1 - CONFIDENCE) / self.looks


# What ``record`` writes into evidence.json, by field (report/runs.py ``conforms``).
EVIDENCE_KINDS = {
    "plan": {"min_seeds": int, "max_seeds": int, "looks": int},
    "rule": str,
    "confidence": NUMBER,
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
    before = Plan(**recorded["plan"])
    # A lower max_seeds takes fewer looks than were paid for: valid, and the level stays.
    return Plan(before.min_seeds, max_seeds, before.looks)


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
        cells.setdefault((row["model"], row["setting"], row["label"]), set()).add(cell)
        seeds.setdefault(cell, set()).add(row["seed"])
    wanted: dict[tuple[str, ...], int] = {}
    for found in report["comparisons"]:
        if not still_open(found, plan):
            continue
        key = (found["model"], found["setting"], found["label"])
        pairs = cells.get((found["model"], found["setting"], BASELINE), set())
        for cell in cells[key]:
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
            f"{c['model']}|{c['setting']}|{c['label']}": {
                "n": c["n_attempted"],
                "verdict": c["verdict"],
                "open": still_open(c, plan),
            }
            for c in report["comparisons"]
        }
    )
    seeds: dict[str, set[int]] = {}
    for row in report["runs"]:
        seeds.setdefault(f"{row['model']}|{row['setting']}|{row['label']}", set()).add(row["seed"])
    steps = [row["steps"] for row in report["runs"] if row.get("steps")]
    found = {
        "plan": asdict(plan),
        "rule": RULE,
        "confidence": plan.confidence,
        "looks": looks,
        "seeds": {cell: len(s) for cell, s in seeds.items()},
        "jobs": sum(len(s) for s in seeds.values()),
        "fixed_jobs": FIXED_SEEDS * len(seeds),
        "steps": sum(steps),
        "steps_per_job": max(steps) if steps else None,
    }
    write_json(sweep_dir / EVIDENCE_JSON, found)
    return found
