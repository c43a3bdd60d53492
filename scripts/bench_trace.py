"""How long ``python -m amp_exp.predict`` takes to trace and predict Llama-3 8B on this CPU: the
torchtitan anchor's setting of amp_exp/predict/published.json (seq 8192, local batch 2,
activation checkpointing, 8 GPUs), run as a user runs it. Prints the CPU (from /proc/cpuinfo),
the load average before and after, the command's wall time and its CPU time (user + system, which
a machine shared with other jobs stretches less than the wall time), then, with --phases, where
the time goes in one process: imports, config, the trace (model built on the meta device, forward
and backward) and the roofline.

    python scripts/bench_trace.py [--phases]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from amp_exp.predict.published import published_rows, row_overrides  # noqa: E402

ROW = "llama3_8b_torchtitan"


def cpu_name() -> str:
    """The CPU's model name and the cores this process may use."""
    names = [
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    ]
    return f"{names[0] if names else 'unknown CPU'}, {len(os.sched_getaffinity(0))} cores"


def overrides() -> list[str]:
    row = next(row for row in published_rows() if row["name"] == ROW)
    return row_overrides(row, row["precision"])


def command_time(args: list[str]) -> tuple[float, float]:
    """The command's wall time and CPU time (user + system of the child), in seconds."""
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "amp_exp.predict", *args, f"hydra.run.dir={directory}"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, check=True, cwd=REPO, capture_output=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu


def phases(args: list[str]) -> list[tuple[str, float]]:
    """Wall time of each phase of one prediction, in this process."""
    found = []
    start = time.perf_counter()
    from amp_exp.config.preflight import run_config
    from amp_exp.predict.predict import predict_trace
    from amp_exp.predict.trace import trace_step

    found.append(("imports", time.perf_counter() - start))
    start = time.perf_counter()
    cfg = run_config(args)
    found.append(("config", time.perf_counter() - start))
    start = time.perf_counter()
    trace = trace_step(cfg)
    found.append((f"trace ({len(trace.ops)} ops)", time.perf_counter() - start))
    start = time.perf_counter()
    predict_trace(cfg, trace)
    found.append(("roofline", time.perf_counter() - start))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", action="store_true", help="also time each phase in-process")
    timed_phases = parser.parse_args().phases
    args = overrides()
    load = os.getloadavg()[0]
    wall, cpu = command_time(args)
    print(f"CPU: {cpu_name()}; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"python -m amp_exp.predict ({ROW}): {wall:.1f} s wall, {cpu:.1f} s CPU")
    if timed_phases:
        print("; ".join(f"{name} {seconds:.1f} s" for name, seconds in phases(args)))


if __name__ == "__main__":
    main()
