"""End to end: ``python -m amp_exp`` as a user runs it, results read back from disk."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import FAST, read_jsonl, run_cli

pytestmark = pytest.mark.slow

TRAIN_KEYS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "scale",
    "skipped_steps",
    "samples_per_s",
    "step_time_ms",
    "peak_mem_bytes",
}
SUMMARY_KEYS = {
    "precision",
    "precision_reason",
    "model",
    "dataset",
    "device",
    "steps",
    "samples_per_s",
    "peak_mem_bytes",
    "final_loss",
    "eval_acc",
    "loss_scale",
    "skipped_steps",
    "wall_s",
    "torch_version",
    "git_sha",
}


def test_run_writes_metrics_summary_config_and_log(tmp_path: Path) -> None:
    run_cli(
        *FAST,
        "precision=bf16",
        "trainer.max_steps=6",
        "trainer.timing_warmup_steps=2",
        f"hydra.run.dir={tmp_path}",
    )
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6]
    assert all(r.keys() >= TRAIN_KEYS for r in train_rows)
    assert all(r["scale"] is None and r["skipped_steps"] == 0 for r in train_rows)
    assert train_rows[0]["samples_per_s"] is None  # steps 1-2 are warm-up
    assert all(r["samples_per_s"] > 0 for r in train_rows[1:])
    eval_rows = [r for r in rows if "eval_acc" in r]
    assert [r["step"] for r in eval_rows] == [6]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS
    identity = (summary["precision"], summary["model"], summary["device"])
    assert identity == ("bf16", "tiny_cnn", "cpu")
    assert summary["final_loss"] == train_rows[-1]["loss"]
    assert summary["eval_acc"] == eval_rows[-1]["eval_acc"]
    assert "precision=bf16" in summary["precision_reason"]
    assert (tmp_path / ".hydra" / "config.yaml").exists()
    log = (tmp_path / "train.log").read_text()
    assert "[####################] 6/6" in log


def test_fp16_run_logs_the_loss_scale(tmp_path: Path) -> None:
    run_cli(
        *FAST,
        "precision=fp16",
        "model.width=4",
        "dataset.image_size=8",
        "precision.init_scale=1024",
        f"hydra.run.dir={tmp_path}",
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["precision"] == "fp16" and summary["loss_scale"] == 1024.0
    scales = [r["scale"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert scales == [1024.0] * 2


def test_console_script_is_installed() -> None:
    script = shutil.which("amp-exp") or str(Path(sys.executable).parent / "amp-exp")
    result = subprocess.run([script, "precision=fp4"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "valid choices: auto, bf16, bf16_true, bf16_true_nearest, fp16, fp32, fp8" in (
        result.stderr
    )
