"""report.md, report.json and runs.csv: the recommendation, the verdicts, the evidence table, the
evidence sweep's design, the Runs table (at most 10 columns in report.md; every field in
report.json and runs.csv), AMP health and the plots, as text. The words and numbers are
report/words.py's; each sentence here only places them."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from collections.abc import Callable
from operator import itemgetter
from pathlib import Path
from typing import Any

from amp_exp.config.precisions import DType
from amp_exp.report.compare import (
    BASELINE,
    DROP,
    FLOOR_FACTOR,
    NOT_ENGAGED,
    SKIPPED_SHARE,
    cell_key,
    quality_entry,
    subject,
)
from amp_exp.report.decision import CLAIM_P, trial_interval
from amp_exp.report.forecasts import forecast_section
from amp_exp.report.recommend import recommendation_lines
from amp_exp.report.runs import report_plugin
from amp_exp.report.sequential import FIXED_SEEDS
from amp_exp.report.words import (
    describe_end,
    md_table,
    md_text,
    memory_ratios,
    show_delta,
    show_interval,
    show_level,
    show_tolerance,
    speedup_cell,
    trial_levels,
)
from amp_exp.results.files import REPORT_JSON, REPORT_MD, RUNS_CSV, json_safe, write_text
from amp_exp.tasks.metrics import ToleranceUnit

EVIDENCE_NOTE = (
    "Seeds are replicates: seed s of a precision is paired with seed s of fp32 (the same initial "
    "weights and batches), and every seed attempted counts: a precision that failed a seed fp32 "
    "completed (a numerical fault, out of memory, a non-finite loss or metric) is `unstable`, one "
    "whose fp32 run failed is `baseline_unstable`, one with a seed killed and never rerun "
    "`incomplete`, one that did not engage `not_engaged`, in that precedence. Otherwise Δ is the "
    "mean paired difference with its 95% t interval, the spread floored at one eval example for "
    "accuracy: `matches` when the interval lies inside ± the tolerance, which is two one-sided "
    "tests (TOST) at 2.5% per side, stricter than bioequivalence's 90% interval (p: "
    "`p_equivalence`); `worse` or `better` when it lies wholly beyond it (p: the one-sided test "
    "of that claim); `not_worse` when only its worse side lies within it; `inconclusive` "
    "otherwise, and always for an interval of no width; `single_seed` claims nothing. The t "
    "interval assumes normal deltas. Loss gap: (loss - fp32's) / fp32's at matched steps over "
    "the last 10% of training, paired seed by seed. Trial speedup: the geometric mean over AB/BA "
    "rounds of a speed trial, with a t interval on the log ratios (docs/sweeps.md)."
)
FAMILYWISE_NOTE = {
    "holm": " With `report.familywise=holm` (the default), Holm's step-down procedure runs across "
    "this report's comparisons, a family per claim (matches, not_worse, worse, better), each at "
    "2.5%; a claim that fails its adjusted threshold is `inconclusive`. The intervals shown are "
    "unadjusted.",
    "none": " With `report.familywise=none`, each verdict holds at its own level and nothing "
    "corrects across this report's comparisons: with several, the chance that one claim is "
    "false is larger than 2.5%.",
}
MFU_NOTE = "MFU: achieved TFLOP/s over the GPU's dense peak (summary.json's mfu_peak_source). "
MEMORY_NOTE = (
    "Memory vs fp32: act. is the bytes autograd kept for backward in the audited step, counted "
    "once per storage (exact on every device); state is the bytes of the parameters and the "
    "optimizer's state tensors at the end of training (report.json and runs.csv hold the bytes, "
    "and on CUDA the peak). "
)
PREDICTED_NOTE = (
    " Predicted on a GPU: a roofline of one traced training step on that GPU's datasheet "
    "(python -m amp_exp.predict, docs/benchmarks.md states its assumptions and its error against "
    "published speedups); a prediction, not a measurement."
)
LEARNED_NOTE = (
    "Result: a completed run learned when its eval loss fell to at most {drop:.0%} of the first "
    "training loss it logged and, where the data knows its best reachable loss (loss_floor), to "
    "within {floor:g}x of it; a comparison with an fp32 run that did not learn measures "
    "optimization luck on that seed. "
)


def _estimate(estimate: dict[str, Any] | None, spec: str) -> str:
    if estimate is None:
        return "-"
    ci = estimate["ci95"]
    shown = format(estimate["mean"], spec)
    return shown if ci is None else f"{shown} [{format(ci[0], spec)}, {format(ci[1], spec)}]"


def difference(mean: float | None, ci: list[float] | None, unit: ToleranceUnit) -> str:
    """A difference and its interval, at the decimals the interval needs; "-" without one."""
    if mean is None:
        return "-"
    shown = show_delta(mean, unit, ci)
    return shown if ci is None else f"{shown} {show_interval(ci, unit)}"


def attempted(comparison: dict[str, Any]) -> str:
    """Beside n, " of 3 attempted" where a seed attempted gave no result."""
    return f" of {comparison['n_attempted']} attempted" if comparison.get("failed_seeds") else ""


def claim_p(comparison: dict[str, Any]) -> float | None:
    """The p-value of the claim a verdict makes: p_equivalence beside matches, never the test of
    no difference (a large p there reads as "no difference", which it is not)."""
    key = CLAIM_P.get(comparison.get("verdict") or "")
    return None if key is None else comparison[key]


def evidence_table(report: dict[str, Any]) -> list[str]:
    """A row per cell (model, setting, precision over its seeds): the quality metric's mean and
    95% CI, and against fp32 the paired difference, its p-value, the verdict, the loss gap and
    the speed trial's speedup."""
    compared = {cell_key(c): c for c in report["comparisons"]}
    formats = {
        metric["name"]: metric["fmt"]
        for row in report["runs"]
        if row["quality_metric"] is not None
        for metric in row["quality_metric"]["metrics"]
    }
    with_setting = any(cell["setting"] for cell in report["cells"])
    header = ["model", *(["setting"] * with_setting), "precision", "n", "metric"]
    # An evidence sweep's comparisons are each at their look's level (the section below).
    shared = report.get("confidence", 0.95)
    level = "look's" if shared is None else show_level(shared)
    header += ["mean [95% CI]", f"Δ vs {BASELINE} [{level} CI]", "p of the claim", "verdict"]
    trials = [trial_interval(c["speedup"]) for c in report["comparisons"] if c.get("speedup")]
    trial_level = trial_levels(trials)
    header += [
        "loss gap [95% CI]",
        f"trial speedup [{trial_level} CI]" if trial_level else "trial speedup",
    ]
    gpus = prediction_columns(report["comparisons"])
    header += [f"predicted on {md_text(gpu)}" for gpu in gpus]
    body = []
    for cell in report["cells"]:
        found = compared.get(cell_key(cell), {})
        metric = cell["metric"]
        unit = ToleranceUnit(found.get("unit") or ToleranceUnit.relative.value)
        gap = found.get("loss_gap_rel") or {}
        body.append(
            [
                md_text(cell["model"]),
                *([md_text(cell["setting"] or "-")] * with_setting),
                md_text(cell["label"]),
                str(cell["n"]) + attempted(found),
                md_text(metric or "-"),
                _estimate(cell if metric else None, formats.get(metric, ".4g")),
                difference(found.get("delta_mean"), found.get("delta_ci95"), unit),
                shown(claim_p(found), ".2g"),
                found.get("verdict") or "-",
                difference(gap.get("mean"), gap.get("ci95"), ToleranceUnit.relative),
                speedup_cell(found.get("speedup")),
                *(show_prediction((found.get("predicted") or {}).get(gpu)) for gpu in gpus),
            ]
        )
    return md_table(header, body)


