"""GPU benchmark: ResNet-50 on synthetic 224x224 data, batch 256, across the fast paths.

    python scripts/gpu_bench.py --out outputs/gpu_bench          # one GPU, under 8 minutes
    python scripts/gpu_bench.py --smoke --out /tmp/smoke         # CPU, tiny model: tests the script

Every cell is a real ``python -m amp_exp`` run (its own process, so compilation and cudnn
autotuning start cold and peak memory is its own); the table is read from each run's
summary.json. fp32 runs with TF32, the baseline NVIDIA publishes for A100-class GPUs. After
the table, the engine-vs-hand-written parity check runs on the same device.

Published anchors: NVIDIA DeepLearningExamples ResNet-50 on 1x A100 runs 938 img/s in TF32 and
2,470 img/s with AMP (2.63x), batch 256, channels_last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

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
}
SMOKE = {
    "model": "tiny_cnn",
    "image_size": 16,
    "batch_size": 32,
    "steps": 6,
    "warmup": 2,
    "precisions": ("fp32", "bf16"),
    "variants": ((False, False), (True, False)),
    "parity": ("--steps", "8", "--warmup", "2", "--rounds", "1", "--batch-size", "32"),
}


def run_cell(plan: dict, precision: str, channels_last: bool, compiled: bool, out: Path) -> dict:
    run_dir = out / f"{precision}-cl{int(channels_last)}-c{int(compiled)}"
    command = [
        sys.executable,
        "-m",
        "amp_exp",
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
        "trainer.eval_every=null",
        "checkpoint.every_steps=null",
        "diagnostics.underflow_every=0",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
    ]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    cell = {"precision": precision, "channels_last": channels_last, "compile": compiled}
    if result.returncode != 0:
        return {**cell, "error": result.stderr.strip().splitlines()[-1][:200]}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        **cell,
        "samples_per_s": summary["samples_per_s"],
        "peak_mem_bytes": summary["peak_mem_bytes"],
        "warmup_s": summary["warmup_s"],
        "device_name": summary["device_name"],
        "wall_s": time.perf_counter() - started,
    }


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny model on whatever device")
    args = parser.parse_args()
    plan = SMOKE if args.smoke else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    cells = []
    for channels_last, compiled in plan["variants"]:
        for precision in plan["precisions"]:
            cells.append(run_cell(plan, precision, channels_last, compiled, args.out))
            print(json.dumps(cells[-1]), flush=True)
    device = next((c["device_name"] for c in cells if "device_name" in c), "unknown device")
    markdown = [
        f"# {plan['model']}, {plan['image_size']}x{plan['image_size']}, batch "
        f"{plan['batch_size']}, on {device}",
        "",
        table(cells),
        "",
    ]
    parity = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_parity.py"), *plan["parity"]],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    markdown += ["## Parity with a hand-written loop", "", "```", parity.stdout.strip(), "```", ""]
    (args.out / "gpu_bench.md").write_text("\n".join(markdown))
    (args.out / "gpu_bench.json").write_text(json.dumps(cells, indent=2) + "\n")
    print("\n".join(markdown))


if __name__ == "__main__":
    main()
