"""report.md and report.json: the table, the verdicts, AMP health and the plots, as text."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amp_exp.report.compare import (
    BASELINE,
    NOT_ENGAGED,
    describe_end,
    show_delta,
    show_interval,
    show_level,
    show_tolerance,
    strategy_note,
    tolerance_for,
)
from amp_exp.report.evidence import CLAIM_P
from amp_exp.report.sweep_design import evidence_sweep_section
from amp_exp.results.files import REPORT_JSON, REPORT_MD, json_safe, write_text
from amp_exp.tasks.metrics import ToleranceUnit


def _formatter(spec: str, scale: float = 1, suffix: str = "") -> Callable[[Any], str]:
    def show(value: Any) -> str:
        return "-" if value is None else f"{format(value * scale, spec)}{suffix}"

    return show


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def show_speedup(speedup: dict[str, Any] | None) -> str:
    """A speed trial's speedup and its 95% CI: 1.12x [1.05, 1.20]."""
    if speedup is None:
        return "-"
    low, high = speedup["ci95"]
    return f"{speedup['ratio']:.2f}x [{low:.2f}, {high:.2f}]"


# (header, row key, how to show a value)
COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("run", "run", str),
    ("model", "model", str),
    ("precision", "label", str),
    ("setting", "setting", str),
    ("seed", "seed", _text),
    ("ranks", "world_size", _formatter("d")),
    ("strategy", "strategy", _text),
    ("param dtype", "param_dtype", _text),
    ("reduce dtype", "reduce_dtype", _text),
    ("status", "status", str),
    ("samples/s", "samples_per_s", _formatter(",.1f")),
    ("tokens/s", "tokens_per_s", _formatter(",.0f")),
    ("MFU", "mfu", _formatter(".1%")),
    (f"speedup vs {BASELINE}", "speedup", _formatter(".2f", suffix="x")),
    ("trial speedup (95% CI)", "trial_speedup", show_speedup),
    ("saved activations", "saved_activation_bytes", _formatter(",.2f", 1 / 2**20, " MiB")),
    (f"activations vs {BASELINE}", "activation_ratio", _formatter(".2f", suffix="x")),
    ("weights + opt. state", "state_bytes", _formatter(",.2f", 1 / 2**20, " MiB")),
    (f"state vs {BASELINE}", "state_ratio", _formatter(".2f", suffix="x")),
    ("CUDA peak", "cuda_peak_bytes", _formatter(",.1f", 1 / 2**20, " MiB")),
    (f"CUDA peak vs {BASELINE}", "cuda_peak_ratio", _formatter(".2f", suffix="x")),
    ("final loss", "final_loss", _formatter(".4f")),
    # The task's eval metrics and its quality metric against fp32's go here (metric_columns).
    ("skipped steps", "skipped_steps", _formatter("d")),
    ("final loss scale", "loss_scale", _formatter("g")),
]
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
FAMILYWISE_NOTE = (
    " With `report.familywise=true`, Holm's step-down procedure runs across this report's "
    "comparisons, a family per claim (matches, not_worse, worse, better), each at 2.5%; a claim "
    "that fails its adjusted threshold is `inconclusive`. The intervals shown are unadjusted."
)
MFU_NOTE = "MFU: achieved TFLOP/s over the GPU's dense peak (summary.json's mfu_peak_source). "
MEMORY_NOTE = (
    "Saved activations: the bytes autograd kept for backward in the audited step, counted once "
    "per storage (exact on every device). Weights + opt. state: the bytes of the parameters and "
    "the optimizer's state tensors at the end of training. CUDA peak: the most memory tensors "
    "held on the GPU."
)


# Columns shown only when some row needs them: a setting that varies, data-parallel ranks, FSDP2
# and the dtypes of its policy when they are not fp32, and a language model's tokens/s, MFU (known
# on listed GPUs only) and perplexity. Failed runs carry no world size.
OPTIONAL_COLUMNS: dict[str, Callable[[Any], bool]] = {
    "setting": bool,
    "trial_speedup": lambda speedup: speedup is not None,
    "world_size": lambda ranks: (ranks or 1) > 1,
    "strategy": lambda strategy: strategy == "fsdp2",
    "param_dtype": lambda dtype: dtype not in (None, "fp32"),
    "reduce_dtype": lambda dtype: dtype not in (None, "fp32"),
    **{
        key: lambda value: value is not None
        for key in ("tokens_per_s", "mfu", "cuda_peak_bytes", "cuda_peak_ratio")
    },
}
Column = tuple[str, Callable[[dict[str, Any]], str]]