def tolerance_sentence(report: dict[str, Any]) -> str:
    """Which tolerance each task's quality metric was judged with (each row's ``tolerance``)."""
    judged = {
        row["quality_metric"]["quality"]: show_tolerance(
            row["tolerance"], ToleranceUnit(row["quality_metric"]["tolerance_unit"])
        )
        for row in report["runs"]
        if row["quality_metric"] is not None
    }
    if not judged:
        return ""
    listed = ", ".join(f"{md_text(name)} {limit}" for name, limit in judged.items())
    source = "`report.tolerance`" if report["tolerance"] is not None else "each task's default"
    return f" Tolerance: {listed} ({source})."


def health_line(row: dict[str, Any]) -> str:
    health = row["health"]
    failed = [f"{name} ({', '.join(who) or '?'})" for name, who in health["failed_checks"].items()]
    # A diverged loss or many skipped steps fail the run whatever its diagnostics found.
    trouble = row.get("troubles") or {}
    if trouble.get("diverged"):
        failed.append(f"diverged: {trouble['diverged']}")
    share = trouble.get("skipped_share")
    if share is not None and share > SKIPPED_SHARE:
        failed.append(f"skipped {share:.0%} of its steps")
    unchecked = health["unchecked"]
    if failed:
        parts = ["checks FAILED: " + md_text("; ".join(failed))]
        parts += [f"AMP checks not run ({unchecked})"] if unchecked else []
    else:
        parts = [f"not checked ({unchecked})" if unchecked else "checks passed"]
    overflow = health["first_overflow"]
    if overflow:
        where = md_text(", ".join(overflow["parameters"]) or "no parameter found")
        loss = "finite" if overflow["loss_finite"] else "non-finite"
        parts.append(f"first overflow at step {overflow['step']} (loss {loss}; {where})")
    # fp16's figures, measured in every run: in another precision they say what fp16 would do,
    # and a loss scale is for a precision that trains with a GradScaler (its plugin's fact).
    plugin = report_plugin(row["precision"])
    fp16 = plugin is not None and plugin.spec.grad_scaler
    lost = health["underflow_frac_scaled"]
    if lost is not None and fp16:
        parts.append(f"{lost:.2%} of gradients lost to fp16 underflow")
    elif lost is not None:
        parts.append(f"if this run were fp16, {lost:.2%} of its gradients would flush to zero")
    if health["suggested_init_scale"] is not None and fp16:
        parts.append(f"suggested init_scale {health['suggested_init_scale']:g}")
    if health["stale_weight_frac"] is not None:
        stale = health["stale_weight_frac"]
        parts.append(f"{stale:.1%} of weights unchanged over the last interval")
    if health["converted_linears"] is not None:
        skipped = health["skipped_linears"] or {}
        kept = md_text("; ".join(f"{name}: {why}" for name, why in skipped.items()))
        converted = md_text(", ".join(health["converted_linears"]) or "none")
        parts.append(
            f"{md_text(row['precision'])} linears: {converted}"
            + (f" (kept in bf16: {kept})" if kept else "")
        )
    parts += audit_parts(row["audit"])
    return f"- {run_named(row)}: " + "; ".join(parts)


