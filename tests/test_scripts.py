"""The benchmark scripts run end to end on the CPU (their figures live in docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.warm_python import python_m

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_gpu_bench_smoke_writes_both_tables_and_checks_parity(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import gpu_bench

    # Each cell's command from the warm interpreter: the figures don't matter here, the tables do.
    monkeypatch.setattr(gpu_bench, "run_module", lambda *args: python_m(*args, cwd=gpu_bench.REPO))
    gpu_bench.main(["--smoke", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "gpu_bench.json").read_text())
    cells = results["images"]
    assert [(c["precision"], c["channels_last"]) for c in cells] == [("fp32", True), ("bf16", True)]
    assert all(c["samples_per_s"] > 0 for c in cells)
    markdown = (tmp_path / "gpu_bench.md").read_text()
    assert "| fp32 | True | False |" in markdown and "1.00x" in markdown
    assert '"state_dicts_identical": true' in markdown
    lm = results["lm"]
    assert [c["math"] for c in lm] == ["fp32", "bf16"]
    assert all(c["tokens_per_s"] > 0 and c["tflops"] > 0 and c["mfu"] is None for c in lm)
    assert "# gpt_tiny on synthetic tokens" in markdown and "| fp32 | False |" in markdown
    assert "MFU peaks: none known for this device." in markdown
    modes = {c["cell"]: c for c in json.loads((tmp_path / "precision_modes.json").read_text())}
    assert set(modes) == {"fp32", "bf16_true", "fp8 tensorwise (emulated)"}
    # AdamW: weights and two moments in bf16, beside fp32 step counts.
    assert modes["bf16_true"]["state_bytes"] < 0.51 * modes["fp32"]["state_bytes"]
    assert modes["fp8 tensorwise (emulated)"]["fp8_converted"] == 3
    assert "| fp8 tensorwise (emulated) | emulated, not timed | - |" in markdown


def test_bench_audit_times_the_audited_step_against_the_others(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_audit

    tiny = ["trainer.device=cpu", "trainer.max_steps=4", "trainer.timing_warmup_steps=1"]
    figures = bench_audit.audit_share([*tiny, "model.width=4", "dataset.image_size=8"])
    assert figures["audited_step"] == 2
    assert figures["audited_step_s"] > 0 and figures["median_step_s"] > 0
    assert figures["wall_s"] > figures["audited_step_s"]


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
