"""Does the forecast from a quarter of a run name the limit the whole run crosses? And do healthy
runs, forecast to 4x and 10x their length, stay quiet? (docs/forecast.md reports its output.)

    python scripts/validate_forecast.py --steps 200 --log-every 5 --out validation.json

``--train-on STEPS`` checks the long-run alarms: each healthy constant-rate run whose forecast to
4x or 10x alarms is trained on, the same run, to STEPS, and the step it crossed at (or none) is
recorded: an alarm on a run that does cross later is no false alarm.

``--rows FILE`` also keeps each case's rows (the full run's and the quarter's), so that a change to
the forecast can be compared on the same runs without training them again.

``--threads N`` fixes torch's CPU threads: the order of a threaded sum changes the last bits, which
a run at a high learning rate amplifies, so a case's path (and whether it crosses) depends on the
thread count; docs/forecast.md reports runs with 2 (torch's default there) and with 1.

A quarter of the run must hold at least 6 log points (fit.MIN_POINTS), or every short forecast
is "unforecastable": 200 steps logged every 5 give 10.

Every case trains gpt_tiny (shrunk). With a constant learning rate (scheduler=none) the run of
a quarter of the steps is, bit for bit, the first quarter of the full run (same seed, same
batches, same updates): the script trains the full run once and forecasts from its first
quarter's rows to the full length. The ``*_cosine`` cases (warm-up and cosine decay over the
run's length) train the quarter as a run of its own, whose schedule the forecast stretches. Each
forecast is checked against what the full run did (the first log step whose signal crossed the
limit).

Cases:
- ``lr_*``: real runs at a normal and at high learning rates (and seeds), watching the attention
  logits (Wortsman et al. 2023 reproduce attention-logit growth in small models at high rates).
- ``planted``: block 0's output multiplied by exp(rate * step), so its largest activation grows
  steadily toward fp16's 65504 (the signals are measured against fp16's range while the run
  trains in fp32: fp16 on this CPU is 20-140x slower).
- ``fp16_drift_floor*`` (``--drift-seeds``, by default 0 and 1): a real slow drift of the fp16 loss
  scale. An MLP small enough to train fp16 quickly on a CPU (8x8 one-channel synthetic images, 4
  hidden layers of 64, AdamW at 1e-2 without weight decay, a short growth interval so that the scale
  tracks its equilibrium) whose gradients grow over ``--drift-steps`` (2,000) steps, so that its
  scale falls by halvings; logged every 25 steps. The run trains with the default min_scale (1: it
  never stops); the forecast and the check read the loss-scale floor given in the case's name
  (``forecast_run``'s min_scale, as ``precision.min_scale`` would set it).
  With ``--drift-horizons OBSERVED:PLANNED ...`` each drift seed is instead trained once to the
  longest plan and forecast from each horizon's first OBSERVED steps to PLANNED, against both
  floors, each forecast judged (hit, miss, early, right: ``judged``); docs/forecast.md's drift
  tables are ``--threads 1 --cases none --drift-seeds 0 1 2 3 4 5 --drift-horizons 500:2000
  2000:8000 2000:20000 5000:20000`` (and seeds 6 to 29, held out). Each drift forecast also
  carries the chance of the scale's crossing by the plan's end, and the run ends with the table of
  those chances against what the runs did (``reliability``; docs/forecast.md's is seeds 0 to 29
  at 500:1000 500:2000 2000:4000 2000:8000 2000:12000 2000:20000 5000:10000 5000:20000).
- ``*_cosine_seed*``: more seeds of the cosine cases (the step as a second time axis).
- every run that crosses nothing is a healthy run: forecast from all of it to 4x and 10x its
  length, where any crossing is a false alarm.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch

from amp_exp.build import build
from amp_exp.config.precisions import get
from amp_exp.config.preflight import run_config
from amp_exp.forecast.forecast import forecast_run
from amp_exp.tasks.blocks import model_blocks
from amp_exp.training.signals import Limits

COMMON = [
    "optimizer=adamw",
    "trainer.device=cpu",
    "trainer.eval_every=null",
    "checkpoint.every_steps=null",
    "wandb.mode=disabled",
    "diagnostics.audit=false",
]
SMALL = [
    "model=gpt_tiny",
    "dataset=synthetic_tokens",
    "model.d_model=32",
    "model.seq_len=16",
    "dataset.batch_size=16",
    *COMMON,
]
# fp16 trains about as fast as fp32 on this MLP (a 2,000-step run in about 20 s on one thread).
FP16_DRIFT = [
    "model=mlp",
    "model.hidden_dim=64",
    "model.depth=4",
    "dataset=synthetic",
    "dataset.image_size=8",
    "dataset.channels=1",
    # Noisy images that the model fits slowly: the loss stays high and the gradients grow.
    "dataset.noise_std=8",
    "dataset.batch_size=32",
    "dataset.num_workers=0",
    "optimizer.lr=1e-2",
    "optimizer.weight_decay=0",
    "precision=fp16",
    "precision.growth_interval=5",
    *COMMON,
]


def plant_growth(model: torch.nn.Module, rate: float) -> None:
    """Block 0's output times exp(rate * training forwards so far): a steady, known growth."""
    block = model_blocks(model)[0]
    count = {"n": 0}

    def grow(module, args, output):
        if module.training:
            count["n"] += 1
        return output * math.exp(rate * count["n"])

    block.register_forward_hook(grow)


