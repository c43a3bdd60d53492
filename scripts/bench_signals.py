"""Cost of the long-run signals (training/signals.py) at the default log interval.

    python scripts/bench_signals.py --rounds 6 model=gpt_tiny dataset=synthetic_tokens

Each round builds the same run twice in this process, with the signals on and with
``diagnostics.signals=false``, and times each one's training (``Engine.fit``; the build and the
imports are not timed), alternating which goes first (AB, BA, ...), so a machine that speeds up
or slows down over the rounds weighs on both alike. The cost is the median over rounds of each
round's relative difference. On a shared CPU that difference is mostly noise, so the script also
times the collector's own methods in the timed runs (arming, the weights copy and update norms,
the read), and the whole extra cost of a logged step, forward hooks and attention recomputation
included: single steps with and without the collector armed, alternating, the median extra over
the median step, spread over ``trainer.log_every`` steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from amp_exp.build import build
from amp_exp.config.preflight import run_config
from amp_exp.training.signals import SignalCollector

FIXED = ["wandb.mode=disabled", "checkpoint.every_steps=null", "trainer.eval_every=null"]
TIMED = ("arm", "before_update", "after_update", "collect")


def instrument() -> dict[str, float]:
    """Seconds spent inside the collector's methods, summed into the returned dict."""
    spent = {"s": 0.0}
    for name in TIMED:
        method = getattr(SignalCollector, name)

        def timed(self, *args, _method=method):
            started = time.perf_counter()
            try:
                return _method(self, *args)
            finally:
                spent["s"] += time.perf_counter() - started

        setattr(SignalCollector, name, timed)
    return spent


def train_s(overrides: list[str]) -> float:
    engine = build(run_config([*FIXED, *overrides])).engine
    started = time.perf_counter()
    engine.fit(lambda row: None)
    return time.perf_counter() - started


def log_step_cost(overrides: list[str], pairs: int) -> dict[str, float]:
    """The extra time of an armed step over a plain one, as a share of log_every plain steps."""
    import torch

    cfg = run_config([*FIXED, *overrides])
    engine = build(cfg).engine
    batches = engine.train_batches()
    loss = torch.zeros((), device=engine.device)
    plain, armed = [], []
    for index in range(2 * pairs + 2):
        arm = index % 2 == 1
        started = time.perf_counter()
        if arm:
            engine.signals.arm()
        engine.train_step(batches, loss, want_grad_norm=True)
        if arm:
            engine.signals.collect()
        if index >= 2:  # the first pair warms up
            (armed if arm else plain).append(time.perf_counter() - started)
    extra = statistics.median(a - p for a, p in zip(armed, plain, strict=True))
    step = statistics.median(plain)
    return {
        "step_s": step,
        "armed_extra_s": extra,
        "log_every": cfg.trainer.log_every,
        "per_step_share": extra / (step * cfg.trainer.log_every),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    spent = instrument()
    times: dict[str, list[float]] = {"on": [], "off": []}
    for round_ in range(args.rounds):
        order = ("on", "off") if round_ % 2 == 0 else ("off", "on")
        for side in order:
            extra = ["diagnostics.signals=false"] if side == "off" else []
            times[side].append(train_s([*args.overrides, *extra]))
        # Each round as it ends: on a busy machine the last rounds may never come.
        print(json.dumps({"round": round_, **{k: v[-1] for k, v in times.items()}}), flush=True)
    costs = [on / off - 1 for on, off in zip(times["on"], times["off"], strict=True)]
    result = {
        "overrides": args.overrides,
        "ab_cost_median": statistics.median(costs),
        "ab_costs": costs,
        "collector_s": spent["s"],
        "collector_share": spent["s"] / sum(times["on"]),
        **{f"{side}_train_s": values for side, values in times.items()},
        "log_step": log_step_cost(args.overrides, args.pairs),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
