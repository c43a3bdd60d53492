"""amp_exp vs. the Hugging Face Trainer on the same transformers model: tokens/s, side by side.

    python scripts/bench_hf_trainer.py --rounds 3
    python scripts/bench_hf_trainer.py --model hf_gpt2 --steps 20 --warmup 5 --batch-size 4

Both sides train the same model (the same config and seed, so the same initial weights) on the
same synthetic token windows, with AdamW (the same fused torch kernel, learning rate, betas,
weight decay), gradient clipping at 1.0 and a cosine schedule with the same warm-up, in fp32 and
in bf16 (amp_exp ``precision=bf16``, the Trainer's ``bf16=True``: autocast both). The Trainer
gets the usual causal-LM batch (``labels = input_ids``, its own loss); amp_exp its own task.
Each side runs in its own process, and the sides alternate over rounds, so that drift in the
load of a shared machine hits both alike. Both are timed the same way: a synchronized clock
read after each optimizer step (an optimizer post-step hook; the Trainer's ``on_step_end``),
and the median step after the warm-up steps, turned into tokens/s; the same from the process's
CPU time, which other jobs on a shared machine disturb far less.

The Trainer needs accelerate (``pip install -e ".[bench]"``), which amp_exp itself does not. On a
machine other jobs share, ``OMP_NUM_THREADS=1`` keeps both sides from spinning threads that wait
for a core.
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
SIDES = ("amp_exp", "hf_trainer")
# Wall time per step, and the CPU time the process spent in it (user + system, all threads): on a
# machine other jobs share, the CPU time is the steadier of the two, above all with one thread.
CLOCKS = {"wall": "step_times", "cpu": "step_cpu_times"}


def overrides(args: argparse.Namespace, precision: str) -> list[str]:
    return [
        f"model={args.model}",
        "dataset=synthetic_tokens",
        f"dataset.batch_size={args.batch_size}",
        f"dataset.train_size={args.batch_size * args.steps}",
        f"precision={precision}",
        "precision.clip_grad_norm=1.0",
        "optimizer=adamw",
        "optimizer.fused=true",
        f"trainer.device={args.device}",
        f"trainer.max_steps={args.steps}",
        "trainer.eval_every=null",
        "checkpoint.every_steps=null",
        "wandb.mode=disabled",
        *args.override,
    ]


def composed(args: argparse.Namespace, precision: str):
    from amp_exp.config.preflight import run_config

    return run_config(overrides(args, precision))


def run_amp_exp(cfg, stamps: list[tuple[float, float]], synchronize) -> int:
    """Train; return the tokens of one step."""
    from amp_exp.run import build

    built = build(cfg)
    device = built.device

    def stamp(*_: object) -> None:
        synchronize(device)
        stamps.append((time.perf_counter(), time.process_time()))

    built.engine.optimizer.register_step_post_hook(stamp)
    built.engine.fit(lambda row: None)
    return cfg.dataset.batch_size * built.engine.task.units_per_sample


def run_hf_trainer(cfg, stamps: list[tuple[float, float]], synchronize) -> int:
    """Train; return the tokens of one step."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from amp_exp.runtime.hardware import resolve_device
    from amp_exp.tasks.sampling import Placement
    from amp_exp.tasks.workload import build_workload
    from amp_exp.training.rng import seed_everything

    device = resolve_device(cfg.trainer.device)
    seed_everything(cfg.seed)  # the seed amp_exp's build sets before it builds the model
    workload = build_workload(cfg, Placement(cfg.seed, device))
    model = workload.model.hf
    inputs = workload.data.train.tensors[0].long().cpu()

    class Windows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(inputs)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"input_ids": inputs[index], "labels": inputs[index]}

    class Stamp(TrainerCallback):
        def on_step_end(self, *_: object, **__: object) -> None:
            synchronize(device)
            stamps.append((time.perf_counter(), time.process_time()))

    optimizer = cfg.optimizer
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=cfg.dataset.batch_size,
            max_steps=cfg.trainer.max_steps,
            learning_rate=optimizer.lr,
            weight_decay=optimizer.weight_decay,
            adam_beta1=optimizer.betas[0],
            adam_beta2=optimizer.betas[1],
            adam_epsilon=optimizer.eps,
            optim="adamw_torch_fused",
            max_grad_norm=cfg.precision.clip_grad_norm,
            lr_scheduler_type="cosine",
            warmup_steps=cfg.scheduler.warmup_steps,
            bf16=cfg.precision.name == "bf16",
            use_cpu=device.type == "cpu",
            logging_steps=cfg.trainer.log_every,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=cfg.seed,
        )
        trainer = Trainer(model=model, args=training, train_dataset=Windows(), callbacks=[Stamp()])
        trainer.train()
    return cfg.dataset.batch_size * inputs.shape[1]


def run_side(side: str, precision: str, args: argparse.Namespace) -> dict:
    from amp_exp.training.meters import synchronize

    cfg = composed(args, precision)
    stamps: list[tuple[float, float]] = []
    run = run_amp_exp if side == "amp_exp" else run_hf_trainer
    tokens_per_step = run(cfg, stamps, synchronize)
    steps = list(itertools.pairwise(stamps))[args.warmup :]
    return {
        "step_times": [b[0] - a[0] for a, b in steps],
        "step_cpu_times": [b[1] - a[1] for a, b in steps],
        "tokens_per_step": tokens_per_step,
    }


def spawn(side: str, precision: str) -> dict:
    command = [sys.executable, __file__, "--side", side, "--side-precision", precision]
    command += sys.argv[1:]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{side} {precision} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="hf_llama_tiny")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--override", action="append", default=[], help="extra config override")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--side-precision", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args.side, args.side_precision, args)))
        return

    report = []
    for precision in args.precisions.split(","):
        times: dict[str, dict[str, list[float]]] = {
            clock: {side: [] for side in SIDES} for clock in CLOCKS
        }
        # Each round's Trainer/amp_exp step-time ratio: its spread is this machine's noise.
        round_ratios: dict[str, list[float]] = {clock: [] for clock in CLOCKS}
        tokens_per_step = 0
        for round_ in range(args.rounds):
            results = {side: spawn(side, precision) for side in SIDES[:: 1 - 2 * (round_ % 2)]}
            for clock, key in CLOCKS.items():
                for side in SIDES:
                    times[clock][side] += results[side][key]
                medians = {side: statistics.median(results[side][key]) for side in SIDES}
                round_ratios[clock].append(medians["hf_trainer"] / medians["amp_exp"])
            tokens_per_step = results["amp_exp"]["tokens_per_step"]
        row = {"model": args.model, "precision": precision, "steps_timed_per_side": 0}
        for clock in CLOCKS:
            rate = {side: tokens_per_step / statistics.median(times[clock][side]) for side in SIDES}
            row["steps_timed_per_side"] = len(times[clock]["amp_exp"])
            row[clock] = {
                "amp_exp_tokens_per_s": rate["amp_exp"],
                "hf_trainer_tokens_per_s": rate["hf_trainer"],
                "ratio": rate["amp_exp"] / rate["hf_trainer"],
                "round_ratios": sorted(round_ratios[clock]),
            }
        report.append(row)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
