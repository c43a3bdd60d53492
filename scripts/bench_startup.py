"""Start-up cost: time to the first training step of ``python -m amp_exp``.

    python scripts/bench_startup.py --rounds 9
    python scripts/bench_startup.py --rounds 9 --baseline /path/to/other/checkout --threads 1

Clocks, each from process start to a line the process prints: ``import torch``; a minimal
hand-written script that takes one SGD step on a small CNN (constructing any torch.optim
optimizer imports torch._dynamo, a cost every PyTorch training script pays); ``python -m
amp_exp`` until it logs step 1 (``trainer.log_every=1``); and with ``--baseline``, the same
command run from another checkout (say, the commit before a change).

Each round runs every clock once, in an order that rotates from round to round, so that a busy
spell of a shared machine hits all of them alike; the report gives each clock's median and the
median of the per-round differences, which is what noise disturbs least. Each clock is read as
wall time and as the CPU time the process had used when it printed the line (user + system,
all threads): on a machine other jobs share, the CPU time changes far less, above all with
``--threads 1``, where no intra-op thread spins waiting for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

IMPORT_TORCH = "import torch; print('ready', flush=True)"
HAND_WRITTEN_FIRST_STEP = """
import torch
from torch import nn
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
images, labels = torch.randn(128, 3, 32, 32), torch.randint(10, (128,))
nn.functional.cross_entropy(model(images), labels).backward()
optimizer.step()
print('ready', flush=True)
"""
FIRST_STEP_LINE = "] 1/2"


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a running process has used: what a busy machine
    changes far less than the wall clock (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_to_line(
    command: list[str], marker: str, cwd: Path, threads: int | None
) -> tuple[float, float]:
    """(wall seconds, CPU seconds) from the start of ``command`` to its first line with
    ``marker``."""
    # The checkout's own amp_exp, whichever one an editable install points at.
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = None
    for line in process.stdout:
        if seen is None and marker in line:
            seen = time.perf_counter() - started, cpu_seconds(process.pid)
    if process.wait() != 0 or seen is None:
        raise SystemExit(f"{command} failed or never printed {marker!r}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline", type=Path, help="another checkout to time the same way")
    parser.add_argument(
        "--threads", type=int, help="OMP_NUM_THREADS for every clock (1: no spinning threads)"
    )
    parser.add_argument("overrides", nargs="*", help="extra config overrides for the run")
    args = parser.parse_args()
    python = sys.executable
    with tempfile.TemporaryDirectory() as tmp:

        def amp_exp(name: str) -> list[str]:
            return [
                python,
                "-m",
                "amp_exp",
                "trainer.max_steps=2",
                "trainer.log_every=1",
                "wandb.mode=disabled",
                f"hydra.run.dir={tmp}/{name}",
                *args.overrides,
            ]

        clocks = {
            "import_torch_s": ([python, "-c", IMPORT_TORCH], "ready", REPO),
            "hand_written_first_step_s": ([python, "-c", HAND_WRITTEN_FIRST_STEP], "ready", REPO),
            "amp_exp_first_step_s": (amp_exp("run"), FIRST_STEP_LINE, REPO),
        }
        if args.baseline:
            baseline = args.baseline.resolve()
            clocks["baseline_first_step_s"] = (amp_exp("baseline"), FIRST_STEP_LINE, baseline)
        walls: dict[str, list[float]] = {name: [] for name in clocks}
        cpus: dict[str, list[float]] = {name: [] for name in clocks}
        names = list(clocks)
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                wall, cpu = time_to_line(*clocks[name], args.threads)
                walls[name].append(wall)
                cpus[name].append(cpu)
            # A completed run's directory takes only a resume (results/ownership.py): every round
            # starts fresh runs.
            for run_dir in Path(tmp).iterdir():
                shutil.rmtree(run_dir)
    result: dict[str, dict | int] = {"rounds": args.rounds}
    for label, times in (("wall", walls), ("cpu", cpus)):

        def paired(a: str, b: str, times: dict[str, list[float]] = times) -> float:
            return statistics.median(x - y for x, y in zip(times[a], times[b], strict=True))

        figures = {name: statistics.median(values) for name, values in times.items()}
        figures["overhead_vs_import_torch_s"] = paired("amp_exp_first_step_s", "import_torch_s")
        figures["overhead_vs_hand_written_s"] = paired(
            "amp_exp_first_step_s", "hand_written_first_step_s"
        )
        if args.baseline:
            figures["baseline_overhead_vs_hand_written_s"] = paired(
                "baseline_first_step_s", "hand_written_first_step_s"
            )
            figures["change_vs_baseline_s"] = paired(
                "amp_exp_first_step_s", "baseline_first_step_s"
            )
        result[label] = figures
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
