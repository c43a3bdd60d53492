"""A task's metric declaration is all the summary, console, W&B and report need to know of it."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from amp_exp.report.assemble import build_report
from amp_exp.results.dashboard import wandb_metrics
from amp_exp.results.summary import make_summary
from amp_exp.run import train
from amp_exp.tasks import workload
from amp_exp.tasks.classification import ClassificationTask
from amp_exp.tasks.metrics import Metric, TaskMetrics, ToleranceUnit
from helpers.runs import read_jsonl

TINY = ("dataset.train_size=64", "dataset.eval_size=64", "trainer.max_steps=4")


class TopTwoTask(ClassificationTask):
    """Classification judged by a metric no module of amp_exp has heard of: top-2 accuracy."""

    eval_sum_names = ("top2", "count")
    metrics = TaskMetrics(
        (Metric("eval_top2", "top-2 accuracy", ".1%"),),
        quality="eval_top2",
        higher_is_better=True,
        tolerance_unit=ToleranceUnit.points,
        default_tolerance=2.0,
    )

    def eval_sums(self, model, batch):
        images, labels = batch
        top2 = (model(images).topk(2, dim=1).indices == labels[:, None]).any(dim=1).sum()
        count = torch.tensor(labels.shape[0], device=labels.device)
        return torch.stack([top2.double(), count.double()])

    def eval_metrics(self, totals):
        top2, count = totals
        return {"eval_top2": top2 / count if count else None}


@pytest.fixture
def top_two(monkeypatch) -> None:
    monkeypatch.setattr(
        workload,
        "make_task",
        lambda cfg, facts, device, channels_last: TopTwoTask(device, facts["num_classes"]),
    )


def test_a_task_with_an_unseen_metric_trains_and_reaches_the_summary_and_report(
    top_two, run_cfg, tmp_path, caplog
) -> None:
    with caplog.at_level(logging.INFO, logger="amp_exp"):
        fp32 = train(run_cfg(*TINY, "precision=fp32"), tmp_path / "0")
        train(run_cfg(*TINY, "precision=bf16"), tmp_path / "1")
    assert 0.0 <= fp32["eval_top2"] <= 1.0
    assert "eval_acc" not in fp32 and fp32["task_metrics"]["quality"] == "eval_top2"
    on_disk = json.loads((tmp_path / "0" / "summary.json").read_text())
    (eval_row,) = [r for r in read_jsonl(tmp_path / "0" / "metrics.jsonl") if r["kind"] == "eval"]
    assert on_disk["eval_top2"] == eval_row["eval_top2"] == fp32["eval_top2"]
    assert f"top-2 accuracy {fp32['eval_top2']:.1%}" in caplog.text

    report = build_report([tmp_path], tmp_path)
    bf16_row = next(row for row in report["runs"] if row["precision"] == "bf16")
    assert bf16_row["quality_delta"] == pytest.approx(
        100 * (bf16_row["eval"]["eval_top2"] - fp32["eval_top2"])
    )
    (verdict,) = report["verdicts"]
    assert "top-2 accuracy" in verdict and "±2 points" in verdict
    markdown = (tmp_path / "report.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| run"))
    assert header.endswith("| eval_top2 |")
    assert "Tolerance: eval_top2 ±2 points (each task's default)." in markdown


def test_wandb_charts_any_declared_eval_metric_under_eval() -> None:
    assert wandb_metrics({"eval_top2": 0.5, "eval_loss": 1.0}) == {
        "eval/top2": 0.5,
        "eval/loss": 1.0,
    }


def test_the_summary_holds_the_declared_metrics_and_refuses_undeclared_ones() -> None:
    declared = TopTwoTask.metrics.as_dict()
    summary = make_summary("completed", {}, task_metrics=declared, eval_metrics={})
    keys = list(summary)
    # Declared but never evaluated: null, right after the declaration.
    assert keys[keys.index("task_metrics") + 1] == "eval_top2" and summary["eval_top2"] is None
    with pytest.raises(KeyError, match="eval metrics the task did not declare: eval_mse"):
        make_summary("completed", {}, task_metrics=declared, eval_metrics={"eval_mse": 1.0})
    assert TaskMetrics.from_dict(json.loads(json.dumps(declared))) == TopTwoTask.metrics


def test_a_declaration_names_a_quality_metric_it_has() -> None:
    with pytest.raises(ValueError, match="quality metric 'eval_f1' is not one of"):
        TaskMetrics((Metric("eval_loss", "loss"),), "eval_f1", False, ToleranceUnit.relative, 0.01)


def test_the_tolerance_unit_decides_how_a_difference_is_measured() -> None:
    points = TaskMetrics((Metric("a", "a"),), "a", True, ToleranceUnit.points, 0.5)
    relative = TaskMetrics((Metric("a", "a"),), "a", False, ToleranceUnit.relative, 0.01)
    assert points.delta(0.81, 0.80) == pytest.approx(1.0)
    assert relative.delta(2.02, 2.0) == pytest.approx(0.01)
    assert points.delta(None, 0.8) is None and relative.delta(1.0, 0.0) is None
