"""The engine built from plain objects, without Hydra: a task, loaders, a model, an optimizer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from amp_exp.config.schema import Precision, PrecisionConfig
from amp_exp.tasks.metrics import Metric, TaskMetrics, ToleranceUnit
from amp_exp.training.engine import Engine
from amp_exp.training.loop import LoopPlan
from amp_exp.training.precision import PrecisionPolicy

CPU = torch.device("cpu")


class Regression:
    """A task the engine has never heard of: mean squared error, counted in samples."""

    unit = "samples"
    units_per_sample = 1
    eval_sum_names = ("squared_error", "count")
    metrics = TaskMetrics(
        (Metric("eval_mse", "mean squared error", ".3g"),),
        quality="eval_mse",
        higher_is_better=False,
        tolerance_unit=ToleranceUnit.relative,
        default_tolerance=0.05,
    )

    def to_device(self, batch):
        return batch

    def batch_samples(self, batch) -> int:
        return batch[0].shape[0]

    def loss(self, model, batch):
        inputs, targets = batch
        return F.mse_loss(model(inputs), targets)

    def eval_sums(self, model, batch):
        inputs, targets = batch
        error = (model(inputs).float() - targets).pow(2).sum()
        return torch.stack([error.double(), torch.tensor(float(len(targets)), dtype=torch.double)])

    def eval_metrics(self, totals):
        error, count = totals
        return {"eval_mse": error / count}


class Batches:
    """Four fixed batches of y = 3x, the same every epoch."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(4, 8, 1, generator=generator)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.start = start_batch

    def __len__(self) -> int:
        return 4

    def __iter__(self):
        for x in self.inputs[getattr(self, "start", 0) :]:
            yield x, 3 * x


def make_engine(steps: int) -> Engine:
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = PrecisionPolicy(Precision.fp32, PrecisionConfig(), CPU)
    plan = LoopPlan(total_steps=steps, log_every=5, timing_warmup_steps=1)
    return Engine(model, Regression(), Batches(), Batches(), optimizer, policy, plan)


def test_an_engine_from_plain_objects_trains_any_task() -> None:
    rows: list[dict] = []
    result = make_engine(20).fit(rows.append)
    train_rows = [row for row in rows if row["kind"] == "train"]
    assert [row["step"] for row in train_rows] == [5, 10, 15, 20]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] / 10
    assert rows[-1] == {"kind": "eval", "step": 20, "samples": 160, **result.progress.eval}
    assert result.progress.eval["eval_mse"] < 0.05


def test_state_dict_round_trip_continues_exactly() -> None:
    whole = make_engine(12)
    whole.fit(lambda row: None)
    first = make_engine(12)
    first.plan = LoopPlan(total_steps=5, log_every=5, timing_warmup_steps=1)
    first.fit(lambda row: None)
    second = make_engine(12)
    second.load_state_dict(first.state_dict())
    second.fit(lambda row: None)
    for name, parameter in whole.model.state_dict().items():
        assert torch.equal(parameter, second.model.state_dict()[name]), name
    assert second.progress.step == 12 and second.progress.epoch == whole.progress.epoch
