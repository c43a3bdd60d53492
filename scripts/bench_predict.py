"""The roofline's predictions beside the published speedups of amp_exp/predict/published.json:
each anchor's setting run through ``python -m amp_exp.predict`` as a user runs it, timed, and
one markdown row per anchor (docs/benchmarks.md).

    python scripts/bench_predict.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from amp_exp.predict.predict import anchors  # noqa: E402


def main() -> None:
    print("| anchor | published | predicted | error | band | holds | wall time |")
    print("|---|---|---|---|---|---|---|")
    for anchor in anchors():
        with tempfile.TemporaryDirectory() as directory:
            command = [sys.executable, "-m", "amp_exp.predict", *anchor["overrides"]]
            start = time.perf_counter()
            subprocess.run([*command, f"hydra.run.dir={directory}"], check=True, cwd=REPO)
            wall = time.perf_counter() - start
            found = json.loads((Path(directory) / "predict.json").read_text())
        row = found["devices"][anchor["device"]]["precisions"][anchor["precision"]]
        predicted = row[f"speedup_vs_{anchor['baseline']}"]
        low, high = anchor["band"]
        print(
            f"| {anchor['name']} ({anchor['precision']} over {anchor['baseline']}, "
            f"{anchor['device']}) | {anchor['published']:.2f}x | {predicted:.2f}x | "
            f"{predicted / anchor['published'] - 1:+.0%} | {low:.2f}-{high:.2f}x | "
            f"{'yes' if low <= predicted <= high else 'NO'} | {wall:.0f} s |"
        )


if __name__ == "__main__":
    main()
