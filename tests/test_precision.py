"""The plugin base's AMP step: the scaler exists only for fp16, and the sequence is right; the
rules precision=auto decides by, and the requests the hardware refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_exp.capability.device import check_request
from amp_exp.config.schema import AdamWConfig, PrecisionConfig, SGDConfig
from amp_exp.errors import ConfigError
from amp_exp.training.optim import build_optimizer
from amp_exp.training.precisions.base import Gradients, PrecisionPlugin, create
from helpers.probes import capability_with

CPU = torch.device("cpu")
fp32, bf16, fp16 = "fp32", "bf16", "fp16"


def tiny_setup(precision: str, fused: bool = False, **knobs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    policy = create(precision, PrecisionConfig(name=precision, **knobs), CPU)
    return model, optimizer, policy


def step(policy: PrecisionPlugin, optimizer, model, want_grad_norm: bool = False) -> Gradients:
    """The optimizer's end of Engine.train_step: unscale -> clip -> step -> update."""
    policy.unscale(optimizer)
    gradients = policy.clip(list(model.parameters()), want_grad_norm)
    policy.step(optimizer, gradients.found_inf)
    policy.update()
    return gradients


def forward_backward(model, policy, loss_factor: float = 1.0) -> torch.Tensor:
    inputs, targets = torch.randn(32, 8), torch.randint(4, (32,))
    with policy.forward_context():
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits, targets) * loss_factor
    policy.backward(policy.scaled(loss))
    return logits


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fp32_and_bf16_never_build_a_scaler(precision: str) -> None:
    _, _, policy = tiny_setup(precision)
    assert policy.scaler is None
    assert policy.scale() is None


def test_fp16_scaler_takes_every_knob() -> None:
    _, _, policy = tiny_setup(
        "fp16", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7
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
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
    ],
)
def test_autocast_runs_the_forward_in_the_chosen_dtype(precision, dtype) -> None:
    model, _, policy = tiny_setup(precision)
    assert forward_backward(model, policy).dtype == dtype


def test_fp16_step_keeps_fp32_master_weights_and_unscaled_fp32_grads() -> None:
    model, optimizer, policy = tiny_setup("fp16", clip_grad_norm=1.0)
    seen_at_step = []
    # The pre-step hook runs inside optimizer.step(), i.e. after unscale_ and clipping.
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen_at_step.append([p.grad.clone() for p in model.parameters()])
    )
    forward_backward(model, policy)
    gradients = step(policy, optimizer, model, want_grad_norm=True)
    assert gradients.found_inf == 0
    (grads,) = seen_at_step
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    # Unscaled and clipped: a scaled gradient would have a norm near 65536 times larger.
    assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])) <= 1.0 + 1e-4
    assert torch.isfinite(gradients.norm)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_fp16_overflow_is_skipped_and_backs_off_the_scale(fused: bool) -> None:
    """Both GradScaler paths: a non-fused optimizer is not called; a fused one (SGD's fused
    kernel runs on the CPU) takes found_inf into its kernel and leaves the weights alone."""
    model, optimizer, policy = tiny_setup("fp16", fused=fused, init_scale=256.0)
    before = [p.detach().clone() for p in model.parameters()]
    forward_backward(model, policy, loss_factor=float("inf"))
    gradients = step(policy, optimizer, model)
    assert gradients.found_inf == 1
    assert gradients.nonfinite.tolist() == [True] * 4
    assert policy.scale() == 128.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # The next finite step goes through.
    optimizer.zero_grad()
    forward_backward(model, policy)
    assert step(policy, optimizer, model).found_inf == 0
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(
    "cfg", [SGDConfig(fused=True), AdamWConfig(fused=True)], ids=["sgd", "adamw"]
)
def test_a_fused_optimizer_skips_a_nonfinite_step_on_the_device(cfg) -> None:
    """Without a scaler the non-finite guard hands the fused kernel found_inf: a skipped first
    step leaves weights and state (AdamW's step count too) as they were, so the step after it
    is an exact first step. (torch's fused SGD would read a momentum buffer it never wrote.)"""

    def train(loss_factors: list[float]) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        optimizer, _ = build_optimizer(cfg, model, CPU)
        policy = create(fp32, PrecisionConfig(name=fp32), CPU, guard_nonfinite=True)
        for factor in loss_factors:
            torch.manual_seed(1)  # the same batch every step
            forward_backward(model, policy, loss_factor=factor)
            step(policy, optimizer, model)
            optimizer.zero_grad()
        return [p.detach() for p in model.parameters()], optimizer

    skipped_then_applied, optimizer = train([float("inf"), 1.0])
    applied, _ = train([1.0])
    assert optimizer.defaults["fused"]
    assert all(torch.equal(a, b) for a, b in zip(skipped_then_applied, applied, strict=True))
    if isinstance(cfg, AdamWConfig):
        assert {state["step"].item() for state in optimizer.state.values()} == {1.0}


def test_auto_times_fp32_and_the_low_precisions_the_probe_does_not_rule_out() -> None:
    assert capability_with({"fp32": 1, "bf16": 0.9, "fp16": 0.02}).trial_candidates() == [
        fp32,
        bf16,
    ]
    slow_cpu = capability_with({"fp32": 1, "bf16": 0.4, "fp16": 0.02})
    assert slow_cpu.trial_candidates() == [fp32]
    assert (
        slow_cpu.left_out()
        == "the probe measured bf16 about 2.50x and fp16 about 50x slower than fp32"
    )
    turing = capability_with({"fp32": 1, "fp16": 4.0}, device="cuda")
    assert turing.trial_candidates() == [fp32, fp16]
    assert turing.left_out() == "bf16 is not supported here"


def test_bf16_on_a_gpu_without_bf16_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ConfigError, match="Tesla T4 lacks it; use precision=fp16"):
        check_request("bf16", torch.device("cuda", 0), PrecisionConfig())
    check_request("fp16", torch.device("cuda", 0), PrecisionConfig())
