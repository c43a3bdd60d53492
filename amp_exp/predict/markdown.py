"""predict.md: predict.json's figures as tables, one per device, with the assumptions. Names that
come from a config or a trace (precisions, devices, ops, reasons) are written as text, never
markup (report/words.py's md_text)."""

from __future__ import annotations

from typing import Any

from amp_exp.report.words import md_text

GB = 1e9


def _speedup(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def device_table(unit: str, rows: dict[str, dict]) -> list[str]:
    lines = [
        f"| precision | step (s) | {unit}/s per GPU | vs bf16 | vs fp32 | compute / memory / "
        "launch / network | casts (s) | weights+grads+optim (GB) | activations (GB) | max batch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for precision, row in rows.items():
        if row["why"]:
            lines.append(f"| {md_text(precision)} | {md_text(row['why'])} |" + " |" * 8)
            continue
        shares = row["bound_share"]
        split = " / ".join(
            f"{shares.get(b, 0):.0%}" for b in ("compute", "memory", "launch", "network")
        )
        memory = row["memory_bytes"]
        static = (memory["weights"] + memory["grads"] + memory["optimizer"]) / GB
        lines.append(
            f"| {md_text(precision)} | {row['step_time_s']:.4g} | {row[f'{unit}_per_s']:,.0f} | "
            f"{_speedup(row['speedup_vs_bf16'])} | {_speedup(row['speedup_vs_fp32'])} | {split} | "
            f"{row['casts_s']:.3g} | {static:.3g} | {memory['activations'] / GB:.3g} | "
            f"{row['max_batch']} |"
        )
    return lines


def notes(rows: dict[str, dict]) -> list[str]:
    """Each precision's caveat, and the share of the matmul FLOPs its format covers."""
    lines = []
    for precision, row in rows.items():
        share = row["format_flop_share"]
        covered = "" if share is None else f"its format covers {share:.0%} of the matmul FLOPs"
        said = "; ".join(part for part in (covered, row["caveat"]) if part)
        if said:
            lines.append(f"- {md_text(precision)}: {md_text(said)}")
    return lines


def top_ops_lines(rows: dict[str, dict]) -> list[str]:
    lines = []
    for precision, row in rows.items():
        if "top_ops" not in row:
            continue
        ops = "; ".join(
            f"{md_text(op['op'])} x{op['count']} {op['seconds'] * 1e3:.3g} ms ({op['bound']})"
            for op in row["top_ops"]
        )
        lines.append(f"- {md_text(precision)}: {ops}")
    return lines


def prediction_markdown(found: dict[str, Any]) -> str:
    model = found["model"]
    unit = model["unit"]
    factors = found["interval_factors"]
    uncertainty = (
        f"Every figure is predicted, not measured. A throughput P stands for [P / "
        f"{factors['throughput']:.2f}, P x {factors['throughput']:.2f}] and a speedup S for "
        f"[S / {factors['speedup']:.2f}, S x {factors['speedup']:.2f}]: intervals that held "
        f"{found['interval_rate']:.0%} of the published figures the roofline was checked against "
        "(predict.json's `interval`; docs/hardware.md, against published figures)."
    )
    lines = [
        "# Predicted training step per device and precision (a roofline, not a measurement)",
        "",
        f"{model['parameters']:,} parameters, batch {model['batch_size']} x "
        f"{model['units_per_sample']} {unit}, {model['flops_per_step'] / 1e12:.4g} TFLOP a step "
        f"({model['traced_ops']} traced ops), world_size {found['world_size']}.",
        "",
        uncertainty,
    ]
    for key, device in found["devices"].items():
        lines += ["", f"## {md_text(device['label'])} ({md_text(key)})", ""]
        lines += device_table(unit, device["precisions"])
        lines += ["", *notes(device["precisions"])]
        lines += ["", "Costliest ops:", "", *top_ops_lines(device["precisions"])]
        lines += ["", "Sources: " + "; ".join(s for s in device["sources"] if s)]
    lines += ["", "## Assumptions", "", *(f"- {a}" for a in found["assumptions"]), ""]
    return "\n".join(lines)
