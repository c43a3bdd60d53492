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
from helpers.warm_python import python_m
from test_no_host_sync import count_host_reads

# The reports here are read for their verdicts and rows, not their PNGs (conftest).
pytestmark = pytest.mark.usefixtures("pngs_not_rasterized")
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
    accuracy_as: str = "val_acc",
    **record_args,
):
    """A plain loop recorded with ``amp_exp.record``: autocast as ``precision`` says (unless
    ``autocast`` is off), a GradScaler for fp16, an overflowing loss at the steps ``inf_at``,
    the accuracy reported as ``accuracy_as``."""
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
            accuracy = (logits.argmax(1) == y).float().mean()
            run.eval(val_loss=F.cross_entropy(logits, y), **{accuracy_as: accuracy})
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


def test_a_recorded_fp16_loop_logs_the_scale_s_geometric_mean_over_each_interval(
    tmp_path,
) -> None:
    """The engine's ScaleRecord, fed by the trainer's own scaler: steps 1 and 2 leave 2^16 and
    2^15 (step 2 overflows), so the row at step 2 has a mean of 2^15.5, not the read 2^15; the
    next interval starts anew."""
    plain_loop(tmp_path, "fp16", inf_at={2}, steps=4)
    train_rows = rows(tmp_path, "train")
    assert [row["scale"] for row in train_rows] == [2.0**15, 2.0**15]
    assert [row["scale_mean"] for row in train_rows] == pytest.approx([2.0**15.5, 2.0**15])


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
    # The resumed attempt warms up and audits in its own steps, past the first attempt's.
    assert summary["precision_audit"]["step"] == 4


def test_the_recorder_reads_the_device_only_at_log_steps(tmp_path, monkeypatch) -> None:
    """Host reads over the whole step (the forward and the optimizer step, where the signals'
    hooks run, and ``step``): none at the steps between log steps."""
    model, (x, y) = tiny_model(0), data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reads = []
    with amp_exp.record(
        tmp_path, model=model, optimizer=optimizer, precision="bf16", seed=0,
        task="classification", log_every=4,
    ) as run:  # fmt: skip
        for _ in range(12):
            with monkeypatch.context() as patch:
                counts = count_host_reads(patch)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                run.step(loss, batch_size=len(x))
            reads.append(sum(counts.values()))
    between = [count for step, count in enumerate(reads, start=1) if step % 4]
    assert between == [0] * 9
    assert all(reads[step - 1] > 0 for step in (4, 8, 12))


def test_a_plain_loop_logs_the_engines_long_run_signals_at_each_log_step(tmp_path) -> None:
    """A signals row after each train row, measured on that step: every block's activations
    against bf16's range and its update ratio (a collector armed after the forward, or read
    without the optimizer's hooks, would leave them None)."""
    plain_loop(tmp_path, "bf16", steps=6)
    assert run_problems(tmp_path) == []
    signals = rows(tmp_path, "signals")
    assert [row["step"] for row in signals] == [row["step"] for row in rows(tmp_path, "train")]
    for row in signals:
        assert row["format"] == "bf16" and row["format_max"] == torch.finfo(torch.bfloat16).max
        for block in ("0", "2"):
            assert row[f"act_absmax/{block}"] > 0 and row[f"act_kurtosis/{block}"] > 0
            assert row[f"act_range_frac/{block}"] == row[f"act_absmax/{block}"] / row["format_max"]
            assert 0 < row[f"update_ratio/{block}"] < 1
        assert row["logit_max"] is not None and row["logit_mean"] is not None


def test_a_step_the_scaler_skipped_measures_no_update(tmp_path) -> None:
    """An fp16 log step whose gradients overflowed: optimizer.step never ran, so no update
    ratio (a collector fed by the loop's call, not the optimizer's, would report one)."""
    plain_loop(tmp_path, "fp16", inf_at={2}, steps=4)
    by_step = {row["step"]: row for row in rows(tmp_path, "signals")}
    assert by_step[2]["update_ratio/0"] is None and by_step[4]["update_ratio/0"] > 0
    assert by_step[2]["format"] == "fp16"


def test_the_forecast_runs_on_a_directory_recorded_by_record(tmp_path) -> None:
    """``python -m amp_exp.forecast`` reads a plain loop's signals as it reads the engine's:
    each block's signal is fitted or named unforecastable, none missing."""
    from amp_exp.forecast.__main__ import main

    plain_loop(tmp_path, "bf16", steps=12)
    assert main([str(tmp_path), "--steps", "120"]) == 0
    forecast = json.loads((tmp_path / "forecast.json").read_text())
    assert forecast["planned_steps"] == 120
    named = json.dumps(forecast)
    assert "act_absmax" in named and "update_ratio" in named


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


