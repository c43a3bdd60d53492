"""The benchmark scripts that run as processes of their own, whose sides start fresh ones. Apart
from tests/test_scripts.py so that pytest-xdist gives the two files two workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run_script(name: str, *args: str) -> dict | list:
    """A benchmark script as its own process (its sides start fresh ones); its JSON report."""
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        cwd=SCRIPTS.parent,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_bench_causal_times_the_check_inside_a_run() -> None:
    tiny = ["trainer.device=cpu", "trainer.max_steps=4", "trainer.timing_warmup_steps=1"]
    lm = ["model=gpt_tiny", "dataset=synthetic_tokens", "dataset.train_size=64"]
    figures = run_script("bench_causal.py", "--repeats", "1", *tiny, *lm)
    assert figures["status"] == "completed"
    assert 0 < figures["check_s"] < figures["run_wall_s"]
    assert figures["check_warm_median_s"] > 0


def test_parity_trains_a_transformers_model_bit_for_bit_like_a_hand_written_loop() -> None:
    pytest.importorskip("transformers")
    report = run_script(
        "bench_parity.py",
        *("--model", "hf_llama_tiny", "--dataset", "synthetic_tokens"),
        *("--steps", "4", "--warmup", "1", "--rounds", "1", "--batch-size", "4"),
    )
    assert report["state_dicts_identical"] is True and report["steps_timed_per_side"] == 2


def test_the_hf_trainer_benchmark_times_both_sides_by_both_clocks() -> None:
    pytest.importorskip("accelerate")  # the Trainer's, not amp_exp's
    (row,) = run_script(
        "bench_hf_trainer.py",
        *("--precisions", "fp32", "--steps", "4", "--warmup", "1", "--rounds", "1"),
        *("--batch-size", "4"),
    )
    assert row["steps_timed_per_side"] == 2
    for clock in ("wall", "cpu"):
        assert row[clock]["amp_exp_tokens_per_s"] > 0 and row[clock]["hf_trainer_tokens_per_s"] > 0