def run_named(row: dict[str, Any]) -> str:
    """A run in a line of report.md: its directory, model and precision."""
    return f"`{md_text(row['run'])}` ({md_text(row['model'])} {precision_shown(row)})"


def audit_parts(audit: dict[str, Any] | None) -> list[str]:
    """The dtypes the audited step's matmuls ran in, and why the precision did not engage."""
    if audit is None:
        return []
    shares = ", ".join(
        f"{md_text(dtype)} {share:.0%}" for dtype, share in audit["flops_by_dtype"].items()
    )
    parts = [f"matmul FLOPs: {shares or 'none'}"]
    if audit["shortfalls"]:
        where = f" ({md_text(', '.join(audit['responsible']))})" if audit["responsible"] else ""
        parts.append(f"DID NOT ENGAGE: {md_text('; '.join(audit['shortfalls']))}{where}")
    return parts


def rss_footnote(rows: list[dict[str, Any]]) -> str:
    """The CPU's peak resident set per run: the process's (Python and torch included), which a
    precision barely moves, so a footnote rather than a column."""
    rss = [row for row in rows if row["peak_mem_kind"] == "cpu_peak_rss" and row["peak_mem_bytes"]]
    if not rss:
        return ""
    listed = ", ".join(
        f"`{md_text(row['run'])}` {row['peak_mem_bytes'] / 2**20:,.0f} MiB" for row in rss
    )
    return f" CPU peak resident memory of the process (not of the precision): {listed}."


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """The verdicts as a markdown list, for report.md and the W&B Report alike: plain text that
    names models and precisions the runs recorded."""
    return [f"- {md_text(line)}" for line in report["verdicts"]]


