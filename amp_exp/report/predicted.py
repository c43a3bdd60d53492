"""The sweep's roofline predictions (predicted.json, written by amp_exp/predict/sweep.py under
``report.predict``) as the report shows them: a column per GPU beside the measured trial, each
figure labelled as a prediction, never merged with a measurement."""

from __future__ import annotations

from typing import Any

from amp_exp.report.escape import md_text

PREDICTED_NOTE = (
    " Predicted on a GPU: a roofline of one traced training step on that GPU's datasheet "
    "(python -m amp_exp.predict, docs/benchmarks.md states its assumptions and its error against "
    "published speedups); a prediction, not a measurement."
)


def predicted_speedups(
    predictions: list[dict[str, Any]], key: tuple[str, str, str]
) -> dict[str, dict[str, Any]]:
    """Per GPU, the predicted speedup over fp32 of a cell's precision (``speedup_vs_fp32``), or
    why there is none (``unavailable``), keyed by the GPU's label; empty without a prediction."""
    model, setting, label = key
    for prediction in predictions:
        if (prediction.get("model"), prediction.get("setting", "")) != (model, setting):
            continue
        return {
            device["label"]: device["precisions"][label]
            for device in (prediction.get("devices") or {}).values()
            if label in device["precisions"]
        }
    return {}


def prediction_columns(comparisons: list[dict[str, Any]]) -> list[str]:
    """The GPUs any comparison has a prediction for, in the order first seen."""
    return list(dict.fromkeys(gpu for c in comparisons for gpu in c.get("predicted") or {}))


def show_prediction(found: dict[str, Any] | None) -> str:
    if not found:
        return "-"
    if found.get("speedup_vs_fp32") is None:
        return f"not predicted: {md_text(found.get('unavailable') or 'no fp32 prediction')}"
    return f"{found['speedup_vs_fp32']:.2f}x (predicted)"
