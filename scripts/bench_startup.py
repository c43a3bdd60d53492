"""Start-up cost: time to the first training step of ``python -m amp_exp`` vs ``import torch``.

    python scripts/bench_startup.py --repeats 5

The first step is taken to be done when the run logs step 1 (``trainer.log_every=1``); the
baseline is a whole ``python -c "import torch"`` process. Medians over the repeats.
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


def import_torch_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def first_step_s(run_dir: Path) -> float:
    command = [
        sys.executable,
        "-m",
        "amp_exp",
        "trainer.max_steps=2",
        "trainer.log_every=1",
        f"hydra.run.dir={run_dir}",
        *EXTRA,
    ]
    started = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first = None
    for line in process.stdout:
        if first is None and "] 1/2" in line:
            first = time.perf_counter() - started
    if process.wait() != 0 or first is None:
        raise SystemExit(f"the run failed or never logged step 1: {command}")
    return first


EXTRA: list[str] = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="extra config overrides for the run")
    args = parser.parse_args()
    EXTRA.extend(args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        torch_s = [import_torch_s() for _ in range(args.repeats)]
        run_s = [first_step_s(Path(tmp) / str(i)) for i in range(args.repeats)]
    result = {
        "import_torch_s": statistics.median(torch_s),
        "first_step_s": statistics.median(run_s),
    }
    result["overhead_s"] = result["first_step_s"] - result["import_torch_s"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
