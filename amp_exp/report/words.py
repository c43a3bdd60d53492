"""The report's words: how it writes a number it claims (an interval's level, a difference at the
decimals its interval needs, a tolerance, a speedup), a value a run recorded as literal text, and
the verdict lines: for each precision of each model and setting, its verdict against fp32 with
the numbers behind it (report/evidence.py's comparisons, report/decision.py's verdicts), what it
bought or cost, and how runs that did not complete ended. One place, so every table, sentence
and page agree; nothing here decides.

Run names, models, precision labels, paths and error messages come from files in an output
directory, which anyone may have written (docs/faults.md): ``md_text`` makes a model named
``<script>`` or ``[x](javascript:...)`` reach a rendered page as those characters, and keeps a
``|`` from splitting a table cell. report.md, the W&B Report, speed.md, predict.md and the
sensitivity reports write recorded values through it.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any

from amp_exp.config.precisions import REFERENCE
from amp_exp.report.compare import BASELINE, FIX, Row, cell_key, group_cells, setting_key, subject
from amp_exp.report.decision import CLAIM_P, WITHHELD_FAMILY, WITHHELD_SHAPE, trial_interval
from amp_exp.report.runs import report_plugin
from amp_exp.report.stats import MAX_SEEDS
from amp_exp.tasks.metrics import ToleranceUnit

# The advice for an open verdict: seeds added under looks that keep the error rate, never a
# larger fixed sweep re-read at the nominal 95% (which claims 4-9% of the time, not 2.5%).
CONTINUE = (
    "continue with the evidence sweeper, which adds seeds only while it is open and judges each "
    "look at its calibrated level (this sweep's overrides with `hydra/sweeper=evidence`; an "
    "interrupted one: the same command, its hydra.sweep.dir and `resume=auto`), not a larger "
    "fixed sweep re-read at 95%"
)

VERDICT_WORDS = {
    "matches": f"matches {BASELINE}",
    "not_worse": f"is not worse than {BASELINE}",
    "better": f"is better than {BASELINE}",
    "worse": f"is worse than {BASELINE}",
    "inconclusive": f"against {BASELINE} is inconclusive",
    "not_engaged": "did not engage (not_engaged), so no verdict on it",
    "baseline_unstable": f"against {BASELINE} is baseline_unstable: {BASELINE} itself failed",
    "unstable": "is unstable",
    "incomplete": f"against {BASELINE} is incomplete",
}

# A run in which at least this share of the weights did not move over the last diagnostics
# interval has stalled.
STALL_FRACTION = 0.5
# What opens markup inside a line: a backslash (which would undo the escapes after it), code
# spans, emphasis and strikethrough, links and images, table cells. An underscore between two
# letters or digits opens nothing (CommonMark), so tiny_cnn and bf16_true stay as they are.
_MARKUP = re.compile(r"[\\`*~\[\]|]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


def md_text(value: object) -> str:
    """``value`` as one line of literal markdown text: markup characters backslash-escaped,
    HTML's ``& < >`` as entities, line breaks (which would start a heading or end a table row)
    as spaces."""
    text = " ".join(str(value).splitlines())
    return html.escape(_MARKUP.sub(lambda found: "\\" + found.group(), text), quote=False)


def md_table(header: list[str], body: list[list[str]]) -> list[str]:
    """A markdown table's lines; each cell is already markdown (``md_text`` for recorded
    values)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def show_level(confidence: float) -> str:
    """An interval's level: 95%, 97.5%, 98.33%."""
    return f"{confidence * 100:.4g}%"


def decimals(interval: list[float] | None, unit: ToleranceUnit) -> int:
    """Enough decimals (2 to 6) that an interval of some width never shows as one number, nor a
    bound off zero as zero: [-0.00%, +0.00%] would claim no spread, [-0.01%, -0.00%] a bound
    that is not there."""
    scale = 1 if unit is ToleranceUnit.points else 100
    places = 2
    while interval is not None and places < 6:
        shown = [round(bound * scale, places) for bound in interval]
        if shown[0] != shown[1] and all(s or not b for s, b in zip(shown, interval, strict=True)):
            break
        places += 1
    return places


