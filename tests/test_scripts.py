"""The benchmark scripts run end to end on the CPU (their figures live in docs/benchmarks.md);
those that start their sides as processes: tests/test_scripts_processes.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_scripts_processes import SidesHere

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_gpu_bench_smoke_writes_both_tables_and_checks_parity(
    tmp_path: Path, monkeypatch, command_main
) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_parity
    import gpu_bench

    # Each cell's command through its main in this process, where each would start a process
    # (3 s of CPU to import before a step that takes milliseconds): the tables matter, not the
    # figures.
    monkeypatch.setattr(gpu_bench, "run_module", command_main)

    # The parity script, and each side it spawns, through its main in this process too.
    monkeypatch.setattr(bench_parity, "subprocess", SidesHere())
    monkeypatch.setattr(gpu_bench, "subprocess", SidesHere())
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
    # A CPU is no device amp_exp.predict predicts: said, not paired with an H100's figures.
    assert (
        "No prediction beside it: " in markdown and "predicts (a100, b200, h100, h200)" in markdown
    )
    modes = {c["cell"]: c for c in json.loads((tmp_path / "precision_modes.json").read_text())}
    assert set(modes) == {"fp32", "bf16_true", "fp8 tensorwise (emulated)"}
    # AdamW: weights and two moments in bf16, beside fp32 step counts.
    assert modes["bf16_true"]["state_bytes"] < 0.51 * modes["fp32"]["state_bytes"]
    assert modes["fp8 tensorwise (emulated)"]["converted_linears"] == 3
    assert "| fp8 tensorwise (emulated) | emulated, not timed | - |" in markdown


def fake_lm_cells() -> list[dict]:
    """gpu_bench's LM cells with made-up rates: fp32 and bf16, compiled and not, one failed."""
    cell = {"fp32": ["precision=fp32", "trainer.tf32=false"], "bf16": ["precision=bf16"]}
    return [
        {"math": "fp32", "compile": False, "overrides": [*cell["fp32"], "trainer.compile=false"],
         "tokens_per_s": 1000.0},
        {"math": "bf16", "compile": False, "overrides": [*cell["bf16"], "trainer.compile=false"],
         "tokens_per_s": 3000.0},
        {"math": "fp32", "compile": True, "overrides": [*cell["fp32"], "trainer.compile=true"],
         "tokens_per_s": 2000.0},
        {"math": "bf16", "compile": True, "overrides": [*cell["bf16"], "trainer.compile=true"],
         "tokens_per_s": 8000.0},
        {"math": "fp16", "compile": False, "overrides": ["precision=fp16"], "error": "OOM"},
    ]  # fmt: skip


def test_gpu_bench_pairs_each_cell_with_the_prediction_of_its_own_precision(monkeypatch) -> None:
    """Caught: a row paired with another precision's prediction, a speedup taken against the
    other compile setting's fp32, or one prediction process per compile variant."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from measured_vs_predicted import attach_predictions, comparison_table, paired_rows

    calls = []

    def predict(overrides: list[str]) -> dict:
        calls.append(overrides)
        # predict.json's rows: the asked precision beside its baselines, at made-up rates.
        return {"fp32": {"tokens_per_s": 800.0}, "bf16": {"tokens_per_s": 4000.0}}

    cells = fake_lm_cells()
    attach_predictions(cells, predict)
    # The roofline models no compile: one prediction per precision, none for the failed cell.
    assert calls == [["precision=fp32", "trainer.tf32=false"], ["precision=bf16"]]
    rows = paired_rows(cells, "math", ("compile",), "tokens_per_s")
    by_cell = {row["cell"]: row for row in rows}
    bf16 = by_cell["bf16, compile=False"]
    assert (bf16["measured"], bf16["predicted"]) == (3000.0, 4000.0)
    assert bf16["measured_over_predicted"] == 0.75
    assert (bf16["measured_speedup"], bf16["predicted_speedup"]) == (3.0, 5.0)
    # Against the compiled fp32 cell, not the eager one.
    assert by_cell["bf16, compile=True"]["measured_speedup"] == 4.0
    assert by_cell["fp32, compile=True"]["measured_speedup"] == 1.0
    failed = by_cell["fp16, compile=False"]
    assert failed["note"] == "OOM" and failed["predicted"] is None
    table = comparison_table(rows, "tokens", "H100 SXM").splitlines()
    assert table[0].startswith("Measured against predicted on H100 SXM (python -m amp_exp.predict")
    assert "| bf16, compile=False | 3,000 | 4,000 | 0.75 | 3.00 | 5.00 |  |" in table
    assert "| fp16, compile=False | - | - | - | - | - | OOM |" in table


def test_gpu_bench_without_a_gpu_says_so_in_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import gpu_bench
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        gpu_bench.main(["--out", str(tmp_path / "out")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "gpu_bench: no CUDA GPU here (torch.cuda.is_available() is false): it measures the GPU it "
        "finds; run it on one, or pass --smoke to run its code with tiny models here"
    ]
    assert not (tmp_path / "out").exists()


def test_bench_audit_times_the_audited_step_against_the_others(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_audit

    tiny = ["trainer.device=cpu", "trainer.max_steps=4", "trainer.timing_warmup_steps=1"]
    figures = bench_audit.audit_share([*tiny, "model.width=4", "dataset.image_size=8"])
    assert figures["audited_step"] == 2
    assert figures["audited_step_s"] > 0 and figures["median_step_s"] > 0
    assert figures["wall_s"] > figures["audited_step_s"]


def test_bench_integrations_smoke_prints_a_row_per_trainer(monkeypatch, capsys) -> None:
    """Both arms of each round train and record; the figures themselves don't matter here."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_integrations

    # Two rounds (AB, then BA) of 4 steps at 8x8, the median over the last step: ResNet-18
    # still runs every layer (its last ones at 1x1), and each arm still records.
    smoke = ["--rounds", "2", "--steps", "4", "--warmup", "2", "--size", "8"]
    bench_integrations.main(["--trainers", "lightning", *smoke, "--precision", "fp32"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| lightning")]
    assert len(rows) == 1 and rows[0].count("|") == 7
