"""What the sensitivity command leaves in its run directory: sensitivity.json, sensitivity.md,
sensitivity.png (a bar chart, drawn only where matplotlib is installed; a failed plot is a
warning) and, after a repair, repair.json."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from statistics import fmean
from typing import Any

import torch
from torch import nn

from amp_exp.config.plain import plain_run_config
from amp_exp.config.precisions import REFERENCE
from amp_exp.config.schema import RunConfig
from amp_exp.report.words import md_text
from amp_exp.results.files import SENSITIVITY_JSON, write_json, write_text
from amp_exp.sensitivity.measure import SLACK_DB, ModuleError, ranking
from amp_exp.sensitivity.ranges import OpFault
from amp_exp.sensitivity.reference import Reference

log = logging.getLogger("amp_exp")

SENSITIVITY_MD = "sensitivity.md"
SENSITIVITY_PNG = "sensitivity.png"
REPAIR_JSON = "repair.json"
# How far the chart's bars reach either way (an exact module's margin is infinite).
CHART_MAX_DB = 80.0
SENSITIVE_WHEN = (
    f"output or gradient SQNR more than {SLACK_DB:g} dB below the rounding floor (the SQNR of "
    "fp32 with the module's inputs and weights rounded to the format), or a non-finite output "
    "or gradient, or an op whose output overflowed the format"
)

Measured = dict[str, tuple[dict[str, ModuleError], list[float], OpFault | None]]


def loss_error(
    losses: list[float], reference: list[float], fault: OpFault | None
) -> dict[str, Any]:
    """The mean end-to-end loss in a precision against fp32's, on the same batches, and the
    first op that overflowed in the whole model."""
    loss, expected = fmean(losses), fmean(reference)
    finite = math.isfinite(loss)
    return {
        "loss": loss,
        "finite": finite,
        "rel_error": abs(loss - expected) / abs(expected) if finite and expected else None,
        "out_of_range_op": None if fault is None else fault.text(),
    }


def sensitivity_report(
    cfg: RunConfig,
    model: nn.Module,
    reference: Reference,
    measured: Measured,
    keep_fp32: list[str],
    device: torch.device,
) -> dict[str, Any]:
    """sensitivity.json's content: ``modules`` most sensitive first (in the first precision)."""
    rankings = {p: ranking(errors) for p, (errors, *_) in measured.items()}
    order = next(iter(rankings.values()))
    modules = []
    for name in order:
        module = model.get_submodule(name)
        entry: dict[str, Any] = {
            "name": name,
            "type": type(module).__name__,
            "parameters": sum(p.numel() for p in module.parameters(recurse=False)),
            "flop_share": reference.flop_share([name]),
        }
        for precision, (errors, *_) in measured.items():
            rank = rankings[precision].index(name) + 1
            entry[precision] = {"rank": rank, **errors[name].as_dict()}
        modules.append(entry)
    return {
        "model": cfg.model.name,
        "precisions": list(rankings),
        "batches": len(reference.losses),
        "keep_fp32": keep_fp32,
        # What the fp32 reference computed in.
        "reference": {
            "dtype": "float32",
            "tf32": False,
            "device": device.type,
            "note": "TF32 off for the reference and the rounding floors, whatever trainer.tf32 "
            "says; the target precisions run as the run would",
        },
        "sensitive_when": SENSITIVE_WHEN,
        "slack_db": SLACK_DB,
        # What fp16's gradients are scaled by, as the GradScaler starts (precision.init_scale).
        "fp16_grad_scale": cfg.precision.init_scale,
        "loss": {
            REFERENCE: fmean(reference.losses),
            **{
                p: loss_error(losses, reference.losses, fault)
                for p, (_, losses, fault) in measured.items()
            },
        },
        "total_flops": reference.total_flops,
        "rankings": rankings,
        "modules": modules,
        "config": plain_run_config(cfg),
    }


def format_db(value: float | None, finite: bool | None) -> str:
    if value is None:
        return "-"
    if finite is False:
        return "non-finite"
    if value == math.inf:
        return "exact"
    return f"{value:.1f}"


def format_margin(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}" if math.isfinite(value) else ("+inf" if value > 0 else "-inf")


def format_share(value: float | None) -> str:
    """A share in percent; "-" where there was nothing to share (no gradient came back)."""
    return "-" if value is None or math.isnan(value) else f"{100 * value:.2f}%"


def describe_ranking(
    precision: str, errors: dict[str, ModuleError], order: list[str], show: int
) -> str:
    """The console's line for one precision: its most sensitive modules and their margins."""
    sensitive = [name for name in order if errors[name].sensitive]
    listed = ", ".join(
        f"{name} ({format_db(errors[name].output.db, errors[name].output.finite)})"
        for name in order[:show]
    )
    faults = [errors[name].fault for name in order if errors[name].fault is not None]
    overflow = f"; first out of range: {faults[0].text()}" if faults else ""
    return (
        f"{precision}: {len(sensitive)} of {len(order)} modules sensitive; most sensitive "
        f"first (output SQNR, dB): {listed}{overflow}"
    )