def render_markdown(report: dict[str, Any]) -> str:
    rows = report["runs"]
    unfinished = [row for row in rows if row["status"] != "completed"]
    statuses = Counter(row["status"] for row in rows)
    devices = sorted({md_text(row["device_name"]) for row in rows if row["device_name"]})
    lines = [
        "# amp_exp sweep report",
        "",
        "## Recommendation",
        "",
        *recommendation_lines(report["recommendations"]),
        "",
        f"{len(rows)} runs ({', '.join(f'{n} {status}' for status, n in sorted(statuses.items()))})"
        + (f", on {', '.join(devices)}" if devices else "")
        + f". Each run is compared with the completed {BASELINE} run of the same model, "
        "setting and seed." + tolerance_sentence(report) + strategy_note(rows),
        "",
        "## Verdict",
        "",
        *verdict_lines(report),
        "",
        "## Evidence",
        "",
        *evidence_table(report),
        "",
        EVIDENCE_NOTE
        + FAMILYWISE_NOTE[report["familywise"]]
        + (PREDICTED_NOTE if prediction_columns(report["comparisons"]) else ""),
        "",
        *evidence_sweep_section(report.get("evidence_sweep")),
        *forecast_section(report.get("forecasts") or []),
        "## Runs",
        "",
        *markdown_table(rows),
        "",
        "Throughput counts timed training steps only (no warm-up, no evaluation); emulated fp8 "
        "runs are not timed. Speedup: the speed trial's, else the jobs' own, timed one after "
        "another (marked jobs). "
        + (MFU_NOTE if any(row["mfu"] is not None for row in rows) else "")
        + MEMORY_NOTE
        + LEARNED_NOTE.format(drop=DROP, floor=FLOOR_FACTOR)
        + f"Every field of every run: report.json and {RUNS_CSV}."
        + rss_footnote(rows),
    ]
    completed = [row for row in rows if row["status"] == "completed"]
    if completed:
        lines += ["", "## AMP health", "", *(health_line(row) for row in completed)]
        # The probe's advice is a fact of the machine, the same in every run: said once.
        advice = dict.fromkeys(a for row in completed for a in row["health"]["hardware_advice"])
        lines += [f"- this machine: {line}" for line in advice]
    if unfinished:
        lines += ["", "## Runs that did not complete", ""]
        lines += [f"- {run_named(row)} {md_text(describe_end(row))}" for row in unfinished]
    if report["plots"] or report["plot_errors"]:
        lines += ["", "## Plots", ""]
        lines += [f"![{Path(name).stem}]({name})" for name in report["plots"]]
        lines += [
            f"- {name} could not be drawn: {md_text(error)}"
            for name, error in report["plot_errors"].items()
        ]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, report: dict[str, Any]) -> None:
    text = json.dumps(json_safe(report), indent=2, allow_nan=False)
    write_text(out_dir / REPORT_JSON, text + "\n")
    write_text(out_dir / RUNS_CSV, runs_csv(report["runs"]))
    write_text(out_dir / REPORT_MD, render_markdown(report))


def strategy_note(rows: list[dict[str, Any]]) -> str:
    """A sentence for the report when its runs ran under different strategies (as literal text:
    it names what the runs recorded), "" otherwise: each is compared only within its own
    strategy, and a precision may compute in other dtypes under each (FSDP2 casts the weights
    themselves)."""
    seen = {
        (row["strategy"], row["param_dtype"], row["reduce_dtype"])
        for row in rows
        if row["strategy"] is not None
    }
    if len({strategy for strategy, _, _ in seen}) < 2:
        return ""
    described = "; ".join(
        f"{strategy} (weights compute in {param or '-'}, gradients reduced in {reduce or '-'})"
        for strategy, param, reduce in sorted(seen, key=str)
    )
    return " " + md_text(
        "These runs ran under different strategies, so each is compared only with the "
        f"{BASELINE} run of its own strategy, world size and global batch: {described}."
    )


def prediction_columns(comparisons: list[dict[str, Any]]) -> list[str]:
    """The GPUs any comparison has a prediction for, in the order first seen."""
    return list(dict.fromkeys(gpu for c in comparisons for gpu in c.get("predicted") or {}))


def show_prediction(found: dict[str, Any] | None) -> str:
    if not found:
        return "-"
    if found.get("speedup_vs_fp32") is None:
        return f"not predicted: {md_text(found.get('unavailable') or 'no fp32 prediction')}"
    return f"{found['speedup_vs_fp32']:.2f}x (predicted)"


def shown(value: Any, spec: str = "", suffix: str = "") -> str:
    """A recorded value in a table cell: "-" where it was not measured."""
    return "-" if value is None else f"{format(value, spec)}{suffix}"


Column = tuple[str, Callable[[dict[str, Any]], str]]


def throughput(row: dict[str, Any]) -> str:
    """Tokens/s for a language model, samples/s otherwise."""
    if row["tokens_per_s"] is not None:
        return f"{row['tokens_per_s']:,.0f} tokens/s"
    return shown(row["samples_per_s"], ",.1f", " samples/s")


def speedup(row: dict[str, Any]) -> str:
    """The one speed against fp32's: the interleaved trial's, else the jobs' own, labelled
    (report.json keeps both: ``trial_speedup`` and ``speedup``)."""
    if row["label"] == BASELINE:
        return "-"  # the baseline of every speedup
    if row["trial_speedup"] is not None:
        return speedup_cell(row["trial_speedup"])
    return shown(row["speedup"], ".2f", "x (jobs)")


