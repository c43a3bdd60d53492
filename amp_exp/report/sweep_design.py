"""The evidence sweep's section of report.md: its stopping rule and level, the seeds each cell
used, and what a fixed design would have spent (report/sequential.py records them)."""

from __future__ import annotations

from typing import Any

from amp_exp.report.compare import BASELINE, subject
from amp_exp.report.escape import md_text
from amp_exp.report.sequential import FIXED_SEEDS
from amp_exp.report.shown import show_level


def evidence_sweep_section(sweep: dict[str, Any] | None) -> list[str]:
    """An evidence sweep's design (report/sequential.py): its rule and level, the seeds each
    cell used and the look it was decided at, and what a fixed 3-seed design would have spent."""
    if sweep is None:
        return []
    plan, rule = sweep["plan"], md_text(sweep["rule"])
    lines = [
        "## Evidence sweep",
        "",
        f"Seeds were added only where a verdict was still open: every cell ran "
        f"{plan['min_seeds']} seeds, then each cell not yet decided (and its {BASELINE} pair) one "
        f"more per look, up to {plan['max_seeds']}; a decided cell stayed frozen. {rule}: "
        f"each claim at its look's one-sided level ({levels_shown(plan['levels'])}; accuracy "
        f"cells, which look first at 3 seeds: {levels_shown(plan['accuracy_levels'])}), so a "
        "false claim stays below 2.5% per side however the looks fell (simulated: docs/sweeps.md);"
        " the intervals above are at those levels (1 - 2 x the level), not 95%.",
        "",
        *after_last_look(sweep),
        "| cell | seeds | verdict at each look, until decided |",
        "|---|---|---|",
    ]
    for cell, seeds in sweep["seeds"].items():
        shown = ", ".join(
            f"n={look['n']} {md_text(look['verdict'])}" for look in judged_looks(sweep, cell)
        )
        model, setting, label = cell.split("|")
        named = md_text(f"{subject(model, setting)} {label}")
        lines.append(f"| {named} | {seeds} | {shown or '-'} |")
    steps = sweep["steps_per_job"]
    cost = f", {sweep['steps']:,} steps" if steps else ""
    fixed = f", {sweep['fixed_jobs'] * steps:,} steps" if steps else ""
    lines += [
        "",
        f"Spent: {sweep['jobs']} jobs{cost}. A fixed design of {FIXED_SEEDS} seeds per cell "
        f"would have spent {sweep['fixed_jobs']} jobs{fixed}, and {plan['max_seeds']} seeds per "
        f"cell {plan['max_seeds'] * len(sweep['seeds'])} jobs.",
        "",
    ]
    return lines


def after_last_look(sweep: dict[str, Any]) -> list[str]:
    """Runs added to the sweep's directory after its last look, said, with the rule they get."""
    added = sweep.get("runs_after_last_look") or 0
    if not added:
        return []
    return [
        f"{added} run{'' if added == 1 else 's'} joined this directory after the sweep's last "
        "look: the verdicts above still use the plan's levels (a cell past max_seeds its last "
        "look's), never 95%, and a claim there was not planned for: continue the sweep "
        "(`resume=auto`) rather than add runs by hand.",
        "",
    ]


def levels_shown(levels: dict[str, float]) -> str:
    return ", ".join(f"{show_level(level)} at n = {n}" for n, level in levels.items())


def judged_looks(sweep: dict[str, Any], cell: str) -> list[dict[str, Any]]:
    """The looks at ``cell`` that judged new evidence: a frozen cell's later looks repeat its
    verdict on the same seeds, and would read as more judgements. A cell that Holm's
    adjustment (report.familywise) reopened keeps the looks that followed."""
    looks: list[dict[str, Any]] = []
    for look in sweep["looks"]:
        found = look.get(cell)
        if found is not None and (
            not looks
            or (found["n"], found["verdict"])
            != (
                looks[-1]["n"],
                looks[-1]["verdict"],
            )
        ):
            looks.append(found)
    return looks
