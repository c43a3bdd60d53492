"""Other trainers' runs, recorded in amp_exp's results format and judged by its report: a plain
loop and Accelerate through ``amp_exp.record``, the real HF Trainer and the real Lightning Trainer
through their ``AmpExpCallback`` (tiny models, CPU)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_exp
from amp_exp.errors import NumericalFault, RunRefused
from amp_exp.integrations.metric_names import task_names
from amp_exp.report.assemble import build_report
from amp_exp.results.format import run_problems
from amp_exp.tasks.classification import ClassificationTask
from amp_exp.tasks.lm import LanguageModelTask
from test_no_host_sync import count_host_reads

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def tiny_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=generator)
    return x, (x[:, :4].argmax(dim=1))


def plain_loop(
    run_dir: Path,
    precision: str,
    seed: int = 0,
    *,
    autocast: bool = True,
    steps: int = 8,
    inf_at: set[int] = frozenset(),
    init_scale: float = 2.0**16,
    **record_args,
):
    """A plain loop recorded with ``amp_exp.record``: autocast as ``precision`` says (unless
    ``autocast`` is off), a GradScaler for fp16, an overflowing loss at the steps ``inf_at``."""
    model, (x, y) = tiny_model(seed), data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dtype = AUTOCAST.get(precision)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16", init_scale=init_scale)
    with amp_exp.record(
        run_dir,
        model=model,
        optimizer=optimizer,
        precision=precision,
        seed=seed,
        task="classification",
        scaler=scaler,
        name="tiny_mlp",
        log_every=2,
        **record_args,
    ) as run:
        for step in range(1, steps + 1):
            on = autocast and dtype is not None
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=on):
                loss = F.cross_entropy(model(x), y)
            if step in inf_at:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            run.step(loss, batch_size=len(x))
        with torch.no_grad():
            logits = model(x)
            run.eval(
                val_loss=F.cross_entropy(logits, y), val_acc=(logits.argmax(1) == y).float().mean()
            )
    return json.loads((run_dir / "summary.json").read_text())


def rows(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["kind"] == kind]


def test_a_plain_bf16_loop_is_recorded_in_the_results_format(tmp_path) -> None:
    summary = plain_loop(tmp_path, "bf16")
    assert run_problems(tmp_path) == []
    assert summary["status"] == "completed" and summary["steps"] == 8
    assert summary["precision"] == "bf16" and summary["model"] == "tiny_mlp"
    assert "autocast bfloat16" in summary["precision_reason"]
    audit = summary["precision_audit"]
    assert audit["engaged"] is True and audit["flops_by_dtype"] == {"bfloat16": 1.0}
    # Warm-up (one log interval) and the audited step are out of the clock; the rest is timed.
    assert summary["timed_steps"] == 6 and summary["samples_per_s"] > 0
    assert summary["eval_acc"] == rows(tmp_path, "eval")[0]["eval_acc"]
    assert [row["step"] for row in rows(tmp_path, "train")] == [2, 4, 6, 8]


def test_a_loop_that_says_bf16_but_never_autocasts_did_not_engage(tmp_path) -> None:
    """The "is mixed precision even on?" case: the flag says bf16, the matmuls ran fp32."""
    summary = plain_loop(tmp_path, "bf16", autocast=False)
    assert summary["precision_audit"]["engaged"] is False
    assert "no autocast" in summary["precision_reason"]
    assert "float32" in summary["precision_audit"]["flops_by_dtype"]


def test_fp16_skipped_steps_and_the_loss_scale_come_from_the_scaler(tmp_path) -> None:
    """A step the scaler skipped fires no optimizer step hook: one overflow, one skip, the scale
    halved (a recorder that counted step() calls would find none skipped)."""
    summary = plain_loop(tmp_path, "fp16", inf_at={3}, steps=4)
    assert summary["status"] == "completed"
    assert summary["skipped_steps"] == 1 and summary["first_overflow"]["step"] == 3
    assert summary["first_overflow"]["loss_finite"] is False
    assert [row["scale"] for row in rows(tmp_path, "train")] == [2.0**16, 2.0**15]
    assert summary["loss_scale"] == 2.0**15


def test_a_loss_scale_collapse_is_a_numerical_fault_in_the_summary(tmp_path) -> None:
    with pytest.raises(NumericalFault, match="fp16 loss scaling collapsed by step 4"):
        plain_loop(tmp_path, "fp16", inf_at=set(range(1, 9)), init_scale=8.0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"].startswith("NumericalFault: fp16 loss scaling collapsed")
    assert summary["skipped_steps"] == 4 and summary["loss_scale"] == 0.5
    assert run_problems(tmp_path) == []


def test_a_finished_record_is_refused_unless_resumed(tmp_path) -> None:
    plain_loop(tmp_path, "bf16", steps=2)
    with pytest.raises(RunRefused, match="pass resume=True"):
        plain_loop(tmp_path, "bf16", steps=2)
    summary = plain_loop(tmp_path, "bf16", steps=2, resume=True)
    assert summary["status"] == "completed"
    assert [row["step"] for row in rows(tmp_path, "train")] == [2, 4]


def test_the_recorder_reads_the_device_only_at_log_steps(tmp_path, monkeypatch) -> None:
    """Host reads inside ``step``: none at the steps between log steps."""
    model, (x, y) = tiny_model(0), data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reads = []
    with amp_exp.record(
        tmp_path, model=model, optimizer=optimizer, precision="bf16", seed=0,
        task="classification", log_every=4,
    ) as run:  # fmt: skip
        for _ in range(12):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with monkeypatch.context() as patch:
                counts = count_host_reads(patch)
                run.step(loss, batch_size=len(x))
            reads.append(sum(counts.values()))
    between = [count for step, count in enumerate(reads, start=1) if step % 4]
    assert between == [0] * 9
    assert all(reads[step - 1] > 0 for step in (4, 8, 12))


def test_an_accelerate_loop_is_recorded_through_record(tmp_path) -> None:
    """Accelerate sets bf16 autocast itself (``mixed_precision="bf16"``): the audit sees it."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model, (x, y) = tiny_model(0), data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    with amp_exp.record(
        tmp_path, model=model, optimizer=optimizer, precision="bf16", seed=0,
        task="classification", scaler=accelerator.scaler, log_every=2,
    ) as run:  # fmt: skip
        for _ in range(4):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            run.step(loss, batch_size=len(x))
        run.eval(eval_accuracy=0.5, eval_loss=1.0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert run_problems(tmp_path) == []
    assert summary["precision_audit"]["engaged"] is True
    assert summary["eval_acc"] == 0.5 and summary["optimizer"] == "AdamW"


def test_other_trainers_metric_names_map_to_the_tasks_own() -> None:
    classification, lm = ClassificationTask.metrics, LanguageModelTask.metrics
    assert task_names({"eval_accuracy": 0.9, "eval_loss": 0.3, "epoch": 1}, classification) == (
        {"eval_loss": 0.3, "eval_acc": 0.9},
        ["epoch"],
    )
    assert task_names({"val_acc_epoch": 0.8, "val_loss": 0.4}, classification)[0] == {
        "eval_loss": 0.4,
        "eval_acc": 0.8,
    }
    # The task's own name wins over an alias; a metric logged as None is no value.
    assert task_names({"eval_acc": 0.7, "accuracy": 0.1}, classification)[0] == {"eval_acc": 0.7}
    assert task_names({"val_ppl": None, "val_loss": 2.0}, lm)[0] == {"eval_loss": 2.0}


def test_a_missing_quality_metric_is_named(tmp_path, caplog) -> None:
    model, (x, y) = tiny_model(0), data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="amp_exp"), amp_exp.record(
        tmp_path, model=model, optimizer=optimizer, precision="fp32", seed=0,
        task="classification", log_every=1,
    ) as run:  # fmt: skip
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        run.step(torch.tensor(1.0), batch_size=len(x))
        run.eval(val_f1=0.5, val_loss=1.0)
    assert "no eval_acc was recorded (looked for eval_acc, eval_accuracy, val_acc" in caplog.text
    assert "got val_f1" in caplog.text


def test_importing_amp_exp_imports_neither_transformers_nor_lightning_nor_torch() -> None:
    code = (
        "import sys, amp_exp; "
        "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', 'torch') "
        "if m in sys.modules)); "
        "amp_exp.record; "
        "print(sorted(m for m in ('transformers', 'lightning') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.splitlines() == ["[]", "[]"]


def test_a_report_judges_plain_loops_paired_by_model_and_seed(tmp_path) -> None:
    for precision in ("fp32", "bf16"):
        for seed in (0, 1):
            plain_loop(tmp_path / f"{precision}_{seed}", precision, seed)
    report = build_report([tmp_path], tmp_path)
    bf16 = [row for row in report["runs"] if row["precision"] == "bf16"]
    assert len(bf16) == 2 and all(row["baseline"] is not None for row in bf16)
    assert all(row["setting"] == "" for row in report["runs"])
