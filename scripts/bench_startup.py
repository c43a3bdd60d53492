"""Start-up cost: time to the first training step of ``python -m amp_exp``.

    python scripts/bench_startup.py --repeats 5

Three clocks, each from process start to a line it prints, medians over the repeats:
``import torch``; a minimal hand-written script that takes one SGD step on a small CNN
(constructing any torch.optim optimizer imports torch._dynamo, a cost every PyTorch training
script pays); and ``python -m amp_exp`` until it logs step 1 (``trainer.log_every=1``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

IMPORT_TORCH = "import torch; print('ready', flush=True)"
HAND_WRITTEN_FIRST_STEP = """
import torch
from torch import nn
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
images, labels = torch.randn(128, 3, 32, 32), torch.randint(10, (128,))
nn.functional.cross_entropy(model(images), labels).backward()
optimizer.step()
print('ready', flush=True)
"""


def seconds_to_line(command: list[str], marker: str) -> float:
    started = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = None
    for line in process.stdout:
        if seen is None and marker in line:
            seen = time.perf_counter() - started
    if process.wait() != 0 or seen is None:
        raise SystemExit(f"{command} failed or never printed {marker!r}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="extra config overrides for the run")
    args = parser.parse_args()
    python = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        amp_exp = [
            python,
            "-m",
            "amp_exp",
            "trainer.max_steps=2",
            "trainer.log_every=1",
            "wandb.mode=disabled",
            f"hydra.run.dir={tmp}",
            *args.overrides,
        ]
        clocks = {
            "import_torch_s": ([python, "-c", IMPORT_TORCH], "ready"),
            "hand_written_first_step_s": ([python, "-c", HAND_WRITTEN_FIRST_STEP], "ready"),
            "amp_exp_first_step_s": (amp_exp, "] 1/2"),
        }
        result = {
            name: statistics.median(seconds_to_line(*clock) for _ in range(args.repeats))
            for name, clock in clocks.items()
        }
    first = result["amp_exp_first_step_s"]
    result["overhead_vs_import_torch_s"] = first - result["import_torch_s"]
    result["overhead_vs_hand_written_s"] = first - result["hand_written_first_step_s"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
