"""GPU benchmark: ResNet-50 and GPT-2 small on synthetic data, across the fast paths.

    python scripts/gpu_bench.py --out outputs/gpu_bench             # one GPU
    python scripts/gpu_bench.py --out outputs/gpu_bench --only lm   # GPT-2 small alone
    python scripts/gpu_bench.py --out outputs/gpu_bench --only modes  # bf16_true and fp8 alone
    python scripts/gpu_bench.py --smoke --out /tmp/smoke            # CPU, tiny models

Without ``--smoke`` it needs a CUDA GPU, and says so in one line (exit 2) where there is none.

Every cell is a real ``python -m amp_exp`` run (its own process, so compilation and cudnn
autotuning start cold and peak memory is its own); the tables are read from each run's
summary.json. Images: ResNet-50, 224x224, batch 256, in fp32 (as TF32, the baseline NVIDIA
publishes for A100-class GPUs), fp16 and bf16, with channels_last and compile; then the
engine-vs-hand-written parity check on the same device. Language model: GPT-2 small (124M) on
synthetic tokens, batch 16 x 1024 tokens, AdamW, in fp32 (true IEEE, trainer.tf32=false), TF32,
bf16 and fp16, compile off and on: tokens/s, MFU against the GPU's dense peak, peak memory and
speedup over fp32. Precision modes beyond autocast: bf16_true and fp8 in every recipe, compiled,
on a wide MLP (precision_modes.json). ``--smoke`` runs the same code with tiny models on the CPU.
Beside each workload's table, every cell against ``python -m amp_exp.predict``'s prediction of
the same run on the same GPU, when the GPU is one it predicts (measured_vs_predicted.py).

Published anchors: NVIDIA DeepLearningExamples ResNet-50 on 1x A100 runs 938 img/s in TF32 and
2,470 img/s with AMP (2.63x), batch 256, channels_last. nanoGPT's GPT-2 124M reaches about 30%
MFU on an A100 (nanoGPT issue #110); Karpathy's "Let's reproduce GPT-2 (124M)" chapter notes list
A100 steps of batch 16 x 1024 at about 1,000 ms in fp32, 333 ms in TF32 and 300 ms in bf16.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from measured_vs_predicted import (
    attach_predictions,
    comparison_table,
    paired_rows,
    precision_of,
)

from amp_exp.devices import PREDICTABLE, find_device

REPO = Path(__file__).resolve().parent.parent

FULL = {
    "model": "resnet50",
    "image_size": 224,
    "batch_size": 256,
    "steps": 40,
    "warmup": 10,
    "precisions": ("fp32", "fp16", "bf16"),
    # (channels_last, compile); compile only with channels_last, to stay under 8 minutes.
    "variants": ((False, False), (True, False), (True, True)),
    "parity": ("--model", "resnet18", "--steps", "60", "--warmup", "20", "--rounds", "2"),
    "lm": {
        "model": "gpt2_small",
        "vocab_size": 50257,
        "batch_size": 16,
        "steps": 30,
        "warmup": 10,
        "maths": ("fp32", "tf32", "bf16", "fp16"),
        "compile": (False, True),
    },
}
# The smoke checks the code, not the figures: the fewest steps that time any (one warm-up, three
# timed), on 8x8 images.
SMOKE = {
    "model": "tiny_cnn",
    "image_size": 8,
    "batch_size": 16,
    "steps": 4,
    "warmup": 1,
    "precisions": ("fp32", "bf16"),
    # The flag that is off everywhere else; each cell is a process of its own (~5 s on a CPU).
    "variants": ((True, False),),
    "parity": (
        *("--steps", "4", "--warmup", "1", "--rounds", "1"),
        *("--batch-size", "16", "--image-size", "8"),
    ),
    "lm": {
        "model": "gpt_tiny",
        "vocab_size": 128,
        "batch_size": 8,
        "steps": 4,
        "warmup": 1,
        "maths": ("fp32", "bf16"),
        "compile": (False,),
    },
}
# Every cell measures training alone: no evaluation, no checkpoint, no gradient-range sampling.
QUIET = [
    "trainer.eval_every=null",
    "checkpoint.every_steps=null",
    "diagnostics.underflow_every=0",
    "wandb.mode=disabled",
]
# How each LM column runs: fp32 is true IEEE fp32, TF32 is fp32 matmuls on Tensor Cores.
MATHS = {
    "fp32": ["precision=fp32", "trainer.tf32=false"],
    "tf32": ["precision=fp32", "trainer.tf32=true"],
    "bf16": ["precision=bf16"],
    "fp16": ["precision=fp16"],
}


def run_module(*args: str) -> subprocess.CompletedProcess:
    """``python -m ARGS`` from the repository root, in a process of its own."""
    command = [sys.executable, "-m", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)


def amp_exp(overrides: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    """One cell's run, training alone, into ``run_dir``: a process of its own, so compilation
    and autotuning start cold and its peak memory is its own."""
    return run_module("amp_exp", *overrides, *QUIET, f"hydra.run.dir={run_dir}")


def run_cell(overrides: list[str], cell: dict, run_dir: Path) -> dict:
    started = time.perf_counter()
    result = amp_exp(overrides, run_dir)
    cell = {**cell, "overrides": overrides}
    if result.returncode != 0:
        return {**cell, "error": result.stderr.strip().splitlines()[-1][:200]}
    summary = json.loads((run_dir / "summary.json").read_text())
    measured = ("samples_per_s", "tokens_per_s", "tflops", "mfu", "mfu_peak_source")
    return {
        **cell,
        **{key: summary[key] for key in measured},
        "peak_mem_bytes": summary["peak_mem_bytes"],
        "warmup_s": summary["warmup_s"],
        "device_name": summary["device_name"],
        "wall_s": time.perf_counter() - started,
    }


def image_cell(plan: dict, precision: str, channels_last: bool, compiled: bool, out: Path) -> dict:
    overrides = [
        f"model={plan['model']}",
        f"precision={precision}",
        f"dataset.image_size={plan['image_size']}",
        f"dataset.batch_size={plan['batch_size']}",
        f"dataset.train_size={plan['batch_size'] * 4}",
        f"trainer.max_steps={plan['steps']}",
        f"trainer.timing_warmup_steps={plan['warmup']}",
        f"trainer.log_every={plan['steps']}",
        f"trainer.channels_last={str(channels_last).lower()}",
        f"trainer.compile={str(compiled).lower()}",
    ]
    cell = {"precision": precision, "channels_last": channels_last, "compile": compiled}
    return run_cell(overrides, cell, out / f"{precision}-cl{int(channels_last)}-c{int(compiled)}")


def lm_cell(plan: dict, math: str, compiled: bool, out: Path) -> dict:
    overrides = [
        f"model={plan['model']}",
        "dataset=synthetic_tokens",
        "optimizer=adamw",
        *MATHS[math],
        f"dataset.vocab_size={plan['vocab_size']}",
        f"dataset.batch_size={plan['batch_size']}",
        f"dataset.train_size={plan['batch_size'] * 4}",
        f"dataset.eval_size={plan['batch_size']}",
        f"trainer.max_steps={plan['steps']}",
        f"trainer.timing_warmup_steps={plan['warmup']}",
        f"trainer.log_every={plan['steps']}",
        f"trainer.compile={str(compiled).lower()}",
    ]
    return run_cell(
        overrides, {"math": math, "compile": compiled}, out / f"lm-{math}-c{int(compiled)}"
    )


def table(cells: list[dict]) -> str:
    baseline = {
        (c["channels_last"], c["compile"]): c["samples_per_s"]
        for c in cells
        if c["precision"] == "fp32" and "error" not in c
    }
    lines = [
        "| precision | channels_last | compile | img/s | speedup vs fp32 | peak mem (GiB) "
        "| warm-up s |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        flags = f"| {c['precision']} | {c['channels_last']} | {c['compile']} "
        if "error" in c:
            lines.append(f"{flags}| failed: {c['error']} | | | |")
            continue
        base = baseline.get((c["channels_last"], c["compile"]))
        speedup = f"{c['samples_per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"{flags}| {c['samples_per_s']:.0f} | {speedup} | {c['peak_mem_bytes'] / 2**30:.2f} "
            f"| {c['warmup_s']:.1f} |"
        )
    return "\n".join(lines)


def lm_table(cells: list[dict]) -> str:
    baseline = {
        c["compile"]: c["tokens_per_s"] for c in cells if c["math"] == "fp32" and "error" not in c
    }
    lines = [
        "| math | compile | tokens/s | MFU | TFLOP/s | speedup vs fp32 | peak mem (GiB) "
        "| warm-up s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        flags = f"| {c['math']} | {c['compile']} "
        if "error" in c:
            lines.append(f"{flags}| failed: {c['error']} | | | | | |")
            continue
        base = baseline.get(c["compile"])
        speedup = f"{c['tokens_per_s'] / base:.2f}x" if base else "-"
        mfu = "-" if c["mfu"] is None else f"{c['mfu']:.1%}"
        lines.append(
            f"{flags}| {c['tokens_per_s']:,.0f} | {mfu} | {c['tflops']:.2f} | {speedup} "
            f"| {c['peak_mem_bytes'] / 2**30:.2f} | {c['warmup_s']:.1f} |"
        )
    return "\n".join(lines)


def run_images(plan: dict, out: Path) -> tuple[list[dict], list[str]]:
    cells = []
    for channels_last, compiled in plan["variants"]:
        for precision in plan["precisions"]:
            cells.append(image_cell(plan, precision, channels_last, compiled, out))
            print(json.dumps(cells[-1]), flush=True)
    device = next((c["device_name"] for c in cells if "device_name" in c), "unknown device")
    markdown = [
        f"# {plan['model']}, {plan['image_size']}x{plan['image_size']}, batch "
        f"{plan['batch_size']}, on {device}",
        "",
        table(cells),
        "",
        *against_prediction(cells, device, ("precision", ("channels_last", "compile")), out),
    ]
    parity = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_parity.py"), *plan["parity"]],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    markdown += ["## Parity with a hand-written loop", "", "```", parity.stdout.strip(), "```", ""]
    return cells, markdown


def run_lm(plan: dict, out: Path) -> tuple[list[dict], list[str]]:
    cells = []
    for compiled in plan["compile"]:
        for math in plan["maths"]:
            cells.append(lm_cell(plan, math, compiled, out))
            print(json.dumps(cells[-1]), flush=True)
    device = next((c["device_name"] for c in cells if "device_name" in c), "unknown device")
    peaks = sorted({c["mfu_peak_source"] for c in cells if c.get("mfu_peak_source")})
    markdown = [
        f"# {plan['model']} on synthetic tokens, batch {plan['batch_size']}, AdamW, on {device}",
        "",
        lm_table(cells),
        "",
        "MFU peaks: " + ("; ".join(peaks) if peaks else "none known for this device") + ".",
        "",
        *against_prediction(cells, device, ("math", ("compile",)), out),
    ]
    return cells, markdown


def predictor(key: str, out: Path):
    """``python -m amp_exp.predict`` on a cell's overrides for device ``key``: predict.json's
    rows by precision, or ``{"error": ...}``."""
    calls = iter(range(10**6))

    def predict(overrides: list[str]) -> dict:
        run_dir = out / "predict" / str(next(calls))
        result = run_module(
            "amp_exp.predict",
            *overrides,
            f"predict.devices=[{key}]",
            f"predict.precisions=[{precision_of(overrides)}]",
            f"hydra.run.dir={run_dir}",
        )
        if result.returncode != 0:
            return {"error": result.stderr.strip().splitlines()[-1][:200]}
        found = json.loads((run_dir / "predict.json").read_text())
        return found["devices"][key]["precisions"]

    return predict


def against_prediction(cells: list[dict], device: str, layout: tuple, out: Path) -> list[str]:
    """The measured-against-predicted table of a workload's cells (each gets ``predicted``)."""
    name, flags = layout
    found = find_device(device)
    if found is None or found.key not in PREDICTABLE:
        return [
            f"No prediction beside it: {device} is not one of the devices amp_exp.predict "
            f"predicts ({', '.join(sorted(PREDICTABLE))}).",
            "",
        ]
    attach_predictions(cells, predictor(found.key, out))
    rate = "tokens_per_s" if name == "math" else "samples_per_s"
    rows = paired_rows(cells, name, flags, rate)
    return [comparison_table(rows, rate.removesuffix("_per_s"), found.label), ""]


