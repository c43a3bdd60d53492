"""Cost of the causal check of task=lm (tasks/workload.check_causal) in a default run.

    python scripts/bench_causal.py model=gpt_tiny dataset=synthetic_tokens
    python scripts/bench_causal.py model=hf_llama_tiny dataset=synthetic_tokens

One process trains the run (``amp_exp.run.train``) with the check timed where the build calls
it, by the wall clock and by CPU time; then the same check is timed again ``--repeats`` times on
the same model and batch, warm. Printed as JSON: the check's seconds and their share of the
run's wall time (summary.json's wall_s: the build, the check within it, and the training).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

FIXED = ["wandb.mode=disabled", "checkpoint.every_steps=null"]


def timed(call) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from amp_exp.config.preflight import run_config
    from amp_exp.run import train
    from amp_exp.tasks import workload

    check = workload.check_causal
    calls: list[tuple] = []
    seconds: list[tuple[float, float]] = []

    def recorded(*call_args):
        calls.append(call_args)
        seconds.append(timed(lambda: check(*call_args)))

    cfg = run_config([*FIXED, *args.overrides])
    workload.check_causal = recorded
    try:
        with tempfile.TemporaryDirectory() as tmp:
            summary = train(cfg, Path(tmp))
    finally:
        workload.check_causal = check
    [(in_run_wall, in_run_cpu)] = seconds
    warm = [timed(lambda: check(*calls[0]))[0] for _ in range(args.repeats)]
    print(
        json.dumps(
            {
                "overrides": args.overrides,
                "status": summary["status"],
                "precision": summary["precision"],
                "check_s": in_run_wall,
                "check_cpu_s": in_run_cpu,
                "check_warm_median_s": statistics.median(warm),
                "run_wall_s": summary["wall_s"],
                "share_of_run": in_run_wall / summary["wall_s"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
