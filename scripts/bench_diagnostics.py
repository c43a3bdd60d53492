"""Cost of the AMP diagnostics at their defaults.

    python scripts/bench_diagnostics.py --rounds 3 model=tiny_cnn precision=fp32

Two measures. A/B: each round runs ``python -m amp_exp`` twice, alternating which goes first,
with the defaults (checks on the first steps, gradient range every 100 steps) and with
``diagnostics.checks=false diagnostics.underflow_every=0``; the cost is the relative drop of
the median samples/s. On a shared machine that drop is dominated by noise, so the script also
times the diagnostics' own work in one run: the seconds spent inside their optimizer hooks,
as a share of the run's training time.
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


def hook_share(overrides: list[str]) -> dict[str, float]:
    """Seconds inside the diagnostics hooks over seconds of training, in this process."""
    import time

    import amp_exp.training.diagnostics
    from amp_exp.config.preflight import run_config
    from amp_exp.run import train

    spent = 0.0
    for name in ("_before_step", "_after_step"):
        hook = getattr(amp_exp.training.diagnostics.Diagnostics, name)

        def timed(self, *args, _hook=hook):
            nonlocal spent
            started = time.perf_counter()
            try:
                return _hook(self, *args)
            finally:
                spent += time.perf_counter() - started

        setattr(amp_exp.training.diagnostics.Diagnostics, name, timed)
    fixed = ["wandb.mode=disabled", "checkpoint.every_steps=null", "trainer.eval_every=null"]
    cfg = run_config([*fixed, *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        train(cfg, Path(tmp))
        total = time.perf_counter() - started
    return {"hook_s": spent, "train_s": total, "hook_share": spent / total}


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
    result = {"on_samples_per_s": on, "off_samples_per_s": off, "ab_cost": 1 - on / off, **rates}
    print(json.dumps({**result, **hook_share(args.overrides)}, indent=2))


if __name__ == "__main__":
    main()
