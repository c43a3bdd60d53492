"""One PNG per signal: each module's observed values and its forecast band. Optional: without
matplotlib, or if drawing fails, the forecast is whole without them."""

from __future__ import annotations

import logging
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
            for signal in signals:
                label = signal["module"] or name
                observed = signal["observed"]
                lines = axes.plot([p[0] for p in observed], [p[1] for p in observed], label=label)
                if signal["status"] == "fitted":
                    band = signal["band"]
                    steps = [p[0] for p in band]
                    colour = lines[0].get_color()
                    axes.plot(steps, [p[1] for p in band], "--", color=colour, linewidth=1)
                    axes.fill_between(
                        steps, [p[2] for p in band], [p[3] for p in band], color=colour, alpha=0.15
                    )
                if signal["limit"]:
                    axes.axhline(signal["limit"]["value"], color="black", linestyle=":")
            if all(s.get("space", "log") == "log" for s in signals):
                axes.set_yscale("log")
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