def find_gpu() -> str:
    """The CUDA GPU's name; exits 2 in one line where there is none (nothing to measure)."""
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_bench: no CUDA GPU here (torch.cuda.is_available() is false): it measures the "
            "GPU it finds; run it on one, or pass --smoke to run its code with tiny models here",
            file=sys.stderr,
        )
        sys.exit(2)
    return torch.cuda.get_device_name()


# --- precision modes beyond autocast: bf16_true and fp8 --------------------------------------
# An MLP whose hidden linears are 4096 wide, where torchao's tables show fp8 paying off; compiled,
# as torchtitan runs fp8. AdamW, so bf16_true uses torchao's stochastic-rounding AdamW on CUDA.
MODES_FULL = {
    "overrides": ["model=mlp", "model.hidden_dim=4096", "model.depth=4", "optimizer=adamw"],
    "image_size": 32,
    "batch_size": 1024,
    "steps": 40,
    "warmup": 10,
    "compile": True,
    "cells": {
        "fp32": ["precision=fp32"],
        "bf16": ["precision=bf16"],
        "bf16_true": ["precision=bf16_true"],
        "bf16_true (nearest)": ["precision=bf16_true_nearest"],
        "fp8 tensorwise": ["precision=fp8", "precision.options.recipe=tensorwise"],
        "fp8 rowwise": ["precision=fp8", "precision.options.recipe=rowwise"],
        "fp8 rowwise_with_gw_hp": ["precision=fp8", "precision.options.recipe=rowwise_with_gw_hp"],
    },
}
# On the CPU fp8 can only be emulated, and emulated runs are never timed.
MODES_SMOKE = {
    "overrides": ["model=mlp", "model.hidden_dim=32", "model.depth=3", "optimizer=adamw"],
    "image_size": 8,
    "batch_size": 16,
    "steps": 4,
    "warmup": 1,
    "compile": False,
    "cells": {
        "fp32": ["precision=fp32"],
        "bf16_true": ["precision=bf16_true"],
        "fp8 tensorwise (emulated)": ["precision=fp8", "precision.emulate=true"],
    },
}


