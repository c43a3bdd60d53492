"""The engine built from plain objects, without Hydra: a task, loaders, a model, an optimizer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_exp.config.schema import PrecisionConfig
from amp_exp.launch import WorkerRank
from amp_exp.runtime.distributed import load_plain_state, plain_state
from amp_exp.tasks.metrics import Metric, TaskMetrics, ToleranceUnit
from amp_exp.training.callbacks import ORDER, StepCallback
from amp_exp.training.engine import Engine
from amp_exp.training.loop import LoopPlan
from amp_exp.training.precisions.base import create
from amp_exp.training.rng import rng_state
from amp_exp.training.stochastic_rounding import StochasticRoundingStep

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
    policy = create("fp32", PrecisionConfig(), CPU)
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


class Recorder(StepCallback):
    """A step callback that notes what it saw, and when."""

    def __init__(self, name: str, seen: list, model: nn.Module, optimizer) -> None:
        self.name, self.seen, self.model, self.optimizer = name, seen, model, optimizer

    def after_clip(self, step: int, gradients) -> None:
        self.seen.append((self.name, "after_clip", step))

    def after_step(self, step: int) -> None:
        stand_ins = any(
            p not in set(self.model.parameters()) for p in self.optimizer.param_groups[0]["params"]
        )
        dtypes = {p.dtype for p in self.model.parameters()}
        self.seen.append((self.name, "after_step", step, stand_ins, dtypes))


def test_step_callbacks_run_in_the_stated_order_after_the_rounded_update() -> None:
    """Added in the opposite order, they still run as ORDER says; after_step comes after the
    update, so the diagnostics see the bf16 weights stochastic rounding put in place, not the
    optimizer's fp32 stand-ins."""
    torch.manual_seed(0)
    policy = create("bf16_true", PrecisionConfig(name="bf16_true"), CPU)
    model = policy.convert_module(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy.rounding = StochasticRoundingStep()
    plan = LoopPlan(total_steps=2, log_every=2, timing_warmup_steps=1, eval_every=None)
    engine = Engine(model, Regression(), Batches(), None, optimizer, policy, plan)
    seen: list = []
    for name in reversed(ORDER):
        engine.callbacks.add(Recorder(name, seen, model, optimizer))
    with pytest.raises(ValueError, match="no place in ORDER"):
        engine.callbacks.add(Recorder("late", seen, model, optimizer))
    engine.fit(lambda row: None)
    assert engine.callbacks.names == list(ORDER)
    first_step = [entry[:3] for entry in seen[: 2 * len(ORDER)]]
    assert first_step == [(name, "after_clip", 1) for name in ORDER] + [
        (name, "after_step", 1) for name in ORDER
    ]
    assert all(entry[3:] == (False, {torch.bfloat16}) for entry in seen if entry[1] == "after_step")
    assert len(seen) == 4 * len(ORDER)


class FakeRanks:
    """Rank 1 of 2 under DDP, whose peer's generators are ``peer``; nothing crosses a process."""

    world_size, shards = 2, False
    rank = WorkerRank(1, 2, 1)

    def __init__(self, peer: dict) -> None:
        self.peer = peer

    def gather(self, value):
        return [self.peer, value] if isinstance(value, dict) else [value, value]

    def state_of(self, model, optimizer):
        return plain_state(model, optimizer)

    def load_state(self, model, optimizer, model_state, optimizer_state):
        load_plain_state(model, optimizer, model_state, optimizer_state)


def test_a_checkpoint_holds_every_ranks_generators_and_each_rank_restores_its_own() -> None:
    """Rank 1 resumes from its own state, not from rank 0's (which drew other numbers)."""
    torch.manual_seed(7)
    peer = rng_state(CPU)
    engine = make_engine(4)
    engine.distributed = FakeRanks(peer)
    torch.manual_seed(8)
    own = torch.get_rng_state()
    state = engine.state_dict()
    assert len(state["rng"]) == 2 and torch.equal(state["rng"][0]["torch"], peer["torch"])
    torch.manual_seed(9)
    engine.load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), own)


def test_a_skipped_step_is_skipped_on_the_device_and_taken_back_from_the_schedule() -> None:
    """A fused optimizer skips step 3 inside its kernel; at the log step (5) the host learns of
    it, counts it and moves the schedule back one step: it stepped 4 times, not 5."""
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    policy = create("fp32", PrecisionConfig(), CPU, guard_nonfinite=True)
    plan = LoopPlan(total_steps=5, log_every=5, timing_warmup_steps=1, eval_every=None)
    engine = Engine(
        model, Regression(), Batches(), None, optimizer, policy, plan, scheduler=schedule
    )
    calls = 0

    def poison_step_3(grad: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return grad * float("inf") if calls == 3 else grad

    model.weight.register_hook(poison_step_3)
    rows: list[dict] = []
    result = engine.fit(rows.append)
    assert result.progress.skipped_steps == 1 and rows[0]["skipped_steps"] == 1
    assert result.progress.first_overflow == {
        "step": 3,
        "loss_finite": True,
        "parameters": ["weight"],
        "nonfinite_parameter_count": 1,
    }
    assert schedule.last_epoch == 4
    assert rows[0]["lr"] == pytest.approx(0.1 / 5)
    assert torch.isfinite(model.weight).all()