def markdown(report: dict[str, Any], show: int) -> str:
    """sensitivity.md; the model's, its modules' and ops' names are recorded values, written as
    text, never markup (report/words.py's md_text)."""
    precisions = ", ".join(report["precisions"])
    lines = [
        f"# Sensitivity of model={md_text(report['model'])}: {md_text(precisions)} against fp32",
        "",
        f"{report['batches']} training batch(es) against a true fp32 reference (TF32 off); each "
        f"module is fed its fp32 inputs, so its error is its own. Sensitive: "
        f"{report['sensitive_when']}. The margin is the distance above that bar.",
        "",
        "| precision | end-to-end loss | fp32 loss | relative error | first op out of range |",
        "|---|---|---|---|---|",
    ]
    fp32_loss = report["loss"][REFERENCE]
    for precision in report["precisions"]:
        loss = report["loss"][precision]
        error = "non-finite" if not loss["finite"] else format_share(loss["rel_error"])
        op = md_text(loss["out_of_range_op"] or "-")
        shown = f"{loss['loss']:.4f} | {fp32_loss:.4f} | {error} | {op}"
        lines.append(f"| {md_text(precision)} | {shown} |")
    by_name = {module["name"]: module for module in report["modules"]}
    for precision in report["precisions"]:
        lines += [
            "",
            f"## {md_text(precision)}: most sensitive first",
            "",
            "| rank | module | type | FLOPs | output SQNR dB (floor) | grad SQNR dB (floor) | "
            "margin dB | act. over | grad over | grad under | op out of range |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name in report["rankings"][precision][:show]:
            module = by_name[name]
            m = module[precision]
            lines.append(
                f"| {m['rank']} | {md_text(name)} | {md_text(module['type'])}"
                f" | {format_share(module['flop_share'])}"
                f" | {format_db(m['output_sqnr_db'], m['output_finite'])}"
                f" ({format_db(m['output_floor_db'], True)})"
                f" | {format_db(m['grad_sqnr_db'], m['grad_finite'])}"
                f" ({format_db(m['grad_floor_db'], True)})"
                f" | {format_margin(m['margin_db'])}"
                f" | {format_share(m['activation_overflow_frac'])}"
                f" | {format_share(m['gradient_overflow_frac'])}"
                f" | {format_share(m['gradient_underflow_frac'])}"
                f" | {md_text(m['out_of_range_op'] or '-')} |"
            )
    return "\n".join(lines) + "\n"


def chart(report: dict[str, Any], show: int):
    """The margin per module and precision, the most sensitive (first precision) on top."""
    from matplotlib.figure import Figure

    from amp_exp.report.plots import precision_color

    names = report["rankings"][report["precisions"][0]][:show]
    by_name = {module["name"]: module for module in report["modules"]}
    precisions = report["precisions"]
    height = 0.8 / len(precisions)
    figure = Figure(figsize=(8, 1.2 + 0.45 * len(names) * len(precisions)), layout="constrained")
    ax = figure.subplots()
    for i, precision in enumerate(precisions):
        for row, name in enumerate(names):
            m = by_name[name][precision]
            value = m["margin_db"]
            broken = value == -math.inf
            shown = 0.0 if broken else max(min(value, CHART_MAX_DB), -CHART_MAX_DB)
            y = row + i * height
            color = precision_color(precision)
            ax.barh(y, shown, height, color=color, label=precision if row == 0 else None)
            if broken or value == math.inf:
                label = " overflow or non-finite" if broken else " exact"
                ax.text(shown, y, label, va="center", fontsize=8)
    ax.axvline(0, color="black", linestyle="--", lw=1)
    ax.set_yticks([row + height * (len(precisions) - 1) / 2 for row in range(len(names))])
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlabel(f"margin above the sensitivity bar (dB): the rounding floor less {SLACK_DB:g} dB")
    ax.legend(loc="best")
    return figure


def write_sensitivity(output_dir: Path, report: dict[str, Any], show: int) -> None:
    """The JSON, the markdown, and the bar chart or a warning: matplotlib is optional and a plot
    never fails the command."""
    write_json(output_dir / SENSITIVITY_JSON, report)
    write_text(output_dir / SENSITIVITY_MD, markdown(report, show))
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        figure = chart(report, show)
        FigureCanvasAgg(figure)
        figure.savefig(output_dir / SENSITIVITY_PNG, dpi=110)
    except Exception as error:  # an optional part: whatever failed, the results stand
        log.warning("sensitivity chart not drawn (%s: %s)", type(error).__name__, error)
