"""Wall time of ``python -m amp_exp.sensitivity`` on gpt_tiny at its defaults.

    python scripts/bench_sensitivity.py --repeats 3

Each repeat is a fresh process, timed from its start to its exit, and split at the lines it logs:
start-up (imports, composing, data and model) until it announces the fp32 reference, then the
measurement (the reference and each precision's modules) until it writes sensitivity.md. The
target: at most 60 s on 2 CPU cores. Prints JSON: medians, and every repeat's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPT_TINY = ["model=gpt_tiny", "dataset=synthetic_tokens", "wandb.mode=disabled"]
TARGET_S = 60.0
MEASURING = "fp32 reference, then"
WRITTEN = "sensitivity: "


def one_run(overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "amp_exp.sensitivity", *overrides]
        command.append(f"hydra.run.dir={run_dir}")
        started = time.perf_counter()
        process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        marks: dict[str, float] = {}
        for line in process.stdout:
            for name, marker in (("measuring", MEASURING), ("written", WRITTEN)):
                if marker in line and name not in marks:
                    marks[name] = time.perf_counter() - started
        total = time.perf_counter() - started
        if process.wait() != 0 or len(marks) < 2:
            raise SystemExit(f"{' '.join(command)} failed")
    return {
        "total_s": total,
        "startup_s": marks["measuring"],
        "measure_s": marks["written"] - marks["measuring"],
    }


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="extra overrides (default: gpt_tiny's)")
    args = parser.parse_args()
    runs = [one_run([*GPT_TINY, *args.overrides]) for _ in range(args.repeats)]
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(
        json.dumps(
            {
                "command": "python -m amp_exp.sensitivity " + " ".join(GPT_TINY + args.overrides),
                "cpu": cpu_name(),
                "cores": os.cpu_count(),
                # The machine is shared: the load says how much of it the runs had.
                "load_average_1min": os.getloadavg()[0],
                **medians,
                "target_s": TARGET_S,
                "within_target": max(run["total_s"] for run in runs) <= TARGET_S,
                "runs": runs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