def signed(value: float, unit: ToleranceUnit, places: int) -> str:
    """A difference's number: +0.5000 accuracy points, +0.51% of a relative one."""
    return f"{value:+.{places}f}" if unit is ToleranceUnit.points else f"{value:+.{places}%}"


def show_delta(delta: float, unit: ToleranceUnit, interval: list[float] | None = None) -> str:
    """A difference, at as many decimals as its ``interval`` needs."""
    shown = signed(delta, unit, decimals(interval, unit))
    return f"{shown} points" if unit is ToleranceUnit.points else shown


def show_interval(interval: list[float], unit: ToleranceUnit) -> str:
    places = decimals(interval, unit)
    return f"[{', '.join(signed(bound, unit, places) for bound in interval)}]"


def show_tolerance(tolerance: float, unit: ToleranceUnit) -> str:
    return f"±{tolerance:g} points" if unit is ToleranceUnit.points else f"±{tolerance:.2%}"


def trial_levels(intervals: list[tuple[float, float, float]]) -> str:
    """The level of the trials' intervals ("97.5%"), each where trials of two levels are shown."""
    levels = sorted({show_level(level) for _, _, level in intervals})
    return " or ".join(levels)


def speedup_cell(speedup: dict[str, Any] | None) -> str:
    """A speed trial's speedup and its interval: 1.12x [1.05, 1.20]."""
    if speedup is None:
        return "-"
    low, high, _ = trial_interval(speedup)
    return f"{speedup['ratio']:.2f}x [{low:.2f}, {high:.2f}]"


def describe_end(row: dict[str, Any]) -> str:
    """How a run that did not complete ended: failed (with its error) or stopped by a signal."""
    return f"{row['status']} ({row['error']})" if row["error"] else str(row["status"])


def stall_phrase(row: dict[str, Any]) -> str | None:
    """Why a run whose weights stopped moving stalled, and what to do; None if it did not."""
    stale = row["stale_weight_frac"]
    if stale is None or stale < STALL_FRACTION:
        return None
    # The precision's plugin says why, from the options that make the run's variant.
    plugin = report_plugin(row["precision"]) or report_plugin(REFERENCE)
    why = plugin.stall_advice(row["precision_options"])
    return f"{stale:.0%} of weights did not move over the last interval: {why}"


def rounds_phrase(found: dict[str, Any]) -> str:
    """20 AB/BA rounds, and whether the trial stopped on its target, or a signal stopped it."""
    reached, stopped = found.get("target_reached"), found.get("stopped_by")
    if stopped:
        return f"{found['rounds']} AB/BA rounds; partial: stopped by {stopped}"
    return f"{found['rounds']} AB/BA rounds" + ("; target not reached" if reached is False else "")


def show_speedup(found: dict[str, Any]) -> str:
    """1.52x [1.40x, 1.65x] (97.5% CI, 20 AB/BA rounds), total time 1.48x"""
    low, high, level = trial_interval(found)
    trend = found["trend"]
    flag = (
        f"; TREND over rounds (Spearman rho {trend['spearman_rho']:+.2f}, p {trend['p_value']:.2g})"
    )
    return (
        f"{found['ratio']:.2f}x [{low:.2f}x, {high:.2f}x] ({show_level(level)} CI, "
        f"{rounds_phrase(found)}), "
        f"total time {found['total_time_ratio']:.2f}x" + (flag if trend["flag"] else "")
    )


def ci_span(found: dict[str, Any]) -> str:
    """A speedup's interval in words: 97.5% CI 1.40x to 1.65x (a trial's, or the jobs')."""
    low, high, level = trial_interval(found)
    return f"{show_level(level)} CI {low:.2f}x to {high:.2f}x"