def train(
    steps: int, overrides: list[str], planted_rate: float | None, base: list[str] = SMALL
) -> list[dict]:
    schedule = [] if COSINE in overrides else ["scheduler=none"]
    built = build(run_config([*base, *schedule, f"trainer.max_steps={steps}", *overrides]))
    if planted_rate is not None:
        plant_growth(built.model, planted_rate)
        built.engine.signals.limits = Limits.of(get("fp16").spec)
    rows: list[dict] = []
    built.engine.fit(rows.append)
    return rows


def first_crossed(rows: list[dict], floor: float = 1.0) -> dict | None:
    """The first log step at which a limited signal was past its limit in the run itself (the
    loss scale's: ``floor``, by default precision.min_scale's 1)."""
    for row in sorted(rows, key=lambda r: r["step"]):
        if row["kind"] == "train" and row.get("scale") is not None and row["scale"] < floor:
            return {"step": row["step"], "signal": "scale", "module": None}
        if row["kind"] != "signals":
            continue
        for key, value in row.items():
            signal, _, module = key.partition("/")
            limit = {"act_absmax": row["format_max"], "attn_logit_max": row["attn_logit_limit"]}
            if signal in limit and value is not None and value >= limit[signal]:
                return {"step": row["step"], "signal": signal, "module": module}
    return None


def judged(forecast: dict | None, crossed: int | None, plan: int) -> str:
    """A forecast's verdict against the step the run first logged a value past the limit:
    "hit" (the crossing within the plan inside the forecast's interval), "miss", "early" (a
    crossing claimed in a plan the run did not cross in), or "right" (silent, and none)."""
    if crossed is not None and crossed <= plan:
        if forecast is None:
            return "miss"
        low, high = forecast["interval"]
        return "hit" if low <= crossed <= (math.inf if high is None else high) else "miss"
    return "right" if forecast is None else "early"