def metric_columns(rows: list[dict[str, Any]]) -> list[Column]:
    """A column per eval metric the runs' tasks declare, then each quality metric against
    fp32's, in its tolerance unit."""
    metrics: dict[str, dict[str, Any]] = {}
    qualities: dict[str, dict[str, Any]] = {}
    for row in rows:
        declared = row["quality_metric"]
        if declared is not None:
            metrics.update({metric["name"]: metric for metric in declared["metrics"]})
            qualities.setdefault(declared["quality"], declared)

    def value_of(name: str, fmt: str) -> Callable[[dict[str, Any]], str]:
        return lambda row: _formatter(fmt)(row["eval"].get(name))

    def delta_of(name: str, unit: ToleranceUnit) -> Callable[[dict[str, Any]], str]:
        def show(row: dict[str, Any]) -> str:
            declared, delta = row["quality_metric"], row["quality_delta"]
            if declared is None or declared["quality"] != name or delta is None:
                return "-"
            return show_delta(delta, unit)

        return show

    columns: list[Column] = [
        (name, value_of(name, metric["fmt"])) for name, metric in metrics.items()
    ]
    columns += [
        (f"{name} vs {BASELINE}", delta_of(name, ToleranceUnit(declared["tolerance_unit"])))
        for name, declared in qualities.items()
    ]
    return columns