def speed_phrase(comparison: dict[str, Any], emulated: bool) -> str:
    """The interleaved trial's speedup and its interval; else the interval of the paired per-seed
    throughput ratios, labelled as such (report/evidence.py's job_speedup)."""
    if emulated:
        return "emulated, not timed"
    trial, jobs = comparison["speedup"], comparison["job_speedup"]
    if trial is None and jobs is None:
        return "throughput not measured"
    speed = f"{(trial or jobs)['ratio']:.2f}x {BASELINE}'s speed"
    if trial is not None:
        total = trial["total_time_ratio"]
        return f"{speed} ({ci_span(trial)}, {rounds_phrase(trial)}; total time {total:.2f}x)"
    how = (
        "jobs timed in parallel on one node, under contention"
        if comparison.get("contended")
        else "jobs timed one after another"
    )
    if jobs["ci"] is None:
        return f"{speed} (one seed's {how}: no interval)"
    return f"{speed} ({ci_span(jobs)} of the {jobs['source']}, n = {jobs['n']}; {how})"


# How a seed's attempt ended (report/evidence.py's failure statuses), as the lines say it.
ENDED_WORDS = {
    "numerical": "failed numerically",
    "diverged": "diverged",
    "out_of_memory": "ran out of memory",
    "killed": "was killed",
    "stopped": "was stopped",
    "failed": "failed",
    "damaged": "left a damaged record",
}


def failed_phrase(failed: dict[str, Any]) -> str:
    """One failed seed: whose run, how it ended and at which step."""
    where = "" if failed["step"] is None else f" at step {failed['step']}"
    ended = ENDED_WORDS.get(failed["status"], failed["status"])
    return f"seed {failed['seed']}: {failed['precision']} {ended}{where} ({failed['reason']})"


def seeds_phrase(comparison: dict[str, Any]) -> str:
    """What every attempted seed did, when one of them gave no result."""
    failed = comparison["failed_seeds"]
    if not failed:
        return ""
    listed = "; ".join(failed_phrase(entry) for entry in failed)
    advice = (
        "; rerun the seed: its completed rerun is paired, never the failed attempt"
        if comparison["verdict"] == "incomplete"
        else ""
    )
    total = comparison["n_attempted"]
    return f" ({listed}, of {total} seed{'' if total == 1 else 's'} attempted{advice})"


def numbers_phrase(comparison: dict[str, Any]) -> str:
    """The paired difference, its interval and tolerance, as the seeds that survived give it."""
    unit = ToleranceUnit(comparison["unit"])
    delta = show_delta(comparison["delta_mean"], unit, comparison["delta_ci95"])
    shown = f"Δ {comparison['metric_label']} {delta}"
    if comparison["delta_ci95"] is not None:
        level = show_level(comparison.get("confidence", 0.95))
        shown += f", {level} CI {show_interval(comparison['delta_ci95'], unit)}"
    shown += f", n = {comparison['n']}, tolerance {show_tolerance(comparison['tolerance'], unit)}"
    if comparison["conditional_on_survival"]:
        shown = f"over the seeds that survived, conditional on their survival: {shown}"
    return shown


def settle_phrase(comparison: dict[str, Any]) -> str:
    """Why an inconclusive verdict is open, and what would close it: more seeds under the
    evidence sweeper's calibrated looks, never a larger fixed sweep re-read at 95%."""
    if comparison["identical"] and comparison["delta_mean"] == 0:
        return f"; identical to {BASELINE} on every seed: check that the precision engaged"
    if comparison["identical"]:
        return f"; every seed differed from {BASELINE} by exactly as much, which measures no noise"
    if comparison.get("withheld") == WITHHELD_SHAPE:
        return (
            "; its interval lies within the tolerance, but its differences are too skewed for "
            "the t interval to hold its rate (skewness above what normal differences reach 95% "
            f"of the time at n = {comparison['n']}): more seeds, {CONTINUE}, would settle it"
        )
    seeds, df = comparison["seeds_to_settle"], comparison["n"] - 1
    planned = (
        f"about {seeds} seeds would settle it with 80% probability"
        if seeds
        else f"more than {MAX_SEEDS} seeds would be needed to settle it"
    )
    return (
        f"; {planned} (a simulated planning estimate, from a spread measured with {df} degree"
        f"{'' if df == 1 else 's'} of freedom): {CONTINUE}"
        + (f" with evidence.max_seeds={seeds}" if seeds else "")
    )