def case(
    name: str,
    steps: int,
    overrides: list[str],
    planted_rate: float | None = None,
    train_on: int | None = None,
    base: list[str] = SMALL,
    floor: float = 1.0,
) -> dict:
    started = time.perf_counter()
    rows = train(steps, overrides, planted_rate, base)
    if COSINE in overrides:
        # A schedule over the run's length: the short run is its own run, whose schedule the
        # forecast stretches to the full length.
        quarter = train(steps // 4, overrides, planted_rate, base)
    else:
        quarter = [row for row in rows if row["step"] <= steps // 4]
    short = forecast_run(quarter, steps, min_scale=floor)["first_crossing"]
    actual = first_crossed(rows, floor)
    result = {
        "case": name,
        "overrides": overrides,
        "steps": steps,
        "train_s": time.perf_counter() - started,
        "full_run_crossed": actual,
        "quarter_forecast": short,
    }
    if actual is not None:
        # The same signal (the module may differ where several cross at one log step), and the
        # full run's crossing step inside the forecast's interval.
        result["hit"] = (
            short is not None
            and short["signal"] == actual["signal"]
            and judged(short, actual["step"], steps) == "hit"
        )
        result["seen_at_step"] = steps // 4
    else:
        result["false_alarm_quarter"] = short is not None
        alarms = {
            f"{k}x": forecast_run(rows, k * steps, min_scale=floor)["first_crossing"]
            for k in (4, 10)
        }
        result["false_alarms_full"] = alarms
        if train_on and any(alarms.values()) and COSINE not in overrides:
            # With a constant rate the longer run is this one carried on, bit for bit.
            longer = first_crossed(train(train_on, overrides, planted_rate, base), floor)
            result["trained_on"] = {"steps": train_on, "crossed": longer}
    max_attn = max(
        (
            v
            for r in rows
            if r["kind"] == "signals"
            for k, v in r.items()
            if k.startswith("attn_logit_max/") and v is not None
        ),
        default=None,
    )
    result["max_attention_logit"] = max_attn
    scales = [r["scale"] for r in rows if r["kind"] == "train" and r.get("scale") is not None]
    result["loss_scale_first_last_min"] = [scales[0], scales[-1], min(scales)] if scales else None
    print(json.dumps(result), flush=True)
    result["rows"] = {"full": rows, "quarter": quarter}
    return result


def drift_horizons(seed: int, horizons: list[tuple[int, int]]) -> list[dict]:
    """The fp16 drift trained once to the longest plan, and forecast from each horizon's observed
    steps to its planned ones against each floor of DRIFT_FLOORS."""
    started = time.perf_counter()
    longest = max(plan for _, plan in horizons)
    rows = train(longest, ["trainer.log_every=25", f"seed={seed}"], None, FP16_DRIFT)
    results = []
    for floor in DRIFT_FLOORS:
        crossed = first_crossed(rows, floor)
        step = None if crossed is None else crossed["step"]
        for observed, plan in horizons:
            result = {"case": f"fp16_drift_seed{seed}", "floor": floor, "observed": observed}
            result |= {"planned": plan, "crossed": step, "train_s": time.perf_counter() - started}
            if step is not None and step <= observed:
                # The short run itself would have stopped there: no forecast to judge.
                result["verdict"] = "crossed before"
            else:
                seen = [row for row in rows if row["step"] <= observed]
                forecast = forecast_run(seen, plan, min_scale=floor)
                first = forecast["first_crossing"]
                (scale,) = [s for s in forecast["signals"] if s["signal"] == "scale"]
                result |= {"forecast": first, "verdict": judged(first, step, plan)}
                result |= {"chance": scale.get("chance")}
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


def reliability(results: list[dict]) -> list[str]:
    """The drift forecasts' chances of the scale's crossing by the plan's end against what the
    runs did: per band of chance, the forecasts, their mean chance and the share that crossed
    (docs/forecast.md, "Chance by the end, measured"), as a markdown table."""
    judged_ones = [r for r in results if r.get("chance")]
    lines = ["| chance | forecasts | mean chance | crossed |", "|---|---|---|---|"]
    for low, high in itertools.pairwise(CHANCE_BANDS):
        band = [
            r
            for r in judged_ones
            if low <= r["chance"]["value"] < high or high == 1 == r["chance"]["value"]
        ]
        if band:
            crossed = [r["crossed"] is not None and r["crossed"] <= r["planned"] for r in band]
            mean = sum(r["chance"]["value"] for r in band) / len(band)
            lines.append(
                f"| {low:.0%} to {high:.0%} | {len(band)} | {mean:.0%} "
                f"| {sum(crossed) / len(band):.0%} ({sum(crossed)}) |"
            )
    return lines


CHANCE_BANDS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
LR_HIGH, LR_LOW, COSINE = "optimizer.lr=3e-2", "optimizer.lr=1e-3", "scheduler=cosine"
# The drift's loss-scale floors: one its full run falls below, one it stays above.
DRIFT_FLOORS = (65536, 16384)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=None)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--drift-steps", type=int, default=2000, help="the fp16 drift's full run")
    parser.add_argument(
        "--drift-seeds", type=int, nargs="*", default=[0, 1], help="the fp16 drift's seeds"
    )
    parser.add_argument(
        "--drift-horizons",
        nargs="*",
        default=None,
        metavar="OBSERVED:PLANNED",
        help="instead of the drift cases: each drift seed trained once to the longest plan and "
        "forecast from each horizon's observed steps to its planned ones (500:2000 5000:20000)",
    )
    parser.add_argument("--rows", default=None, help="also write each case's rows here (JSON)")
    parser.add_argument("--cases", nargs="*", help="run only these cases (default: all)")
    parser.add_argument(
        "--train-on", type=int, default=None, help="train alarming healthy runs to this step"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's CPU threads (default: torch's own); a high-rate run's path depends on it",
    )
    args = parser.parse_args()
    if args.threads:
        # The order of a threaded sum changes the last bits, which a run at a high learning rate
        # amplifies: the same case crosses at one thread count and not at another.
        torch.set_num_threads(args.threads)
    steps = args.steps
    # exp(rate * 3/4 of the steps) times an activation near 3: 65504 at about 75% of the run.
    planted_rate = math.log(65504 / 3) / (0.75 * steps)
    cases = [
        ("lr_1e-3_seed0", ["optimizer.lr=1e-3", "seed=0"], None),
        ("lr_1e-3_seed1", ["optimizer.lr=1e-3", "seed=1"], None),
        ("lr_3e-2", [LR_HIGH], None),
        ("planted", [LR_LOW], planted_rate),
        # More seeds and rates of the same two, for a measured coverage of the interval.
        *((f"lr_3e-2_seed{seed}", [LR_HIGH, f"seed={seed}"], None) for seed in (1, 2, 3)),
        ("lr_2e-2", ["optimizer.lr=2e-2"], None),
        ("lr_5e-2", ["optimizer.lr=5e-2"], None),
        *((f"planted_seed{seed}", [LR_LOW, f"seed={seed}"], planted_rate) for seed in (1, 2)),
        # Warm-up and cosine decay: the forecast's axis is the cumulative learning rate.
        ("lr_3e-2_cosine", [LR_HIGH, COSINE], None),
        ("planted_cosine", [LR_LOW, COSINE], planted_rate),
        *((f"lr_3e-2_cosine_seed{s}", [LR_HIGH, COSINE, f"seed={s}"], None) for s in (1, 2)),
        *((f"planted_cosine_seed{s}", [LR_LOW, COSINE, f"seed={s}"], planted_rate) for s in (1, 2)),
    ]
    cases = [c for c in cases if not args.cases or c[0] in args.cases]
    logging = [f"trainer.log_every={args.log_every}"]
    results = [
        case(name, steps, [*overrides, *logging], rate, args.train_on)
        for name, overrides, rate in cases
    ]
    if args.drift_horizons:
        horizons = [tuple(int(v) for v in h.split(":")) for h in args.drift_horizons]
        for seed in args.drift_seeds:
            results.extend(drift_horizons(seed, horizons))
        print("\n".join(reliability(results)), flush=True)
    for seed in [] if args.drift_horizons else args.drift_seeds:
        for floor in DRIFT_FLOORS:
            name = f"fp16_drift_floor{floor}" + (f"_seed{seed}" if seed else "")
            if not args.cases or name in args.cases:
                drift = ["trainer.log_every=25", f"seed={seed}"]
                results.append(case(name, args.drift_steps, drift, base=FP16_DRIFT, floor=floor))
    if args.rows:
        # The runs' rows, so that a change to the forecast can be checked without training again.
        with open(args.rows, "w", encoding="utf-8") as out:
            json.dump({r["case"]: r.pop("rows") for r in results if "rows" in r}, out)
    for result in results:
        result.pop("rows", None)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
