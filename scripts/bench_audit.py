"""Cost of the precision audit (training/audit/) in a default run.

    python scripts/bench_audit.py --rounds 3                   # python -m amp_exp's defaults
    python scripts/bench_audit.py --rounds 0 model=gpt_tiny dataset=synthetic_tokens

Two measures, as in bench_diagnostics.py. The audit's own cost, in one process: the seconds of
the audited step (recording, the saved-tensor count, the verdict) less the run's median step, as
a share of the run's seconds, by the wall clock and by CPU time. And A/B: each round runs
``python -m amp_exp`` with the audit on and with ``diagnostics.audit=false``, alternating which
goes first; the cost is the relative rise of the median wall time. On a shared machine that rise
is mostly noise, which is why the first measure exists.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXED = ["wandb.mode=disabled", "checkpoint.every_steps=null"]


def wall_s(run_dir: Path, overrides: list[str]) -> float:
    command = [sys.executable, "-m", "amp_exp", *FIXED, f"hydra.run.dir={run_dir}", *overrides]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    return json.loads((run_dir / "summary.json").read_text())["wall_s"]


def audit_share(overrides: list[str]) -> dict[str, float]:
    """The audited step's seconds beyond an ordinary step, over the run's: by the wall clock,
    and by the process's CPU time, which a busy neighbour disturbs far less."""
    from amp_exp.config.preflight import run_config
    from amp_exp.run import train
    from amp_exp.training.engine import Engine

    steps: list[tuple[float, float]] = []  # (wall, CPU) seconds of each step
    train_step = Engine.train_step

    def timed(self, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return train_step(self, *args, **kwargs)
        finally:
            steps.append((time.perf_counter() - wall, time.process_time() - cpu))

    cfg = run_config([*FIXED, *overrides])
    cpu_started = time.process_time()
    Engine.train_step = timed
    try:
        with tempfile.TemporaryDirectory() as tmp:
            summary = train(cfg, Path(tmp))
    finally:
        Engine.train_step = train_step
    cpu_s = time.process_time() - cpu_started
    audited = summary["precision_audit"]["step"] - 1
    others = steps[:audited] + steps[audited + 1 :]
    extra_wall = steps[audited][0] - statistics.median(wall for wall, _ in others)
    extra_cpu = steps[audited][1] - statistics.median(cpu for _, cpu in others)
    return {
        "audited_step": audited + 1,
        "audited_step_s": steps[audited][0],
        "median_step_s": statistics.median(wall for wall, _ in others),
        "wall_s": summary["wall_s"],
        "wall_share": extra_wall / summary["wall_s"],
        "audited_step_cpu_s": steps[audited][1],
        "median_step_cpu_s": statistics.median(cpu for _, cpu in others),
        "run_cpu_s": cpu_s,
        "cpu_share": extra_cpu / cpu_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds; 0 = none")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print(json.dumps(audit_share(args.overrides), indent=2), flush=True)
    if not args.rounds:
        return
    walls: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = ("on", "off") if round_ % 2 == 0 else ("off", "on")
            for side in order:
                extra = ["diagnostics.audit=false"] if side == "off" else []
                run_dir = Path(tmp) / f"{side}{round_}"
                walls[side].append(wall_s(run_dir, [*args.overrides, *extra]))
    on, off = statistics.median(walls["on"]), statistics.median(walls["off"])
    result = {"on_wall_s": on, "off_wall_s": off, "ab_cost": on / off - 1, **walls}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
