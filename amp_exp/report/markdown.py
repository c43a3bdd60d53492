"""report.md and report.json: the table, the verdicts, AMP health and the plots, as text."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amp_exp.report.compare import (
    BASELINE,
    describe_end,
    strategy_note,
    tolerance_for,
)
from amp_exp.report.escape import md_text
from amp_exp.report.evidence import CLAIM_P
from amp_exp.report.failures import SKIPPED_SHARE
from amp_exp.report.forecasts import forecast_section
from amp_exp.report.learned import DROP, FLOOR_FACTOR
from amp_exp.report.predicted import PREDICTED_NOTE, prediction_columns, show_prediction
from amp_exp.report.recommend import recommendation_lines
from amp_exp.report.runs import report_plugin
from amp_exp.report.runs_table import (
    markdown_table,
    md_table,
    number_format,
    runs_csv,
    shown,
    speedup_cell,
)
from amp_exp.report.shown import show_delta, show_interval, show_level, show_tolerance
from amp_exp.report.speedup import trial_interval, trial_levels
from amp_exp.report.sweep_design import evidence_sweep_section
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
LEARNED_NOTE = (
    "Result: a completed run learned when its eval loss fell to at most {drop:.0%} of the first "
    "training loss it logged and, where the data knows its best reachable loss (loss_floor), to "
    "within {floor:g}x of it; a comparison with an fp32 run that did not learn measures "
    "optimization luck on that seed. "
)


def _estimate(estimate: dict[str, Any] | None, show: Callable[[float], str]) -> str:
    if estimate is None:
        return "-"
    ci = estimate["ci95"]
    return show(estimate["mean"]) + ("" if ci is None else f" [{show(ci[0])}, {show(ci[1])}]")


def relative_estimate(estimate: dict[str, Any] | None) -> str:
    """A relative difference and its interval, at the decimals the interval needs."""
    if estimate is None:
        return "-"
    unit, ci = ToleranceUnit.relative, estimate["ci95"]
    shown = show_delta(estimate["mean"], unit, ci)
    return shown if ci is None else f"{shown} {show_interval(ci, unit)}"


def attempted(comparison: dict[str, Any]) -> str:
    """Beside n, " of 3 attempted" where a seed attempted gave no result."""
    if not comparison.get("failed_seeds"):
        return ""
    return f" of {comparison['n_attempted']} attempted"


def claim_p(comparison: dict[str, Any]) -> float | None:
    """The p-value of the claim a verdict makes: p_equivalence beside matches, never the test of
    no difference (a large p there reads as "no difference", which it is not)."""
    key = CLAIM_P.get(comparison.get("verdict") or "")
    return None if key is None else comparison[key]


def evidence_table(report: dict[str, Any]) -> list[str]:
    """A row per cell (model, setting, precision over its seeds): the quality metric's mean and
    95% CI, and against fp32 the paired difference, its p-value, the verdict, the loss gap and
    the speed trial's speedup."""
    compared = {(c["model"], c["setting"], c["label"]): c for c in report["comparisons"]}
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
        found = compared.get((cell["model"], cell["setting"], cell["label"]), {})
        metric = cell["metric"]
        mean = _estimate(cell if metric else None, number_format(formats.get(metric, ".4g")))
        delta = "-"
        if found.get("delta_mean") is not None:
            unit = ToleranceUnit(found["unit"])
            delta = show_delta(found["delta_mean"], unit, found["delta_ci95"])
            if found["delta_ci95"] is not None:
                delta += " " + show_interval(found["delta_ci95"], unit)
        p_value = claim_p(found)
        body.append(
            [
                md_text(cell["model"]),
                *([md_text(cell["setting"] or "-")] * with_setting),
                md_text(cell["label"]),
                str(cell["n"]) + attempted(found),
                md_text(metric or "-"),
                mean,
                delta,
                "-" if p_value is None else f"{p_value:.2g}",
                found.get("verdict") or "-",
                relative_estimate(found.get("loss_gap_rel")),
                speedup_cell(found.get("speedup")),
                *(show_prediction((found.get("predicted") or {}).get(gpu)) for gpu in gpus),
            ]
        )
    return md_table(header, body)


def tolerance_sentence(report: dict[str, Any]) -> str:
    """Which tolerance each task's quality metric was judged with."""
    judged = {}
    for row in report["runs"]:
        declared = row["quality_metric"]
        if declared is not None:
            limit = tolerance_for(row, report["tolerance"])
            unit = ToleranceUnit(declared["tolerance_unit"])
            judged[declared["quality"]] = show_tolerance(limit, unit)
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
    parts = ["checks FAILED: " + md_text("; ".join(failed)) if failed else "checks passed"]
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
    return f"`{md_text(row['run'])}` ({md_text(row['model'])} {shown(row)})"


def _sentence(text: str | None) -> str:
    """A sentence of text that names what the runs recorded (their strategies)."""
    return f" {md_text(text)}" if text else ""


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
        "setting and seed." + tolerance_sentence(report) + _sentence(strategy_note(rows)),
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
