"""The verdict lines: for each precision of each model and setting, its verdict against fp32 with
the numbers behind it (report/evidence.py's comparisons), what it bought or cost, and how runs
that did not complete ended."""

from __future__ import annotations

import math
from typing import Any

from amp_exp.report.compare import (
    BASELINE,
    describe_end,
    show_delta,
    show_interval,
    show_tolerance,
    stall_phrase,
)
from amp_exp.tasks.metrics import ToleranceUnit

Row = dict[str, Any]

VERDICT_WORDS = {
    "matches": f"matches {BASELINE}",
    "better": f"is better than {BASELINE}",
    "worse": f"is worse than {BASELINE}",
    "inconclusive": f"against {BASELINE} is inconclusive",
}


def speed_phrase(comparison: dict[str, Any], emulated: bool) -> str:
    """The interleaved trial's speedup and its interval; else the jobs' own, labelled as such."""
    if emulated:
        return "emulated, not timed"
    trial = comparison["speedup"]
    if trial is not None:
        low, high = trial["ci95"]
        return (
            f"{trial['ratio']:.2f}x {BASELINE}'s speed (95% CI {low:.2f}x to {high:.2f}x, "
            f"{trial['rounds']} AB/BA rounds; total time {trial['total_time_ratio']:.2f}x)"
        )
    if comparison["job_speedup"] is None:
        return "throughput not measured"
    return f"{comparison['job_speedup']:.2f}x {BASELINE}'s speed (jobs timed one after another)"


def quality_phrase(comparison: dict[str, Any]) -> str:
    """The verdict on the quality metric, with the numbers behind it (report/stats.py's rules)."""
    precision, verdict = comparison["precision"], comparison["verdict"]
    if verdict is None:
        return f"{precision} against {BASELINE}: no eval metric to compare"
    unit = ToleranceUnit(comparison["unit"])
    shown = f"Δ {comparison['metric_label']} {show_delta(comparison['delta_mean'], unit)}"
    tolerance = f"tolerance {show_tolerance(comparison['tolerance'], unit)}"
    if verdict == "single_seed":
        return (
            f"{precision} against {BASELINE} on a single seed: {shown}, {tolerance}; one seed "
            "measures no noise, so no verdict (sweep seed=0,1,2 for one)"
        )
    phrase = (
        f"{precision} {VERDICT_WORDS[verdict]}: {shown}, 95% CI "
        f"{show_interval(comparison['delta_ci95'], unit)}, n = {comparison['n']}, {tolerance}"
    )
    if verdict == "inconclusive":
        seeds = comparison["seeds_to_settle"]
        phrase += (
            f"; about {seeds} seeds would settle it at the spread seen"
            if seeds
            else "; its mean lies too close to the tolerance for more seeds to settle it"
        )
    return phrase


def loss_phrase(comparison: dict[str, Any]) -> str:
    """The training-loss gap over the last 10% of steps, and where the curve left fp32's band."""
    parts = []
    gap, absolute = comparison["loss_gap_rel"], comparison["loss_gap_abs"]
    if gap is not None:
        shown = f"loss gap {gap['mean']:+.2%}"
        if gap["ci95"] is not None:
            shown += f" (95% CI {show_interval(gap['ci95'], ToleranceUnit.relative)})"
        parts.append(f"{shown}, {absolute['mean']:+.4f} absolute, over the last 10% of steps")
    left = comparison["left_band"]
    if left is not None:
        parts.append(f"left the {BASELINE} band ({left['side']}) at step {left['step']}")
    return "".join(f"; {part}" for part in parts)


def notes(row: Row) -> list[str]:
    """What went wrong in a completed run: skipped steps, a diverged loss, stalled weights."""
    skipped = row["skipped_steps"]
    found = [f"skipped {skipped} step{'' if skipped == 1 else 's'}"] if skipped else []
    if row["final_loss"] is not None and not math.isfinite(row["final_loss"]):
        found.append(f"the loss diverged ({row['final_loss']})")
    stall = stall_phrase(row)
    return [*found, stall] if stall else found


