"""PrecisionPolicy: the scaler exists only for fp16, and the AMP step sequence is right."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_exp.config.schema import Precision, PrecisionConfig
from amp_exp.errors import ConfigError
from amp_exp.runtime.hardware import resolve_precision
from amp_exp.training.precision import PrecisionPolicy

CPU = torch.device("cpu")


def tiny_setup(precision: Precision, **knobs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = PrecisionPolicy(precision, PrecisionConfig(name=precision, **knobs), CPU)
    policy.watch(optimizer)
    return model, optimizer, policy


def forward_backward(model, policy, loss_factor: float = 1.0) -> torch.Tensor:
    inputs, targets = torch.randn(32, 8), torch.randint(4, (32,))
    with policy.autocast():
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits, targets) * loss_factor
    policy.backward(loss)
    return logits


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
def test_fp32_and_bf16_never_build_a_scaler(precision: Precision) -> None:
    _, _, policy = tiny_setup(precision)
    assert policy.scaler is None
    assert policy.scale() is None


def test_fp16_scaler_takes_every_knob() -> None:
    _, _, policy = tiny_setup(
        Precision.fp16, init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7
    )
    scaler = policy.scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.get_scale() == 1024.0
    assert scaler.get_growth_factor() == 4.0
    assert scaler.get_backoff_factor() == 0.25
    assert scaler.get_growth_interval() == 7


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        (Precision.fp32, torch.float32),
        (Precision.bf16, torch.bfloat16),
        (Precision.fp16, torch.float16),
    ],
)
def test_autocast_runs_the_forward_in_the_chosen_dtype(precision, dtype) -> None:
    model, _, policy = tiny_setup(precision)
    assert forward_backward(model, policy).dtype == dtype


def test_fp16_step_keeps_fp32_master_weights_and_unscaled_fp32_grads() -> None:
    model, optimizer, policy = tiny_setup(Precision.fp16, clip_grad_norm=1.0)
    seen_at_step = []
    # The pre-step hook runs inside optimizer.step(), i.e. after unscale_ and clipping.
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen_at_step.append([p.grad.clone() for p in model.parameters()])
    )
    forward_backward(model, policy)
    stepped, grad_norm = policy.step(optimizer, list(model.parameters()), want_grad_norm=True)
    assert stepped
    (grads,) = seen_at_step
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    # Unscaled and clipped: a scaled gradient would have a norm near 65536 times larger.
    assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])) <= 1.0 + 1e-4
    assert torch.isfinite(grad_norm)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_fp16_overflow_is_skipped_and_backs_off_the_scale() -> None:
    model, optimizer, policy = tiny_setup(Precision.fp16, init_scale=256.0)
    before = [p.detach().clone() for p in model.parameters()]
    forward_backward(model, policy, loss_factor=float("inf"))
    stepped, _ = policy.step(optimizer, list(model.parameters()), want_grad_norm=False)
    assert not stepped
    assert policy.scale() == 128.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # The next finite step goes through.
    optimizer.zero_grad()
    forward_backward(model, policy)
    stepped, _ = policy.step(optimizer, list(model.parameters()), want_grad_norm=False)
    assert stepped
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_auto_on_cpu_picks_fp32_and_says_why() -> None:
    resolved = resolve_precision(Precision.auto, CPU)
    assert resolved.precision is Precision.fp32
    assert "CPU" in resolved.reason


def test_auto_on_a_tensor_core_gpu_picks_fp16(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    resolved = resolve_precision(Precision.auto, torch.device("cuda", 0))
    assert resolved.precision is Precision.fp16
    assert "loss scaling" in resolved.reason


def test_auto_on_an_old_gpu_picks_fp32(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    assert resolve_precision(Precision.auto, torch.device("cuda", 0)).precision is Precision.fp32


def test_bf16_on_a_gpu_without_bf16_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ConfigError, match="Tesla T4 lacks it; use precision=fp16"):
        resolve_precision(Precision.bf16, torch.device("cuda", 0))