def shown(row: dict[str, Any]) -> str:
    """A run's precision as the tables show it: its label, and whether it did not engage."""
    return f"{row['label']} ({NOT_ENGAGED})" if row["engaged"] is False else row["label"]


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    columns: list[Column] = []
    for header, key, show in COLUMNS:
        if key in OPTIONAL_COLUMNS and not any(OPTIONAL_COLUMNS[key](row[key]) for row in rows):
            continue
        if key == "seed" and len({row["seed"] for row in rows}) < 2:
            continue  # seeds are shown where they vary: a replicated sweep
        if key == "label":
            columns.append((header, shown))
        else:
            columns.append((header, lambda row, key=key, show=show: show(row[key])))
        if key == "final_loss":
            columns += metric_columns(rows)
    lines = [
        "| " + " | ".join(header for header, _ in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(show(row) for _, show in columns) + " |")
    return lines


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def _estimate(estimate: dict[str, Any] | None, show: Callable[[float], str]) -> str:
    if estimate is None:
        return "-"
    ci = estimate["ci95"]
    return show(estimate["mean"]) + ("" if ci is None else f" [{show(ci[0])}, {show(ci[1])}]")


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
    level = show_level(report.get("confidence", 0.95))
    header += ["mean [95% CI]", f"Δ vs {BASELINE} [{level} CI]", "p of the claim", "verdict"]
    header += ["loss gap [95% CI]", "trial speedup [95% CI]"]
    body = []
    for cell in report["cells"]:
        found = compared.get((cell["model"], cell["setting"], cell["label"]), {})
        metric = cell["metric"]
        mean = _estimate(cell if metric else None, _formatter(formats.get(metric, ".4g")))
        delta = "-"
        if found.get("delta_mean") is not None:
            unit = ToleranceUnit(found["unit"])
            delta = show_delta(found["delta_mean"], unit)
            if found["delta_ci95"] is not None:
                delta += " " + show_interval(found["delta_ci95"], unit)
        p_value = claim_p(found)
        body.append(
            [
                cell["model"],
                *([cell["setting"] or "-"] * with_setting),
                cell["label"],
                str(cell["n"]) + attempted(found),
                metric or "-",
                mean,
                delta,
                "-" if p_value is None else f"{p_value:.2g}",
                found.get("verdict") or "-",
                _estimate(found.get("loss_gap_rel"), _formatter("+.2%")),
                show_speedup(found.get("speedup")),
            ]
        )
    return _table(header, body)


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
    listed = ", ".join(f"{name} {limit}" for name, limit in judged.items())
    source = "`report.tolerance`" if report["tolerance"] is not None else "each task's default"
    return f" Tolerance: {listed} ({source})."


def health_line(row: dict[str, Any]) -> str:
    health = row["health"]
    failed = health["failed_checks"]
    parts = [
        "checks FAILED: "
        + "; ".join(f"{name} ({', '.join(who) or '?'})" for name, who in failed.items())
        if failed
        else "checks passed"
    ]
    overflow = health["first_overflow"]
    if overflow:
        where = ", ".join(overflow["parameters"]) or "no parameter found"
        loss = "finite" if overflow["loss_finite"] else "non-finite"
        parts.append(f"first overflow at step {overflow['step']} (loss {loss}; {where})")
    if health["underflow_frac_scaled"] is not None:
        parts.append(f"{health['underflow_frac_scaled']:.2%} of gradients lost to fp16 underflow")
    if health["suggested_init_scale"] is not None:
        parts.append(f"suggested init_scale {health['suggested_init_scale']:g}")
    if health["stale_weight_frac"] is not None:
        stale = health["stale_weight_frac"]
        parts.append(f"{stale:.1%} of weights unchanged over the last interval")
    if health["fp8_converted"] is not None:
        kept = "; ".join(f"{name}: {why}" for name, why in health["fp8_skipped"].items())
        parts.append(
            f"fp8 linears: {', '.join(health['fp8_converted']) or 'none'}"
            + (f" (kept in bf16: {kept})" if kept else "")
        )
    parts += audit_parts(row["audit"])
    parts += health["hardware_advice"]
    return f"- `{row['run']}` ({row['model']} {shown(row)}): " + "; ".join(parts)


def _sentence(text: str | None) -> str:
    return f" {text}" if text else ""


def audit_parts(audit: dict[str, Any] | None) -> list[str]:
    """The dtypes the audited step's matmuls ran in, and why the precision did not engage."""
    if audit is None:
        return []
    shares = ", ".join(f"{dtype} {share:.0%}" for dtype, share in audit["flops_by_dtype"].items())
    parts = [f"matmul FLOPs: {shares or 'none'}"]
    if audit["shortfalls"]:
        where = f" ({', '.join(audit['responsible'])})" if audit["responsible"] else ""
        parts.append(f"DID NOT ENGAGE: {'; '.join(audit['shortfalls'])}{where}")
    return parts


def rss_footnote(rows: list[dict[str, Any]]) -> str:
    """The CPU's peak resident set per run: the process's (Python and torch included), which a
    precision barely moves, so a footnote rather than a column."""
    rss = [row for row in rows if row["peak_mem_kind"] == "cpu_peak_rss" and row["peak_mem_bytes"]]
    if not rss:
        return ""
    listed = ", ".join(f"`{row['run']}` {row['peak_mem_bytes'] / 2**20:,.0f} MiB" for row in rss)
    return f" CPU peak resident memory of the process (not of the precision): {listed}."


def render_markdown(report: dict[str, Any]) -> str:
    rows = report["runs"]
    unfinished = [row for row in rows if row["status"] != "completed"]
    statuses = Counter(row["status"] for row in rows)
    devices = sorted({row["device_name"] for row in rows if row["device_name"]})
    lines = [
        "# amp_exp sweep report",
        "",
        f"{len(rows)} runs ({', '.join(f'{n} {status}' for status, n in sorted(statuses.items()))})"
        + (f", on {', '.join(devices)}" if devices else "")
        + f". Each run is compared with the completed {BASELINE} run of the same model, "
        "setting and seed." + tolerance_sentence(report) + _sentence(strategy_note(rows)),
        "",
        "## Verdict",
        "",
        *(f"- {line}" for line in report["verdicts"]),
        "",
        "## Evidence",
        "",
        *evidence_table(report),
        "",
        EVIDENCE_NOTE + (FAMILYWISE_NOTE if report["familywise"] else ""),
        "",
        *evidence_sweep_section(report.get("evidence_sweep")),
        "## Runs",
        "",
        *markdown_table(rows),
        "",
        "Samples/s (and tokens/s) count timed training steps only (no warm-up, no evaluation); "
        "emulated fp8 runs are not timed. "
        + (MFU_NOTE if any(row["mfu"] is not None for row in rows) else "")
        + MEMORY_NOTE
        + rss_footnote(rows),
    ]
    completed = [row for row in rows if row["status"] == "completed"]
    if completed:
        lines += ["", "## AMP health", "", *(health_line(row) for row in completed)]
    if unfinished:
        lines += ["", "## Runs that did not complete", ""]
        lines += [
            f"- `{row['run']}` ({row['model']} {shown(row)}) {describe_end(row)}"
            for row in unfinished
        ]
    if report["plots"] or report["plot_errors"]:
        lines += ["", "## Plots", ""]
        lines += [f"![{Path(name).stem}]({name})" for name in report["plots"]]
        lines += [
            f"- {name} could not be drawn: {error}" for name, error in report["plot_errors"].items()
        ]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, report: dict[str, Any]) -> None:
    text = json.dumps(json_safe(report), indent=2, allow_nan=False)
    write_text(out_dir / REPORT_JSON, text + "\n")
    write_text(out_dir / REPORT_MD, render_markdown(report))