def memory(row: dict[str, Any]) -> str:
    """What the precision changes in memory against fp32: saved activations, weights + state."""
    return memory_ratios(row, {"activation_ratio": "act.", "state_ratio": "state"}) or "-"


def quality(row: dict[str, Any]) -> str:
    """The task's quality metric, as its declaration formats it."""
    declared = row["quality_metric"]
    if declared is None or row["quality"] is None:
        return "-"
    return format(row["quality"], quality_entry(declared)["fmt"])


def precision_cell(row: dict[str, Any]) -> str:
    """The precision, and how it ran where that is not one process in fp32 dtypes: its ranks,
    FSDP2, and the dtypes of FSDP2's policy."""
    parts = [f"{row['world_size']} ranks"] if (row["world_size"] or 1) > 1 else []
    parts += ["fsdp2"] if row["strategy"] == "fsdp2" else []
    for what, key in (("params", "param_dtype"), ("reduce", "reduce_dtype")):
        if row[key] not in (None, DType.float32.short):
            parts.append(f"{what} {md_text(row[key])}")
    return precision_shown(row) + (f" [{', '.join(parts)}]" if parts else "")


LEARNED_WORDS = {True: "learned", False: "DID NOT LEARN", None: "completed"}


def result(row: dict[str, Any]) -> str:
    """How the run ended and, if it completed, whether it learned (report/compare.py)."""
    return LEARNED_WORDS[row["learned"]] if row["status"] == "completed" else row["status"]


def quality_header(rows: list[dict[str, Any]]) -> str:
    names = dict.fromkeys(r["quality_metric"]["quality"] for r in rows if r["quality_metric"])
    return " / ".join(names) or "quality"


def run_columns(rows: list[dict[str, Any]]) -> list[Column]:
    """report.md's Runs table, at most 10 columns (every field is in report.json and runs.csv);
    a new column is one more entry here."""
    seeds = [("seed", lambda row: shown(row["seed"]))] if len({r["seed"] for r in rows}) > 1 else []
    return [
        ("run", lambda row: md_text(row["run"])),
        ("model", lambda row: md_text(subject(row["model"], row["setting"]))),
        ("precision", precision_cell),
        *seeds,
        ("result", result),
        ("throughput", throughput),
        (f"speedup vs {BASELINE}", speedup),
        (f"memory vs {BASELINE}", memory),
        (quality_header(rows), quality),
    ]


def precision_shown(row: dict[str, Any]) -> str:
    """A run's precision as the tables show it: its label, and whether it did not engage."""
    label = md_text(row["label"])
    return f"{label} ({NOT_ENGAGED})" if row["engaged"] is False else label


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    columns = run_columns(rows)
    return md_table(
        [header for header, _ in columns], [[show(row) for _, show in columns] for row in rows]
    )


def runs_csv(rows: list[dict[str, Any]]) -> str:
    """Every scalar field of every run (the report.json rows), one run a line: what the Runs
    table leaves out, for a spreadsheet."""
    scalars = (
        key
        for row in rows
        for key, value in row.items()
        if key != "trial_speedup" and not isinstance(value, dict | list)
    )
    fields = [*dict.fromkeys(scalars), "trial_speedup"]
    fields += [f"eval.{name}" for name in dict.fromkeys(n for row in rows for n in row["eval"])]
    out = io.StringIO()
    # csv writes None as an empty cell; a field a row lacks is empty too.
    writer = csv.DictWriter(out, fields, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        evals = {f"eval.{name}": value for name, value in row["eval"].items()}
        trial = (row["trial_speedup"] or {}).get("ratio")
        writer.writerow({**row, **evals, "trial_speedup": trial})
    return out.getvalue()


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
    ]
    body = []
    for cell, seeds in sweep["seeds"].items():
        looks = ", ".join(
            f"n={look['n']} {md_text(look['verdict'])}" for look in judged_looks(sweep, cell)
        )
        model, setting, label = cell.split("|")
        body.append([md_text(f"{subject(model, setting)} {label}"), str(seeds), looks or "-"])
    lines += md_table(["cell", "seeds", "verdict at each look, until decided"], body)
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
    judged = itemgetter("n", "verdict")
    looks: list[dict[str, Any]] = []
    for found in filter(None, (look.get(cell) for look in sweep["looks"])):
        if not looks or judged(found) != judged(looks[-1]):
            looks.append(found)
    return looks