def floor_phrase(comparison: dict[str, Any]) -> str:
    """Where one eval example's floor makes ``matches`` impossible at this n."""
    needed, examples = comparison["min_seeds_to_match"], comparison["eval_examples"]
    if examples is None or (needed is not None and comparison["n"] >= needed):
        return ""
    unit = ToleranceUnit(comparison["unit"])
    more = f"at least {needed} seeds" if needed else f"more than {MAX_SEEDS} seeds"
    return (
        f"; with {examples:,} eval examples (one is {100 / examples:.2f} points), "
        f"{comparison['n']} seeds can never give matches at "
        f"{show_tolerance(comparison['tolerance'], unit)}: use a larger eval set or {more}"
    )


def claim_phrase(comparison: dict[str, Any]) -> str:
    """Beside a claim: its p-value, and beside matches the bound on the failure rate."""
    verdict = comparison["verdict"]
    key = CLAIM_P.get(verdict)
    phrase = f", {key} {comparison[key]:.2g}" if key and comparison[key] is not None else ""
    if comparison["failure_rate_bound"] is not None:
        phrase += (
            f"; failure rate below {comparison['failure_rate_bound']:.0%} (95% upper bound: "
            f"0 of {comparison['n']} seeds failed)"
        )
    return phrase


def quality_phrase(comparison: dict[str, Any]) -> str:
    """The verdict on the quality metric, with the numbers behind it (report/stats.py's rules)."""
    label, verdict = comparison["label"], comparison["verdict"]
    if verdict is None:
        missing = comparison.get("metric") or "eval metric"
        return f"{label} against {BASELINE}: no {missing} to compare"
    if verdict == "single_seed":
        unit = ToleranceUnit(comparison["unit"])
        return (
            f"{label} against {BASELINE} on a single seed: Δ {comparison['metric_label']} "
            f"{show_delta(comparison['delta_mean'], unit)}, tolerance "
            f"{show_tolerance(comparison['tolerance'], unit)}; one seed measures no noise, so no "
            "verdict (sweep seed=0,1,2 for one)"
        )
    phrase = f"{label} {VERDICT_WORDS[verdict]}{seeds_phrase(comparison)}"
    if comparison["delta_mean"] is None:
        return phrase
    phrase += f": {numbers_phrase(comparison)}{claim_phrase(comparison)}"
    if comparison.get("withheld") == WITHHELD_FAMILY:
        phrase += (
            f"; Holm across the report's comparisons leaves it {verdict} (unadjusted: "
            f"{comparison['unadjusted_verdict']})"
        )
    if comparison.get("baseline_not_learned"):
        return phrase + not_learned_phrase(comparison)
    if verdict == "inconclusive":
        phrase += settle_phrase(comparison)
    return phrase + floor_phrase(comparison)


def not_learned_phrase(comparison: dict[str, Any]) -> str:
    """Where fp32 itself did not learn on some seeds (report/compare.py): what those seeds'
    differences measure, and the fix of the training that would make them measure the precision."""
    seeds = comparison["baseline_not_learned"]
    listed = ", ".join(str(seed) for seed in seeds)
    return (
        f"; {BASELINE} did not learn on seed{'' if len(seeds) == 1 else 's'} {listed}, so "
        f"{'its' if len(seeds) == 1 else 'their'} difference measures optimization luck, not "
        f"the precision: {FIX}"
    )


def loss_phrase(comparison: dict[str, Any]) -> str:
    """The paired training-loss gap over the last 10% of steps."""
    gap, absolute = comparison["loss_gap_rel"], comparison["loss_gap_abs"]
    if gap is None:
        return ""
    shown = f"loss gap {show_delta(gap['mean'], ToleranceUnit.relative, gap['ci95'])}"
    if gap["ci95"] is not None:
        shown += f" (95% CI {show_interval(gap['ci95'], ToleranceUnit.relative)})"
    return f"; {shown}, {absolute['mean']:+.4f} absolute, over the last 10% of steps"


