"""One PNG per signal: each module's observed values and its forecast band. Optional: without
matplotlib, or if drawing fails, the forecast is whole without them."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from amp_exp.results.files import write_atomically

log = logging.getLogger("amp_exp")


def plot_forecast(forecast: dict[str, Any], out_dir: Path, prefix: str = "forecast") -> list[Path]:
    """The plots written (none where matplotlib is missing or fails: said in one line)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("forecast plots left out: matplotlib is not installed")
        return []
    by_signal: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for signal in forecast["signals"]:
        by_signal[signal["signal"]].append(signal)
    written = []
    try:
        for name, signals in by_signal.items():
            figure, axes = plt.subplots(figsize=(7, 4))
            # What the axes must show: the values, the trends and the limits. A band's far edge
            # can run off by orders of magnitude (a quadratic in log space) and would squash them.
            shown: list[float] = []
            for signal in signals:
                label = signal["module"] or name
                observed = signal["observed"]
                lines = axes.plot([p[0] for p in observed], [p[1] for p in observed], label=label)
                shown += [p[1] for p in observed]
                if signal["status"] == "fitted":
                    band = signal["band"]
                    steps = [p[0] for p in band]
                    colour = lines[0].get_color()
                    axes.plot(steps, [p[1] for p in band], "--", color=colour, linewidth=1)
                    shown += [p[1] for p in band]
                    axes.fill_between(
                        steps, [p[2] for p in band], [p[3] for p in band], color=colour, alpha=0.15
                    )
                if signal["limit"]:
                    axes.axhline(signal["limit"]["value"], color="black", linestyle=":")
                    shown.append(signal["limit"]["value"])
                crossing = signal.get("crossing")
                if crossing:
                    # The crossing's step, and its interval (to the planned end where open).
                    low, high = crossing["interval"]
                    end = forecast["planned_steps"] if high is None else high
                    axes.axvspan(low, end, color="red", alpha=0.08)
                    axes.axvline(crossing["step"], color="red", linestyle="--", linewidth=1)
            values = [v for v in shown if v is not None and math.isfinite(v)]
            # Fitted by factors, or spanning more than a hundredfold (a limit far above the
            # values): drawn on a log scale.
            positive = bool(values) and min(values) > 0
            wide = positive and max(values) > 100 * min(values)
            log_scale = positive and (wide or all(s.get("space") == "log" for s in signals))
            if log_scale:
                axes.set_yscale("log")
            _fit_to(axes, values, log_scale)
            axes.axvline(forecast["observed_steps"], color="grey", linewidth=0.8)
            axes.set_xlabel("step (planned run)")
            axes.set_title(f"{name}: observed, and forecast with its band")
            if len(signals) <= 12:
                axes.legend(fontsize=7)
            path = out_dir / f"{prefix}_{name}.png"
            # A temporary file renamed into place: never written through a link left there.
            write_atomically(path, lambda f, fig=figure: fig.savefig(f, format="png", dpi=90))
            plt.close(figure)
            written.append(path)
    except Exception as error:  # a plot never costs the forecast
        log.warning("forecast plots stopped: %s", error)
    return written


def _fit_to(axes: Any, values: list[float], log_scale: bool) -> None:
    """The vertical range: the values with a margin (a factor of 4 on a log scale)."""
    if not values:
        return
    low, high = min(values), max(values)
    if log_scale:
        axes.set_ylim(low / 4, high * 4)
    else:
        margin = (high - low) * 0.25 or abs(high) * 0.25 or 1.0
        axes.set_ylim(low - margin, high + margin)
