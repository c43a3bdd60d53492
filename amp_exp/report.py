"""The comparison report: every run of a sweep side by side, each against fp32 of its model.

``python -m amp_exp.report DIR [DIR ...]`` finds every run (a directory with summary.json) under
the given directories and writes report.md, report.json and PNG plots. It reads summary.json and
metrics.jsonl alone, so it works on runs copied from another machine and on runs logged without
W&B. The Hydra callback in callbacks.py calls ``build_report`` when a multirun ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amp_exp.config import ReportConfig
from amp_exp.loggers import json_safe

log = logging.getLogger("amp_exp")

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
# Hydra writes a job's config here before the job runs, so it marks a run that left no summary.
JOB_CONFIG = Path(".hydra") / "config.yaml"
BASELINE = "fp32"
# Within a model the baseline comes first, then the precisions compared with it.
PRECISION_ORDER = {"fp32": 0, "bf16": 1, "fp16": 2}
# The keys a comparison is about; every other config key that differs is part of a run's setting.
COMPARED_KEYS = {"model.name", "precision.name"}


class ReportError(Exception):
    """Nothing to report; the message is one line that says why."""


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    # What sets this run apart from the other runs of its model besides precision, as overrides.
    setting: str = ""

    @property
    def model(self) -> str:
        return str(self.summary.get("model", "?"))

    @property
    def precision(self) -> str:
        return str(self.summary.get("precision", "?"))

    @property
    def completed(self) -> bool:
        return self.summary.get("status") == "completed"


# --- finding and reading runs ---------------------------------------------------------------


def _natural_key(path: Path) -> list[tuple[int, int | str]]:
    # Sweep jobs are numbered directories: job 10 belongs after job 9, not after job 1.
    return [(0, int(part)) if part.isdigit() else (1, part) for part in path.parts]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl; a line cut short by a killed run is left out."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s: skipping an unreadable line", path)
    return rows


def killed_summary(path: Path) -> dict[str, Any]:
    """What a job that never wrote summary.json (SIGKILL, the OOM killer) shows in a report."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(path / JOB_CONFIG), resolve=False)
    return {
        "status": "killed",
        "error": f"no {SUMMARY_FILE}: the process was killed (SIGKILL, out of memory) or is "
        "still running",
        "model": config.get("model", {}).get("name", "?"),
        "precision": config.get("precision", {}).get("name", "?"),
        "config": config,
    }


