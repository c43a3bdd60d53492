"""A pass through the model before training leaves no trace: random number generators, buffers
and training modes are as they were, for the context itself and for each pass that uses it."""

from __future__ import annotations

import contextlib
import random

import numpy
import pytest
import torch
from torch import nn

from amp_exp.capability.auto import time_candidates
from amp_exp.capability.rounds import pass_trials
from amp_exp.runtime.no_trace import leaves_no_trace
from amp_exp.tasks.classification import ClassificationTask
from amp_exp.tasks.workload import check_output_fits

CPU = torch.device("cpu")


def model_with_state() -> nn.Module:
    """Dropout draws from torch's generator; BatchNorm moves its statistics in training mode."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))


def snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "modes": [m.training for m in model.modules()],
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": numpy.random.get_state()[1].copy(),
        "grads": [p.grad for p in model.parameters()],
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(before["state"][k], v) for k, v in after["state"].items())
    assert after["modes"] == before["modes"]
    assert torch.equal(after["torch"], before["torch"])
    assert after["python"] == before["python"]
    assert numpy.array_equal(after["numpy"], before["numpy"])
    assert all(g is None for g in after["grads"])


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(32, 8, generator=generator), torch.randint(4, (32,), generator=generator)


@pytest.mark.parametrize("raises", [False, True])
def test_the_context_restores_generators_buffers_and_modes_however_the_block_ends(raises) -> None:
    model = model_with_state()
    model[1].eval()  # a submodule in its own mode comes back in it
    before = snapshot(model)
    failing = pytest.raises(RuntimeError) if raises else contextlib.nullcontext()
    with failing, leaves_no_trace(model):
        model.train()
        with torch.no_grad():
            model(batch()[0])
        torch.rand(3), random.random(), numpy.random.rand()
        if raises:
            raise RuntimeError("the pass failed")
    assert_unchanged(model, before)


def test_the_output_check_leaves_no_trace() -> None:
    model = model_with_state()
    before = snapshot(model)
    check_output_fits(ClassificationTask(CPU, num_classes=4), model, batch(), cfg=None)
    assert_unchanged(model, before)


def test_the_auto_precision_trial_leaves_no_trace_by_itself() -> None:
    model = model_with_state()
    model.eval()
    before = snapshot(model)
    time_candidates(model, ClassificationTask(CPU, num_classes=4), batch(), ["fp32"], pass_trials)
    assert_unchanged(model, before)