def notes(row: Row) -> list[str]:
    """What went wrong in a completed run: skipped steps, a diverged loss, stalled weights."""
    skipped = row["skipped_steps"]
    found = [f"skipped {skipped} step{'' if skipped == 1 else 's'}"] if skipped else []
    if row["final_loss"] is not None and not math.isfinite(row["final_loss"]):
        found.append(f"the loss diverged ({row['final_loss']})")
    stall = stall_phrase(row)
    return [*found, stall] if stall else found


# What a precision changes in memory against fp32, by the row's ratio: the verdict lines' words.
MEMORY_WORDS = {
    "activation_ratio": "the saved activations",
    "state_ratio": "the weights and optimizer state",
    "cuda_peak_ratio": "the CUDA peak",
}


def memory_ratios(row: Row, words: dict[str, str]) -> str:
    """The row's memory ratios to fp32 named by ``words`` (ratio key -> what it measures), those
    measured: "0.50x the saved activations, 1.00x the CUDA peak"; "" where none was."""
    return ", ".join(
        f"{row[key]:.2f}x {what}" for key, what in words.items() if row[key] is not None
    )


def named(row: Row, replicated: bool) -> str:
    """The run's precision, and its seed where the seeds vary."""
    return f"{row['label']} (seed {row['seed']})" if replicated else row["label"]


def cell_phrase(comparison: dict[str, Any], paired: list[Row], replicated: bool) -> str:
    """``paired``: the cell's completed runs that have an fp32 run of their seed (maybe none)."""
    if not paired:
        return quality_phrase(comparison)
    found = ""
    for row in paired:
        if notes(row):
            found += f"; seed {row['seed']}: " if replicated else ", "
            found += ", ".join(notes(row))
    # The memory of a precision does not change with the seed: its first run stands for all.
    memory = memory_ratios(paired[0], MEMORY_WORDS) or "memory not measured"
    return (
        f"{quality_phrase(comparison)}; {speed_phrase(comparison, paired[0]['emulated'])}, "
        f"{memory} of {BASELINE}{loss_phrase(comparison)}{found}"
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
        f"not {row['precision']}'s"
        for row in cell
        if row["status"] == "completed" and row["engaged"] is False
    ]
    if cell[0]["label"] != BASELINE:
        if comparison is not None:
            parts.append(cell_phrase(comparison, paired, replicated))
        parts += [
            f"{unpaired_phrase(row, replicated)} (no {BASELINE} run of its seed to pair with)"
            for row in completed
            if row["baseline"] is None
        ]
    # A seed the comparison names as failed is said there, once.
    named_runs = {failed["run"] for failed in (comparison or {}).get("failed_seeds", [])}
    return parts + [
        ended_phrase(row, replicated)
        for row in cell
        if row["status"] != "completed" and row["run"] not in named_runs
    ]


def verdicts(rows: list[Row], comparisons: list[dict[str, Any]]) -> list[str]:
    """A line per precision of each model and setting (``rows`` are compare.comparison_rows')."""
    compared = {cell_key(c): c for c in comparisons}
    lines = []
    for (model, setting), group in group_cells(rows, setting_key).items():
        who = subject(model, setting)
        replicated = len({row["seed"] for row in group}) > 1
        if not any(r["label"] == BASELINE and r["status"] == "completed" for r in group):
            parts = [f"no completed {BASELINE} run to compare with"] + [
                unpaired_phrase(row, replicated)
                if row["status"] == "completed"
                else ended_phrase(row, replicated)
                for row in group
            ]
            lines.append(f"{who}: {'; '.join(parts)}")
            continue
        before = len(lines)
        for key, cell in group_cells(group).items():
            parts = cell_parts(cell, compared.get(key), replicated)
            if parts:
                lines.append(f"{who}: {'; '.join(parts)}")
        if len(lines) == before:
            lines.append(f"{who}: only {BASELINE} ran")
    return lines
