"""``python -m amp_exp.forecast RUN_DIR [--steps N]``: will this run's precision stay safe for a run
N steps long? Fits each of the run's long-run signals (metrics.jsonl's signals rows, written by
every run: training/signals.py) and forecasts it to step N (default: 10 times the run's steps),
taking the planned run as the run's own schedule stretched to N steps; names the first limit a
signal is forecast to cross, and when (amp_exp/forecast/forecast.py states the method).

Writes forecast.json, forecast.md and a plot per signal beside the run: derived files, which a
rerun replaces; the run's own files are only read.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from amp_exp.config.schema import PrecisionConfig
from amp_exp.errors import ConfigError
from amp_exp.forecast.forecast import LEVEL, forecast_run
from amp_exp.forecast.markdown import crossing_sentence, forecast_markdown
from amp_exp.forecast.plots import plot_forecast
from amp_exp.results.contract import OneLineParser, enter
from amp_exp.results.files import METRICS_FILE, SUMMARY_FILE, write_json, write_text
from amp_exp.results.loggers import read_rows

COMMAND = "amp_exp.forecast"
FORECAST_JSON, FORECAST_MD = "forecast.json", "forecast.md"
# A run's summary.json is a few kilobytes; a file far larger is not one.
MAX_SUMMARY_BYTES = 50_000_000
# The planned length, as a multiple of the run's, when --steps is not given.
DEFAULT_STRETCH = 10


def regular_file(path: Path) -> bool:
    """A plain file, not a link: a run directory's files are data, read where they are."""
    return path.is_file() and not path.is_symlink()


def min_scale_of(run_dir: Path) -> float:
    """The run's ``precision.min_scale`` from its summary.json, or the default."""
    path = run_dir / SUMMARY_FILE
    if not regular_file(path) or path.stat().st_size > MAX_SUMMARY_BYTES:
        return PrecisionConfig.min_scale
    try:
        summary = json.loads(path.read_bytes())
        value = summary["config"]["precision"]["min_scale"]
    except (ValueError, KeyError, TypeError):
        return PrecisionConfig.min_scale
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if is_number and value > 0 else PrecisionConfig.min_scale


def forecast_dir(run_dir: Path, steps: int | None, level: float = LEVEL) -> dict[str, Any]:
    """Forecast the run in ``run_dir`` to ``steps`` (None: ten times its own) and write
    forecast.json, forecast.md and the plots beside it; returns forecast.json's content."""
    metrics = run_dir / METRICS_FILE
    if not regular_file(metrics):
        raise ConfigError(f"{run_dir} has no {METRICS_FILE} (a plain file) to forecast from")
    rows, _ = read_rows(metrics)
    logged = [row["step"] for row in rows if row["kind"] == "train"]
    if not logged:
        raise ConfigError(f"{metrics} holds no train rows: the run logged nothing to go by")
    observed = max(logged)
    planned = DEFAULT_STRETCH * observed if steps is None else steps
    if planned <= observed:
        raise ConfigError(f"--steps {planned} is not beyond the run's {observed} steps")
    forecast = forecast_run(rows, planned, min_scale_of(run_dir), level)
    write_text(run_dir / FORECAST_MD, forecast_markdown(run_dir.name, forecast))
    plot_forecast(forecast, run_dir)
    write_json(run_dir / FORECAST_JSON, forecast)
    return forecast


def run(argv: list[str] | None) -> int:
    parser = OneLineParser(prog=f"python -m {COMMAND}")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run's directory")
    parser.add_argument(
        "--steps",
        type=int,
        help=f"the planned run's length in steps (default: {DEFAULT_STRETCH} times the run's)",
    )
    parser.add_argument(
        "--level",
        type=float,
        default=LEVEL,
        help="the level of the forecast intervals (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps <= 0:
        parser.error(f"--steps must be a positive number of steps; got {args.steps}")
    if not 0 < args.level < 1:
        parser.error(f"--level must lie between 0 and 1; got {args.level}")
    if not args.run_dir.is_dir():
        raise ConfigError(f"{args.run_dir} is not a directory")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    forecast = forecast_dir(args.run_dir, args.steps, args.level)
    print(crossing_sentence(forecast))
    print(f"forecast: {args.run_dir / FORECAST_MD}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return enter(COMMAND, lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
