"""Engine vs. a hand-written AMP loop: median step time, peak memory and final state.

Each side runs in its own process (peak RSS is per process), and the sides alternate over
several rounds so that drift in machine load hits both alike. Step times are read from the wall
clock and, steadier on a shared machine, from the process's CPU time. Both sides build the same
model, optimizer, scheduler and data from the same config and seed; only the loop differs. The
hand loop is the textbook one: autocast, scale, backward, unscale_, clip, step, update.

    python scripts/bench_parity.py --model tiny_cnn --precision fp32
    python scripts/bench_parity.py --model resnet18 --precision bf16 --rounds 3
    python scripts/bench_parity.py --model hf_llama_tiny --dataset synthetic_tokens  # transformers
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def overrides(args: argparse.Namespace) -> list[str]:
    """The shared config: the engine's defaults for logging, the rest pinned for both sides."""
    images = args.dataset == "synthetic"
    return [
        f"model={args.model}",
        f"dataset={args.dataset}",
        f"precision={args.precision}",
        f"trainer.device={args.device}",
        f"trainer.max_steps={args.steps}",
        f"dataset.batch_size={args.batch_size}",
        *([f"dataset.image_size={args.image_size}"] if images else []),
        f"dataset.train_size={args.batch_size * 16}",
        "trainer.eval_every=null",
        "checkpoint.every_steps=null",
        *args.override,
    ]


def run_side(side: str, args: argparse.Namespace, state_path: Path) -> dict:
    """Train one side in this process; return per-step times (s) and peak memory."""
    import torch
    import torch.nn.functional as F

    from amp_exp.config.preflight import run_config
    from amp_exp.run import build
    from amp_exp.training.meters import peak_memory_bytes, reset_peak_memory, synchronize

    cfg = run_config(overrides(args))
    built = build(cfg)
    engine, device = built.engine, built.device
    optimizer = engine.optimizer
    stamps: list[tuple[float, float]] = []

    def stamp(*_: object) -> None:
        # The same instrumentation on both sides: one synchronized clock read per step.
        synchronize(device)
        stamps.append((time.perf_counter(), time.process_time()))

    optimizer.register_step_post_hook(stamp)
    reset_peak_memory(device)
    if side == "engine":
        engine.fit(lambda row: None)
    else:
        hand_written_loop(engine, built.model, F, torch)
    torch.save(built.model.state_dict(), state_path)
    steps = list(itertools.pairwise(stamps))[args.warmup :]
    return {
        "step_times": [b[0] - a[0] for a, b in steps],
        # The process's CPU time per step: what other jobs on a shared machine disturb least.
        "step_cpu_times": [b[1] - a[1] for a, b in steps],
        "peak_mem_bytes": peak_memory_bytes(device),
    }


def hand_written_loop(engine, model, F, torch) -> None:
    """The textbook AMP loop, over the engine's own built objects and data order."""
    precision, optimizer, scheduler = engine.precision, engine.optimizer, engine.scheduler
    scaler = torch.amp.GradScaler(engine.device.type, enabled=precision.scaler is not None)
    if precision.scaler is not None:
        scaler.load_state_dict(precision.scaler.state_dict())
    clip = precision.cfg.clip_grad_norm
    data, steps = engine.data, engine.total_steps
    epoch, done = 0, 0
    model.train()
    while done < steps:
        data.set_epoch(epoch)
        for inputs, targets in data:
            if done == steps:
                break
            with torch.autocast(
                engine.device.type,
                precision.spec.compute_dtype.torch,
                enabled=precision.uses_autocast,
            ):
                if engine.task.unit == "tokens":
                    # Next-token prediction: fp32 logits over every position, as nanoGPT.
                    inputs, targets = inputs.long(), targets.long()
                    logits = model(inputs).float().flatten(0, 1)
                    loss = F.cross_entropy(logits, targets.flatten())
                else:
                    loss = F.cross_entropy(model(inputs), targets)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scale_before = scaler.get_scale() if scaler.is_enabled() else None
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            skipped = scale_before is not None and scaler.get_scale() < scale_before
            if scheduler is not None and not skipped:
                scheduler.step()
            done += 1
        epoch += 1


def spawn(side: str, args: argparse.Namespace, state_path: Path) -> dict:
    command = [sys.executable, __file__, "--side", side, "--state", str(state_path)]
    command += sys.argv[1:]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{side} side failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def states_equal(a: Path, b: Path) -> tuple[bool, float]:
    import torch

    left, right = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    largest = max(
        (left[k].double() - right[k].double()).abs().max().item()
        for k in left
        if left[k].is_floating_point()
    )
    return all(torch.equal(left[k], right[k]) for k in left), largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_cnn")
    parser.add_argument("--dataset", default="synthetic", choices=["synthetic", "synthetic_tokens"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--override", action="append", default=[], help="extra config override")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--side", choices=["engine", "hand"], help=argparse.SUPPRESS)
    parser.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args.side, args, args.state)))
        return

    times: dict[str, list[float]] = {"engine": [], "hand": []}
    cpu_times: dict[str, list[float]] = {"engine": [], "hand": []}
    peaks: dict[str, list[int]] = {"engine": [], "hand": []}
    with tempfile.TemporaryDirectory() as tmp:
        states = {side: Path(tmp) / f"{side}.pt" for side in times}
        for round_ in range(args.rounds):
            order = ("engine", "hand") if round_ % 2 == 0 else ("hand", "engine")
            for side in order:
                result = spawn(side, args, states[side])
                times[side] += result["step_times"]
                cpu_times[side] += result["step_cpu_times"]
                peaks[side].append(result["peak_mem_bytes"])
        identical, max_diff = states_equal(states["engine"], states["hand"])
    medians = {side: statistics.median(values) for side, values in times.items()}
    cpu_medians = {side: statistics.median(values) for side, values in cpu_times.items()}
    report = {
        "model": args.model,
        "dataset": args.dataset,
        "precision": args.precision,
        "steps_timed_per_side": len(times["engine"]),
        "engine_median_ms": 1000 * medians["engine"],
        "hand_median_ms": 1000 * medians["hand"],
        "ratio": medians["engine"] / medians["hand"],
        "engine_median_cpu_ms": 1000 * cpu_medians["engine"],
        "hand_median_cpu_ms": 1000 * cpu_medians["hand"],
        "cpu_ratio": cpu_medians["engine"] / cpu_medians["hand"],
        "engine_peak_mem_bytes": max(peaks["engine"]),
        "hand_peak_mem_bytes": max(peaks["hand"]),
        "state_dicts_identical": identical,
        "max_abs_param_diff": max_diff,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
