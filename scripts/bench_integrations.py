"""What recording costs: the HF Trainer (GPT-2 4x128, batch 16 x 128 tokens) and Lightning
(ResNet-18, batch 32) with and without ``AmpExpCallback``, in alternating rounds.

Each round trains once without the callback and once with it, the order flipping every round
(AB, BA, ...) so a machine that speeds up or slows down over the rounds favours neither. A step's
time is the time between two ``on_step_end``/``on_train_batch_end`` calls of a timing callback
that both arms carry; a round's figure is the median step after ``--warmup`` steps, so the one
audited step (a traced step, off the clock by design) and the log steps weigh as they do in a
run. The overhead is with / without - 1, per round; printed as its median and range, and as a
Markdown row for docs/benchmarks.md:

    python scripts/bench_integrations.py --rounds 6 --steps 30
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch


def step_times(record: list[float]):
    """A callback of either trainer that appends each step's end time to ``record``."""
    import lightning as L
    from transformers import TrainerCallback

    class HFTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            record.append(time.perf_counter())

    class LightningTimes(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            record.append(time.perf_counter())

    return HFTimes(), LightningTimes()


def hf_round(steps: int, recorded: bool, out: Path, precision: str, size: int) -> list[float]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from amp_exp.integrations.transformers import AmpExpCallback

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=size, n_embd=128, n_layer=4, n_head=4)
    tokens = torch.randint(0, 50257, (16 * steps, size), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": t, "labels": t} for t in tokens]
    times: list[float] = []
    timer, _ = step_times(times)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=16,
        bf16=precision == "bf16",
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    callbacks = [timer, *([AmpExpCallback()] if recorded else [])]
    Trainer(GPT2LMHeadModel(config), args, train_dataset=rows, callbacks=callbacks).train()
    return times


def lightning_round(
    steps: int, recorded: bool, out: Path, precision: str, size: int
) -> list[float]:
    import lightning as L
    import torch.nn.functional as F
    import torchvision

    from amp_exp.integrations.lightning import AmpExpCallback

    class ResNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torchvision.models.resnet18(num_classes=10)

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return F.cross_entropy(self.net(images), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    L.seed_everything(0, verbose=False)
    images = torch.randn(32 * steps, 3, size, size)
    labels = torch.randint(0, 10, (32 * steps,))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(images, labels), batch_size=32
    )
    times: list[float] = []
    _, timer = step_times(times)
    trainer = L.Trainer(
        max_steps=steps,
        precision="bf16-mixed" if precision == "bf16" else "32-true",
        log_every_n_steps=10,
        default_root_dir=str(out),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, *([AmpExpCallback()] if recorded else [])],
    )
    trainer.fit(ResNet(), loader)
    return times


ROUNDS = {"hf": hf_round, "lightning": lightning_round}
# The sequence length (GPT-2) and image size (ResNet-18) of a step.
SIZES = {"hf": 128, "lightning": 64}


def median_step(times: list[float], warmup: int) -> float:
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    return statistics.median(gaps[warmup:])


def bench(
    trainer: str, rounds: int, steps: int, warmup: int, precision: str, size: int | None = None
) -> dict:
    """Per round: the median step time without and with the callback, and the overhead."""
    run_round = ROUNDS[trainer]
    figures = []
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(rounds):
            order = (False, True) if number % 2 == 0 else (True, False)
            medians = {}
            for recorded in order:
                out = Path(scratch) / f"{trainer}_{number}_{int(recorded)}"
                times = run_round(steps, recorded, out, precision, size or SIZES[trainer])
                medians[recorded] = median_step(times, warmup)
            figures.append(
                {
                    "without_s": medians[False],
                    "with_s": medians[True],
                    "overhead": medians[True] / medians[False] - 1,
                }
            )
    overheads = [f["overhead"] for f in figures]
    return {
        "trainer": trainer,
        "precision": precision,
        "rounds": figures,
        "median_overhead": statistics.median(overheads),
        "range": (min(overheads), max(overheads)),
        "step_s": statistics.median(f["without_s"] for f in figures),
    }


def markdown_row(result: dict) -> str:
    low, high = result["range"]
    return (
        f"| {result['trainer']} | {result['precision']} | {len(result['rounds'])} | "
        f"{result['step_s'] * 1000:.1f} ms | {result['median_overhead']:+.1%} | "
        f"{low:+.1%} to {high:+.1%} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", nargs="+", default=["hf", "lightning"], choices=ROUNDS)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of each median")
    parser.add_argument(
        "--size", type=int, help="sequence length or image size (default: 128 and 64)"
    )
    args = parser.parse_args(argv)
    print("| trainer | precision | rounds | step (without) | overhead (median) | range |")
    print("|---|---|---|---|---|---|")
    for trainer in args.trainers:
        result = bench(trainer, args.rounds, args.steps, args.warmup, args.precision, args.size)
        print(markdown_row(result), flush=True)


if __name__ == "__main__":
    main()
