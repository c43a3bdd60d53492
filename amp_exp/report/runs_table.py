"""report.md's Runs table and runs.csv: a run a row, at most 10 columns in report.md (every field
in report.json and runs.csv), and how a value is shown."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from typing import Any

from amp_exp.config.precisions import DType
from amp_exp.report.compare import BASELINE, NOT_ENGAGED, subject
from amp_exp.report.escape import md_text
from amp_exp.report.speedup import speedup_cell


def number_format(spec: str, scale: float = 1, suffix: str = "") -> Callable[[Any], str]:
    def show(value: Any) -> str:
        return "-" if value is None else f"{format(value * scale, spec)}{suffix}"

    return show


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


Column = tuple[str, Callable[[dict[str, Any]], str]]


def row_subject(row: dict[str, Any]) -> str:
    return md_text(subject(row["model"], row["setting"]))


def throughput(row: dict[str, Any]) -> str:
    """Tokens/s for a language model, samples/s otherwise."""
    if row["tokens_per_s"] is not None:
        return f"{row['tokens_per_s']:,.0f} tokens/s"
    return number_format(",.1f", suffix=" samples/s")(row["samples_per_s"])


def speedup(row: dict[str, Any]) -> str:
    """The one speed against fp32's: the interleaved trial's, else the jobs' own, labelled
    (report.json keeps both: ``trial_speedup`` and ``speedup``)."""
    if row["label"] == BASELINE:
        return "-"  # the baseline of every speedup
    if row["trial_speedup"] is not None:
        return speedup_cell(row["trial_speedup"])
    return number_format(".2f", suffix="x (jobs)")(row["speedup"])


def memory(row: dict[str, Any]) -> str:
    """What the precision changes in memory against fp32: saved activations, weights + state."""
    ratios = [(row["activation_ratio"], "act."), (row["state_ratio"], "state")]
    shown = [f"{ratio:.2f}x {what}" for ratio, what in ratios if ratio is not None]
    return ", ".join(shown) or "-"


def quality(row: dict[str, Any]) -> str:
    """The task's quality metric, as its declaration formats it."""
    declared = row["quality_metric"]
    if declared is None or row["quality"] is None:
        return "-"
    fmt = next(m["fmt"] for m in declared["metrics"] if m["name"] == declared["quality"])
    return format(row["quality"], fmt)


def precision_cell(row: dict[str, Any]) -> str:
    """The precision, and how it ran where that is not one process in fp32 dtypes: its ranks,
    FSDP2, and the dtypes of FSDP2's policy."""
    parts = [f"{row['world_size']} ranks"] if (row["world_size"] or 1) > 1 else []
    parts += ["fsdp2"] if row["strategy"] == "fsdp2" else []
    for what, key in (("params", "param_dtype"), ("reduce", "reduce_dtype")):
        if row[key] not in (None, DType.float32.short):
            parts.append(f"{what} {md_text(row[key])}")
    return shown(row) + (f" [{', '.join(parts)}]" if parts else "")


LEARNED_WORDS = {True: "learned", False: "DID NOT LEARN", None: "completed"}


def result(row: dict[str, Any]) -> str:
    """How the run ended and, if it completed, whether it learned (report/learned.py)."""
    return LEARNED_WORDS[row["learned"]] if row["status"] == "completed" else row["status"]


def quality_header(rows: list[dict[str, Any]]) -> str:
    names = dict.fromkeys(r["quality_metric"]["quality"] for r in rows if r["quality_metric"])
    return " / ".join(names) or "quality"


def run_columns(rows: list[dict[str, Any]]) -> list[Column]:
    """report.md's Runs table, at most 10 columns (every field is in report.json and runs.csv);
    a new column is one more entry here."""
    seeds = [("seed", lambda row: _text(row["seed"]))] if len({r["seed"] for r in rows}) > 1 else []
    return [
        ("run", lambda row: md_text(row["run"])),
        ("model", row_subject),
        ("precision", precision_cell),
        *seeds,
        ("result", result),
        ("throughput", throughput),
        (f"speedup vs {BASELINE}", speedup),
        (f"memory vs {BASELINE}", memory),
        (quality_header(rows), quality),
    ]


def shown(row: dict[str, Any]) -> str:
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
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(fields)
    for row in rows:
        values = {**row, **{f"eval.{name}": value for name, value in row["eval"].items()}}
        trial = row["trial_speedup"]
        values["trial_speedup"] = None if trial is None else trial["ratio"]
        writer.writerow(["" if values.get(key) is None else values[key] for key in fields])
    return out.getvalue()


def md_table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]