def load_run(path: Path) -> Run:
    try:
        summary = json.loads((path / SUMMARY_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        summary = killed_summary(path)
    except (OSError, json.JSONDecodeError) as error:
        summary = {"status": "failed", "error": f"unreadable {SUMMARY_FILE}: {error}"}
    return Run(path, summary, read_metrics(path / METRICS_FILE))


def find_runs(dirs: list[Path]) -> list[Run]:
    for directory in dirs:
        if not directory.is_dir():
            raise ReportError(f"{directory} is not a directory")
    paths = {
        found.parents[len(marker.parts) - 1]
        for directory in dirs
        for marker in (Path(SUMMARY_FILE), JOB_CONFIG)
        for found in directory.rglob(str(marker))
    }
    if not paths:
        raise ReportError(
            f"no runs under {', '.join(map(str, dirs))}: found no {SUMMARY_FILE}; give a sweep "
            "directory or run directories written by python -m amp_exp"
        )
    return [load_run(path) for path in sorted(paths, key=_natural_key)]


# --- the comparison -------------------------------------------------------------------------


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def assign_settings(runs: list[Run]) -> None:
    """Name, for each run, the config values in which it differs from the runs of its model.

    fp16 with clipping is then compared with fp32 with clipping, not with fp32 without it. Runs
    whose summary holds no config are left with an empty setting.
    """
    for model in dict.fromkeys(run.model for run in runs):
        group = [run for run in runs if run.model == model and "config" in run.summary]
        flats = [_flatten(run.summary["config"]) for run in group]
        keys = [key for flat in flats for key in flat if key not in COMPARED_KEYS]
        varied = [
            key
            for key in dict.fromkeys(keys)
            if len({json.dumps(flat.get(key)) for flat in flats}) > 1
        ]
        for run, flat in zip(group, flats, strict=True):
            run.setting = ", ".join(f"{key}={_override_value(flat.get(key))}" for key in varied)


def find_baseline(run: Run, runs: list[Run]) -> Run | None:
    """The completed fp32 run of the same model and setting."""
    return next(
        (
            other
            for other in runs
            if other.completed
            and other.precision == BASELINE
            and other.model == run.model
            and other.setting == run.setting
        ),
        None,
    )


def _ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or not baseline:
        return None
    return value / baseline


def amp_health(summary: dict[str, Any]) -> dict[str, Any]:
    """The run's diagnostics (see amp_exp.diagnostics), reduced to what a reader acts on."""
    checks = summary.get("checks") or {}
    underflow = summary.get("underflow") or {}
    return {
        "failed_checks": {
            name: check.get("offenders", [])
            for name, check in checks.items()
            if check.get("passed") is False
        },
        "first_overflow": summary.get("first_overflow"),
        "underflow_frac_scaled": underflow.get("underflow_frac_scaled"),
        "suggested_init_scale": summary.get("suggested_init_scale"),
        "hardware_advice": (summary.get("hardware") or {}).get("advice", []),
    }


def comparison_row(run: Run, baseline: Run | None, out_dir: Path) -> dict[str, Any]:
    summary = run.summary
    base = baseline.summary if baseline is not None else {}
    eval_acc, base_acc = summary.get("eval_acc"), base.get("eval_acc")
    return {
        "run": os.path.relpath(run.path, out_dir),
        "status": summary.get("status"),
        "model": run.model,
        "precision": run.precision,
        "setting": run.setting,
        "world_size": summary.get("world_size", 1),
        "samples_per_s": summary.get("samples_per_s"),
        "speedup": _ratio(summary.get("samples_per_s"), base.get("samples_per_s")),
        "peak_mem_bytes": summary.get("peak_mem_bytes"),
        "peak_mem_ratio": _ratio(summary.get("peak_mem_bytes"), base.get("peak_mem_bytes")),
        "peak_mem_kind": summary.get("peak_mem_kind"),
        "final_loss": summary.get("final_loss"),
        "eval_acc": eval_acc,
        "eval_acc_delta_points": (
            None if eval_acc is None or base_acc is None else 100 * (eval_acc - base_acc)
        ),
        "skipped_steps": summary.get("skipped_steps"),
        "loss_scale": summary.get("loss_scale"),
        "baseline": None if baseline is None else os.path.relpath(baseline.path, out_dir),
        "device_name": summary.get("device_name"),
        "error": summary.get("error"),
        "health": amp_health(summary),
    }


def comparison_rows(runs: list[Run], out_dir: Path) -> list[dict[str, Any]]:
    """One row per run, grouped by model and setting, fp32 first within each group."""
    model_order = {model: i for i, model in enumerate(dict.fromkeys(r.model for r in runs))}
    setting_order = {setting: i for i, setting in enumerate(dict.fromkeys(r.setting for r in runs))}
    ordered = sorted(
        runs,
        key=lambda r: (
            model_order[r.model],
            setting_order[r.setting],
            PRECISION_ORDER.get(r.precision, len(PRECISION_ORDER)),
        ),
    )
    return [
        comparison_row(run, find_baseline(run, runs) if run.completed else None, out_dir)
        for run in ordered
    ]


# --- the verdict ----------------------------------------------------------------------------


def _speed_phrase(speedup: float | None) -> str:
    if speedup is None:
        return "throughput not measured"
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"


def _accuracy_phrase(delta_points: float | None, tolerance: float) -> str:
    if delta_points is None:
        return "no eval accuracy to compare"
    # Accuracies are ratios of counts; a difference of exactly the tolerance is within it.
    if abs(delta_points) <= tolerance + 1e-9:
        return f"accuracy within {tolerance:g} points ({delta_points:+.2f})"
    side = "below" if delta_points < 0 else "above"
    return (
        f"accuracy {abs(delta_points):.2f} points {side} {BASELINE}, "
        f"OUTSIDE the {tolerance:g}-point tolerance"
    )


def _ended(row: dict[str, Any]) -> str:
    """How a run that did not complete ended: failed (with its error) or stopped by a signal."""
    return f"{row['status']} ({row['error']})" if row["error"] else str(row["status"])


def _judge(row: dict[str, Any], tolerance: float) -> str:
    precision = row["precision"]
    if row["status"] != "completed":
        return f"{precision} {_ended(row)}"
    notes = f", skipped {row['skipped_steps']} steps" if row["skipped_steps"] else ""
    if row["final_loss"] is not None and not math.isfinite(row["final_loss"]):
        notes += f", the loss diverged ({row['final_loss']})"
    if row["baseline"] is None:
        return f"{precision} final loss {_formatter('.4f')(row['final_loss'])}{notes}"
    memory = "memory not measured"
    if row["peak_mem_ratio"] is not None:
        memory = f"{row['peak_mem_ratio']:.2f}x the memory"
    return (
        f"{precision} {_speed_phrase(row['speedup'])} and {memory} of {BASELINE}, "
        f"{_accuracy_phrase(row['eval_acc_delta_points'], tolerance)}{notes}"
    )


def verdicts(rows: list[dict[str, Any]], tolerance: float) -> list[str]:
    """One line per model (and setting): what each precision bought over fp32, and at what cost."""
    lines = []
    for model, setting in dict.fromkeys((row["model"], row["setting"]) for row in rows):
        group = [row for row in rows if (row["model"], row["setting"]) == (model, setting)]
        is_baseline = [r["precision"] == BASELINE and r["status"] == "completed" for r in group]
        parts = [] if any(is_baseline) else [f"no completed {BASELINE} run to compare with"]
        parts += [
            _judge(row, tolerance) for row, base in zip(group, is_baseline, strict=True) if not base
        ]
        subject = f"{model} ({setting})" if setting else model
        lines.append(f"{subject}: {'; '.join(parts) or f'only {BASELINE} ran'}")
    return lines


# --- writing --------------------------------------------------------------------------------


def _formatter(spec: str, scale: float = 1, suffix: str = "") -> Callable[[Any], str]:
    def show(value: Any) -> str:
        return "-" if value is None else f"{format(value * scale, spec)}{suffix}"

    return show


# (header, row key, how to show a value)
COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("run", "run", str),
    ("model", "model", str),
    ("precision", "precision", str),
    ("setting", "setting", str),
    ("ranks", "world_size", _formatter("d")),
    ("status", "status", str),
    ("samples/s", "samples_per_s", _formatter(",.1f")),
    (f"speedup vs {BASELINE}", "speedup", _formatter(".2f", suffix="x")),
    ("peak memory", "peak_mem_bytes", _formatter(",.1f", 1 / 2**20, " MiB")),
    (f"memory vs {BASELINE}", "peak_mem_ratio", _formatter(".2f", suffix="x")),
    ("final loss", "final_loss", _formatter(".4f")),
    ("eval acc", "eval_acc", _formatter(".2f", 100, "%")),
    (f"acc vs {BASELINE} (points)", "eval_acc_delta_points", _formatter("+.2f")),
    ("skipped steps", "skipped_steps", _formatter("d")),
    ("final loss scale", "loss_scale", _formatter("g")),
]
MEMORY_KINDS = {
    "cpu_peak_rss": "peak resident memory of the process (CPU), Python and torch included",
    "cuda_max_allocated": "peak memory allocated by tensors on the GPU",
}


# Columns shown only when some row needs them: a setting that varies, data-parallel ranks. Failed
# runs carry no world size.
OPTIONAL_COLUMNS: dict[str, Callable[[Any], bool]] = {
    "setting": bool,
    "world_size": lambda ranks: (ranks or 1) > 1,
}


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    columns = [
        c
        for c in COLUMNS
        if c[1] not in OPTIONAL_COLUMNS or any(OPTIONAL_COLUMNS[c[1]](row[c[1]]) for row in rows)
    ]
    lines = [
        "| " + " | ".join(header for header, _, _ in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(show(row[key]) for _, key, show in columns) + " |")
    return lines


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
    parts += health["hardware_advice"]
    return f"- `{row['run']}` ({row['model']} {row['precision']}): " + "; ".join(parts)


def render_markdown(report: dict[str, Any]) -> str:
    rows = report["runs"]
    unfinished = [row for row in rows if row["status"] != "completed"]
    statuses = Counter(row["status"] for row in rows)
    devices = sorted({row["device_name"] for row in rows if row["device_name"]})
    memory_kinds = sorted({MEMORY_KINDS.get(row["peak_mem_kind"], "") for row in rows} - {""})
    lines = [
        "# amp_exp sweep report",
        "",
        f"{len(rows)} runs ({', '.join(f'{n} {status}' for status, n in sorted(statuses.items()))})"
        + (f", on {', '.join(devices)}" if devices else "")
        + f". Each run is compared with the completed {BASELINE} run of the same model and "
        f"setting; accuracy tolerance {report['accuracy_tolerance']:g} percentage points "
        "(`report.accuracy_tolerance`).",
        "",
        "## Verdict",
        "",
        *(f"- {line}" for line in report["verdicts"]),
        "",
        "## Runs",
        "",
        *markdown_table(rows),
        "",
        "Samples/s counts timed training steps only (no warm-up, no evaluation). Peak memory: "
        + ("; ".join(memory_kinds) or "not recorded")
        + ".",
    ]
    completed = [row for row in rows if row["status"] == "completed"]
    if completed:
        lines += ["", "## AMP health", "", *(health_line(row) for row in completed)]
    if unfinished:
        lines += ["", "## Runs that did not complete", ""]
        lines += [
            f"- `{row['run']}` ({row['model']} {row['precision']}) {_ended(row)}"
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
    (out_dir / "report.json").write_text(text + "\n", encoding="utf-8")
    (out_dir / "report.md").write_text(render_markdown(report), encoding="utf-8")


def draw_plots(
    rows: list[dict[str, Any]], metrics: dict[str, list[dict[str, Any]]], out_dir: Path
) -> tuple[list[str], dict[str, str]]:
    """Each plot on its own: one that fails is named in the report and costs nothing else."""
    try:
        from amp_exp import plots
    except ImportError as error:
        return [], {"plots": f"{error}; pip install 'amp_exp[report]' for plots"}
    drawn, errors = [], {}
    for name, draw in plots.PLOTS.items():
        try:
            figure = draw(rows, metrics)
            if figure is not None:
                plots.save(figure, out_dir / name)
                drawn.append(name)
        except Exception as error:
            log.warning("report: %s could not be drawn: %s", name, error)
            errors[name] = f"{type(error).__name__}: {error}"
    return drawn, errors


def build_report(dirs: list[Path], out_dir: Path, accuracy_tolerance: float) -> dict[str, Any]:
    """Write report.md, report.json and the plots for the runs under ``dirs``; return the report."""
    runs = find_runs(dirs)
    assign_settings(runs)
    rows = comparison_rows(runs, out_dir)
    report = {
        "accuracy_tolerance": accuracy_tolerance,
        "baseline_precision": BASELINE,
        "verdicts": verdicts(rows, accuracy_tolerance),
        "runs": rows,
        "plots": [],
        "plot_errors": {},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    # The table is on disk before any plot is tried.
    write_report(out_dir, report)
    metrics = {os.path.relpath(run.path, out_dir): run.metrics for run in runs}
    report["plots"], report["plot_errors"] = draw_plots(rows, metrics, out_dir)
    write_report(out_dir, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m amp_exp.report",
        description="Compare runs: writes report.md, report.json and PNG plots.",
    )
    parser.add_argument(
        "dirs", nargs="+", type=Path, metavar="DIR", help="a sweep or run directory"
    )
    parser.add_argument(
        "--out", type=Path, help="where to write the report (default: DIR, or the parent of all)"
    )
    parser.add_argument(
        "--accuracy-tolerance",
        type=float,
        default=ReportConfig.accuracy_tolerance,
        help="percentage points of eval accuracy a run may lie from fp32 (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.accuracy_tolerance < 0:
        parser.error("--accuracy-tolerance must be 0 or more")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out_dir = args.out or Path(os.path.commonpath([d.resolve() for d in args.dirs]))
    try:
        report = build_report(args.dirs, out_dir, args.accuracy_tolerance)
    except ReportError as error:
        print(f"amp_exp.report: error: {error}", file=sys.stderr)
        return 1
    print("\n".join(report["verdicts"]))
    print(f"report: {out_dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