def test_the_report_says_a_loop_whose_bf16_never_engaged_did_not_engage(tmp_path) -> None:
    for seed in (0, 1):
        plain_loop(tmp_path / f"fp32_{seed}", "fp32", seed)
        plain_loop(tmp_path / f"bf16_{seed}", "bf16", seed, autocast=False)
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert comparison["verdict"] == "not_engaged"
    assert "did not engage" in report["verdicts"][0]


def test_the_report_names_the_metric_a_loop_never_recorded(tmp_path) -> None:
    """An accuracy under a name no alias knows (``val_top1``): the verdict names eval_acc."""
    for precision in ("fp32", "bf16"):
        for seed in (0, 1):
            plain_loop(tmp_path / f"{precision}_{seed}", precision, seed, accuracy_as="val_top1")
    report = build_report([tmp_path], tmp_path)
    assert "tiny_mlp: bf16 against fp32: no eval_acc to compare" in report["verdicts"][0]


@pytest.mark.slow
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


# The real trainers, on tiny models: two seeds of fp32 and bf16 each, in-process.
SEEDS = (0, 1)


def hf_trainer_run(run_dir: Path, precision: str, seed: int, evaluate_after: bool = False) -> None:
    """The Trainer evaluating at its last step, or (``evaluate_after``) only in an
    ``evaluate()`` after ``train()``."""
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from amp_exp.integrations.transformers import AmpExpCallback

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=2, max_position_embeddings=16,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    ids = torch.randint(0, 32, (32, 8), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": i, "labels": int(i[0] < 16)} for i in ids]
    args = TrainingArguments(
        str(run_dir), max_steps=4, per_device_train_batch_size=8, logging_steps=2,
        bf16=precision == "bf16", use_cpu=True, report_to=[],
        eval_strategy="no" if evaluate_after else "steps",
        eval_steps=4, save_strategy="no", seed=seed, learning_rate=1e-3, disable_tqdm=True,
    )  # fmt: skip

    def accuracy(prediction) -> dict:
        return {
            "accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())
        }

    trainer = Trainer(
        model=model, args=args, train_dataset=rows, eval_dataset=rows[:16],
        compute_metrics=accuracy, callbacks=[AmpExpCallback()],
    )  # fmt: skip
    trainer.train()
    if evaluate_after:
        trainer.evaluate()


class TinyLightningNet:
    """A LightningModule class, built when lightning is imported."""

    @staticmethod
    def make(inf_at: set[int] = frozenset()):
        import lightning as L

        class Net(L.LightningModule):
            def __init__(self, lr: float = 0.5) -> None:
                super().__init__()
                self.save_hyperparameters()
                self.net = tiny_model(torch.initial_seed() % 2**31)

            def forward(self, x):
                return self.net(x)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = F.cross_entropy(self(x), y)
                return loss * float("inf") if self.global_step + 1 in inf_at else loss

            def validation_step(self, batch, batch_idx):
                x, y = batch
                logits = self(x)
                self.log("val_loss", F.cross_entropy(logits, y))
                self.log("val_acc", (logits.argmax(1) == y).float().mean())

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        return Net()


def lightning_run(run_dir: Path, precision: str, seed: int, **trainer_args) -> None:
    import lightning as L

    from amp_exp.integrations.lightning import AmpExpCallback

    L.seed_everything(seed, verbose=False)
    x, y = data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    inf_at = trainer_args.pop("inf_at", set())
    if "plugins" not in trainer_args:  # a precision plugin given is the precision
        trainer_args["precision"] = precision
    trainer = L.Trainer(
        max_steps=4, accelerator="cpu", log_every_n_steps=2,
        val_check_interval=4, default_root_dir=str(run_dir), enable_progress_bar=False,
        enable_model_summary=False, logger=False, enable_checkpointing=False,
        callbacks=[AmpExpCallback()], **trainer_args,
    )  # fmt: skip
    trainer.fit(TinyLightningNet.make(inf_at), loader, loader)


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_runs")
    for precision in ("fp32", "bf16"):
        for seed in SEEDS:
            hf_trainer_run(root / f"{precision}_{seed}", precision, seed)
    return root


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lightning_runs")
    for precision, flag in (("fp32", "32-true"), ("bf16", "bf16-mixed")):
        for seed in SEEDS:
            lightning_run(root / f"{precision}_{seed}", flag, seed)
    return root


def assert_signals_at_each_log_step(run_dir: Path) -> None:
    """A trainer's record holds a signals row at each train row's step, with every block's
    update ratio measured (None: the optimizer's hooks never saw the update)."""
    signals = rows(run_dir, "signals")
    assert signals
    assert [row["step"] for row in signals] == [row["step"] for row in rows(run_dir, "train")]
    for row in signals:
        ratios = [value for key, value in row.items() if key.startswith("update_ratio/")]
        assert ratios and all(value is not None and value > 0 for value in ratios), row
        assert row["logit_max"] is not None


def summaries(root: Path) -> dict[str, dict]:
    return {
        path.parent.parent.name: json.loads(path.read_text())
        for path in sorted(root.glob("*/amp_exp/summary.json"))
    }


@pytest.mark.slow
def test_the_hf_trainer_records_into_output_dir_amp_exp_in_the_results_format(hf_runs) -> None:
    found = summaries(hf_runs)
    assert sorted(found) == ["bf16_0", "bf16_1", "fp32_0", "fp32_1"]
    for name, summary in found.items():
        assert run_problems(hf_runs / name / "amp_exp") == [], name
        assert_signals_at_each_log_step(hf_runs / name / "amp_exp")
        assert summary["status"] == "completed" and summary["steps"] == 4
        assert summary["eval_acc"] is not None  # compute_metrics' eval_accuracy, mapped
        assert summary["precision_audit"]["engaged"] is True
    bf16 = found["bf16_0"]
    assert bf16["precision"] == "bf16" and "bf16=True" in bf16["precision_reason"]
    assert "autocast bfloat16" in bf16["precision_reason"]
    assert found["fp32_0"]["precision"] == "fp32"
    assert bf16["model"] == found["fp32_0"]["model"] == "bert"


@pytest.mark.slow
def test_a_finished_hf_record_is_refused_in_a_reused_output_dir(hf_runs, tmp_path) -> None:
    import shutil

    shutil.copytree(hf_runs / "fp32_0", tmp_path / "run")
    with pytest.raises(RunRefused, match="pass resume=True"):
        hf_trainer_run(tmp_path / "run", "fp32", 0)


@pytest.mark.slow
def test_an_hf_evaluate_after_train_reaches_the_closed_record(tmp_path) -> None:
    hf_trainer_run(tmp_path, "bf16", 0, evaluate_after=True)
    summary = json.loads((tmp_path / "amp_exp" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["eval_acc"] is not None
    assert [row["step"] for row in rows(tmp_path / "amp_exp", "eval")] == [4]
    assert run_problems(tmp_path / "amp_exp") == []


@pytest.mark.slow
def test_lightning_records_its_precision_string_and_val_metrics(lightning_runs) -> None:
    found = summaries(lightning_runs)
    assert sorted(found) == ["bf16_0", "bf16_1", "fp32_0", "fp32_1"]
    for name, summary in found.items():
        assert run_problems(lightning_runs / name / "amp_exp") == [], name
        assert_signals_at_each_log_step(lightning_runs / name / "amp_exp")
        assert summary["eval_acc"] is not None and summary["eval_loss"] is not None
        assert summary["seed"] == int(name[-1])
    assert "precision='bf16-mixed'" in found["bf16_0"]["precision_reason"]
    assert found["bf16_0"]["precision_audit"]["flops_by_dtype"] == {"bfloat16": 1.0}
    assert found["fp32_0"]["precision_audit"]["flops_by_dtype"] == {"float32": 1.0}


@pytest.mark.slow
def test_lightnings_own_fp16_scaler_gives_the_scale_and_the_skipped_steps(tmp_path) -> None:
    """A Lightning MixedPrecision plugin with a CPU GradScaler: the step it skipped is counted."""
    from lightning.pytorch.plugins import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    lightning_run(tmp_path, "", 0, plugins=[plugin], inf_at={3})
    summary = json.loads((tmp_path / "amp_exp" / "summary.json").read_text())
    assert summary["precision"] == "fp16"
    assert summary["skipped_steps"] == 1 and summary["loss_scale"] == 2.0**15
    assert summary["precision_audit"]["flops_by_dtype"] == {"float16": 1.0}


@pytest.mark.slow
def test_the_report_judges_each_trainers_runs_paired_by_model_and_seed(
    hf_runs, lightning_runs, tmp_path
) -> None:
    """Given as directories, from two trainers at once: each bf16 run against the fp32 run of
    its own model and seed, one verdict per model."""
    report = build_report([hf_runs, lightning_runs], tmp_path)
    bf16 = [row for row in report["runs"] if row["precision"] == "bf16"]
    assert sorted(row["model"] for row in bf16) == ["Net", "Net", "bert", "bert"]
    for row in bf16:
        baseline = next(r for r in report["runs"] if r["run"] == row["baseline"])
        assert (baseline["model"], baseline["seed"]) == (row["model"], row["seed"])
    result = python_m(
        "amp_exp.report", str(hf_runs), str(lightning_runs), "--out", str(tmp_path / "printed")
    )
    assert result.returncode == 0, result.stderr[-2000:]
    verdicts = [line for line in result.stdout.splitlines() if " against fp32" in line]
    assert sorted(line.split(":")[0] for line in verdicts) == ["Net", "bert"]
