"""gpu_bench.py's cells beside what ``python -m amp_exp.predict`` predicts for the same runs on
the same GPU: each cell's rate, and its speedup over the fp32 cell of the same flags, measured
and predicted. Plain numbers in, a table out; gpu_bench.py runs the processes."""

from __future__ import annotations

from collections.abc import Callable

# What the roofline does not model: a cell's prediction is the same with these on or off.
UNPREDICTED = ("trainer.compile=", "trainer.channels_last=")


def prediction_key(overrides: list[str]) -> tuple[str, ...]:
    """The overrides that change a prediction: cells that differ only in the rest share one."""
    return tuple(o for o in overrides if not o.startswith(UNPREDICTED))


def precision_of(overrides: list[str]) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("precision="))


def attach_predictions(cells: list[dict], predict: Callable[[list[str]], dict]) -> None:
    """Set each cell's ``predicted``: the row of predict.json for its precision, from
    ``predict(overrides)`` (predict.json's precisions of one device), called once per
    ``prediction_key``; a failed prediction is ``{"error": ...}``."""
    found: dict[tuple[str, ...], dict] = {}
    for cell in cells:
        if "error" in cell:
            continue
        key = prediction_key(cell["overrides"])
        if key not in found:
            found[key] = predict(list(key))
        rows = found[key]
        cell["predicted"] = rows if "error" in rows else rows[precision_of(cell["overrides"])]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def paired_rows(cells: list[dict], name: str, flags: tuple[str, ...], rate: str) -> list[dict]:
    """One row per cell: ``rate`` measured and predicted, their ratio, and each one's speedup
    over the fp32 cell with the same ``flags`` (the baseline ``name`` is "fp32")."""

    def flags_of(cell: dict) -> tuple:
        return tuple(cell[key] for key in flags)

    baseline = {flags_of(c): c for c in cells if c[name] == "fp32" and "error" not in c}
    rows = []
    for cell in cells:
        predicted = cell.get("predicted") or {}
        base = baseline.get(flags_of(cell), {})
        measured_rate, predicted_rate = cell.get(rate), predicted.get(rate)
        rows.append(
            {
                "cell": ", ".join([cell[name], *(f"{key}={cell[key]}" for key in flags)]),
                "measured": measured_rate,
                "predicted": predicted_rate,
                "measured_over_predicted": ratio(measured_rate, predicted_rate),
                "measured_speedup": ratio(measured_rate, base.get(rate)),
                "predicted_speedup": ratio(predicted_rate, (base.get("predicted") or {}).get(rate)),
                "note": cell.get("error") or predicted.get("error") or predicted.get("why") or "",
            }
        )
    return rows


def shown(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def comparison_table(rows: list[dict], unit: str, device: str) -> str:
    lines = [
        f"Measured against predicted on {device} (python -m amp_exp.predict: a roofline at its "
        "stated kernel efficiencies, no overlap; a prediction, not a measurement):",
        "",
        f"| cell | measured {unit}/s | predicted {unit}/s | measured / predicted "
        "| speedup vs fp32, measured | speedup vs fp32, predicted | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['cell']} | {shown(row['measured'], ',.0f')} | "
            f"{shown(row['predicted'], ',.0f')} | {shown(row['measured_over_predicted'], '.2f')} | "
            f"{shown(row['measured_speedup'], '.2f')} | {shown(row['predicted_speedup'], '.2f')} "
            f"| {row['note']} |"
        )
    return "\n".join(lines)