def memory_phrase(row: Row) -> str:
    """The saved activations, the state and (CUDA) the peak against fp32's (precision audit)."""
    ratios = [
        (row["activation_ratio"], "the saved activations"),
        (row["state_ratio"], "the weights and optimizer state"),
        (row["cuda_peak_ratio"], "the CUDA peak"),
    ]
    shown = ", ".join(f"{ratio:.2f}x {what}" for ratio, what in ratios if ratio is not None)
    return shown or "memory not measured"


def named(row: Row, replicated: bool) -> str:
    """The run's precision, and its seed where the seeds vary."""
    return f"{row['precision']} (seed {row['seed']})" if replicated else row["precision"]


def cell_phrase(comparison: dict[str, Any], paired: list[Row], replicated: bool) -> str:
    """``paired``: the cell's completed runs that have an fp32 run of their seed."""
    found = ""
    for row in paired:
        if notes(row):
            found += f"; seed {row['seed']}: " if replicated else ", "
            found += ", ".join(notes(row))
    # The memory of a precision does not change with the seed: its first run stands for all.
    return (
        f"{quality_phrase(comparison)}; {speed_phrase(comparison, paired[0]['emulated'])}, "
        f"{memory_phrase(paired[0])} of {BASELINE}{loss_phrase(comparison)}{found}"
    )


def unpaired_phrase(row: Row, replicated: bool) -> str:
    final = "-" if row["final_loss"] is None else f"{row['final_loss']:.4f}"
    return f"{named(row, replicated)} final loss {final}" + "".join(
        f", {note}" for note in notes(row)
    )


def ended_phrase(row: Row, replicated: bool) -> str:
    return f"{named(row, replicated)} {describe_end(row)}"


def cell_parts(cell: list[Row], comparison: dict[str, Any] | None, replicated: bool) -> list[str]:
    """What one precision's runs of a model and setting that has an fp32 run showed."""
    completed = [
        row for row in cell if row["status"] == "completed" and row["engaged"] is not False
    ]
    paired = [row for row in completed if row["baseline"] is not None]
    # A run whose precision did not engage is no result of that precision (precision audit).
    parts = [
        f"{named(row, replicated)}: {'; '.join(row['audit']['shortfalls'])}, so its figures are "
        f"not {row['mode']}'s"
        for row in cell
        if row["status"] == "completed" and row["engaged"] is False
    ]
    if cell[0]["precision"] != BASELINE:
        if paired and comparison is not None:
            parts.append(cell_phrase(comparison, paired, replicated))
        parts += [
            f"{unpaired_phrase(row, replicated)} (no {BASELINE} run of its seed to pair with)"
            for row in completed
            if row["baseline"] is None
        ]
    return parts + [ended_phrase(row, replicated) for row in cell if row["status"] != "completed"]


def verdicts(rows: list[Row], comparisons: list[dict[str, Any]]) -> list[str]:
    """A line per precision of each model and setting (``rows`` are compare.comparison_rows')."""
    compared = {(c["model"], c["setting"], c["precision"]): c for c in comparisons}
    lines = []
    for model, setting in dict.fromkeys((row["model"], row["setting"]) for row in rows):
        group = [row for row in rows if (row["model"], row["setting"]) == (model, setting)]
        subject = f"{model} ({setting})" if setting else model
        replicated = len({row["seed"] for row in group}) > 1
        if not any(r["precision"] == BASELINE and r["status"] == "completed" for r in group):
            parts = [f"no completed {BASELINE} run to compare with"] + [
                unpaired_phrase(row, replicated)
                if row["status"] == "completed"
                else ended_phrase(row, replicated)
                for row in group
            ]
            lines.append(f"{subject}: {'; '.join(parts)}")
            continue
        before = len(lines)
        for precision in dict.fromkeys(row["precision"] for row in group):
            cell = [row for row in group if row["precision"] == precision]
            parts = cell_parts(cell, compared.get((model, setting, precision)), replicated)
            if parts:
                lines.append(f"{subject}: {'; '.join(parts)}")
        if len(lines) == before:
            lines.append(f"{subject}: only {BASELINE} ran")
    return lines