def run_mode_cell(plan: dict, name: str, overrides: list[str], out: Path) -> dict:
    run_dir = out / "modes" / name.replace(" ", "_").replace("(", "").replace(")", "")
    overrides = [
        *plan["overrides"],
        *overrides,
        f"dataset.image_size={plan['image_size']}",
        f"dataset.batch_size={plan['batch_size']}",
        f"dataset.train_size={plan['batch_size'] * 4}",
        f"trainer.max_steps={plan['steps']}",
        f"trainer.timing_warmup_steps={plan['warmup']}",
        f"trainer.log_every={plan['steps']}",
        f"trainer.compile={str(plan['compile']).lower()}",
    ]
    result = amp_exp(overrides, run_dir)
    if result.returncode != 0:
        return {"cell": name, "error": result.stderr.strip().splitlines()[-1][:200]}
    summary = json.loads((run_dir / "summary.json").read_text())
    keys = ("samples_per_s", "peak_mem_bytes", "state_bytes", "final_loss", "device_name")
    details = summary.get("precision_details") or {}
    return {
        "cell": name,
        **{key: summary[key] for key in keys},
        "converted_linears": len(details.get("converted_linears") or []),
        "emulated": bool(details.get("emulated")),
    }


def modes_table(cells: list[dict]) -> str:
    base = next((c.get("samples_per_s") for c in cells if c["cell"] == "fp32"), None)
    lines = [
        "| precision | samples/s | speedup vs fp32 | peak mem (GiB) | weights + opt. state (MiB) "
        "| final loss | converted linears |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        if "error" in c:
            lines.append(f"| {c['cell']} | failed: {c['error']} | | | | | |")
            continue
        speed = c["samples_per_s"]
        if c["emulated"]:
            shown, speedup = "emulated, not timed", "-"
        else:
            shown, speedup = f"{speed:.0f}", f"{speed / base:.2f}x" if base else "-"
        lines.append(
            f"| {c['cell']} | {shown} | {speedup} | {c['peak_mem_bytes'] / 2**30:.2f} "
            f"| {c['state_bytes'] / 2**20:.2f} | {c['final_loss']:.4f} | {c['converted_linears']} |"
        )
    return "\n".join(lines)


def precision_modes(smoke: bool, out: Path) -> list[str]:
    """The bf16_true and fp8 cells (every fp8 recipe); writes precision_modes.json."""
    plan = MODES_SMOKE if smoke else MODES_FULL
    cells = []
    for name, overrides in plan["cells"].items():
        cells.append(run_mode_cell(plan, name, overrides, out))
        print(json.dumps(cells[-1]), flush=True)
    (out / "precision_modes.json").write_text(json.dumps(cells, indent=2) + "\n")
    widths = [o for o in plan["overrides"] if "hidden_dim" in o or "depth" in o]
    return [
        f"## Precision modes: MLP ({', '.join(widths)}), batch {plan['batch_size']}, "
        f"compile={plan['compile']}",
        "",
        modes_table(cells),
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny models on whatever device")
    parser.add_argument(
        "--only", choices=("images", "lm", "modes"), help="run one part: a workload, or the modes"
    )
    args = parser.parse_args(argv)
    if not args.smoke:
        print(f"gpu_bench: measuring on {find_gpu()}", flush=True)
    plan = SMOKE if args.smoke else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    results, markdown = {}, []
    if args.only in (None, "images"):
        results["images"], part = run_images(plan, args.out)
        markdown += part
    if args.only in (None, "lm"):
        results["lm"], part = run_lm(plan["lm"], args.out)
        markdown += part
    if args.only in (None, "modes"):
        markdown += precision_modes(args.smoke, args.out)
    (args.out / "gpu_bench.md").write_text("\n".join(markdown))
    (args.out / "gpu_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(markdown))


if __name__ == "__main__":
    main()
