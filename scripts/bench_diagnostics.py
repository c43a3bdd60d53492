"""Cost of the AMP diagnostics at their defaults: throughput with them on vs. off.

    python scripts/bench_diagnostics.py --rounds 3 model=tiny_cnn precision=fp32

Each round runs ``python -m amp_exp`` twice, alternating which goes first: once with the
defaults (checks on the first steps, gradient range every 100 steps) and once with
``diagnostics.checks=false diagnostics.underflow_every=0``. Throughput is each run's own timed
samples/s (warm-up excluded); the cost is the relative drop of the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OFF = ["diagnostics.checks=false", "diagnostics.underflow_every=0"]


def samples_per_s(run_dir: Path, overrides: list[str]) -> float:
    command = [
        sys.executable,
        "-m",
        "amp_exp",
        "wandb.mode=disabled",
        "checkpoint.every_steps=null",
        "trainer.eval_every=null",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    return json.loads((run_dir / "summary.json").read_text())["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = ("on", "off") if round_ % 2 == 0 else ("off", "on")
            for side in order:
                extra = OFF if side == "off" else []
                run_dir = Path(tmp) / f"{side}{round_}"
                rates[side].append(samples_per_s(run_dir, [*args.overrides, *extra]))
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    print(
        json.dumps(
            {"on_samples_per_s": on, "off_samples_per_s": off, "cost": 1 - on / off, **rates},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
