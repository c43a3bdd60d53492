"""AMP health: hardware advice, the automated checklist, underflow, first-overflow forensics."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import amp_exp.runtime.hardware
from amp_exp.run import train
from amp_exp.runtime.hardware import inspect_hardware, precision_advice, recommend_precision
from amp_exp.tasks.vision_models import l2_normalize_function
from amp_exp.training.diagnostics import FP16_MAX, gradient_ranges, largest_safe_scale
from conftest import TINY

CPU = torch.device("cpu")


def cpu_with(monkeypatch, *flags: str) -> dict:
    monkeypatch.setattr(amp_exp.runtime.hardware, "cpu_flags", lambda: set(flags))
    return inspect_hardware(CPU)


def gpu_with(monkeypatch, capability: tuple[int, int]) -> dict:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    return inspect_hardware(torch.device("cuda", 0))


def test_cpu_without_fast_kernels_warns_for_fp16_and_bf16(monkeypatch) -> None:
    plain = cpu_with(monkeypatch)
    assert "20-60x slower than fp32" in precision_advice("fp16", plain)[0]
    assert "use precision=fp32" in precision_advice("fp16", plain)[0]
    assert "no avx512_bf16/AMX-BF16" in precision_advice("bf16", plain)[0]
    assert precision_advice("fp32", plain) == []
    assert recommend_precision(plain)[0] == "fp32"


def test_cpu_with_bf16_instructions_recommends_bf16(monkeypatch) -> None:
    bf16_cpu = cpu_with(monkeypatch, "avx512_bf16")
    assert precision_advice("bf16", bf16_cpu) == []
    assert "use precision=bf16" in precision_advice("fp16", bf16_cpu)[0]
    assert recommend_precision(bf16_cpu)[0] == "bf16"
    assert precision_advice("fp16", cpu_with(monkeypatch, "avx512_fp16")) == []


def test_gpu_capabilities_drive_the_advice(monkeypatch) -> None:
    pascal = gpu_with(monkeypatch, (6, 1))
    assert not pascal["tensor_cores"]
    assert "no Tensor Cores" in precision_advice("fp16", pascal)[0]
    assert recommend_precision(pascal)[0] == "fp32"
    volta = gpu_with(monkeypatch, (7, 0))
    assert volta["tensor_cores"] and not volta["native_bf16"]
    assert precision_advice("fp16", volta) == []
    assert recommend_precision(volta)[0] == "fp16"
    hopper = gpu_with(monkeypatch, (9, 0))
    assert hopper["native_bf16"] and recommend_precision(hopper)[0] == "bf16"


def test_run_records_hardware_and_warns_once(run_cfg, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(amp_exp.runtime.hardware, "cpu_flags", lambda: set())
    summary = train(run_cfg("precision=fp16", *TINY), tmp_path)
    assert summary["hardware"]["device"] == "cpu"
    assert summary["hardware"]["recommended_precision"] == "fp32"
    assert caplog.text.count("20-60x slower") == 1


def test_underflow_fraction_follows_the_loss_scale() -> None:
    grads = [("layer", torch.full((1000,), 1e-5))]
    tiny_totals, _, _ = gradient_ranges(grads, scale=2.0**-10)
    sane_totals, worst, max_abs = gradient_ranges(grads, scale=2.0**16)
    assert tiny_totals["underflow_frac_scaled"] == 1.0
    assert sane_totals["underflow_frac_scaled"] == 0.0
    assert sane_totals["underflow_frac"] == 0.0  # 1e-5 is above fp16's smallest subnormal
    assert worst[0]["layer"] == "layer"
    assert max_abs == pytest.approx(1e-5)
    overflow_totals, _, _ = gradient_ranges(grads, scale=2.0**33)
    assert overflow_totals["overflow_frac_scaled"] == 1.0


@pytest.mark.parametrize("max_grad", [1e-5, 0.3, 1.0, 65504.0 / 1024, 7.0e3])
def test_suggested_scale_is_a_power_of_two_below_the_overflow_limit(max_grad: float) -> None:
    scale = largest_safe_scale(max_grad)
    assert scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())
    assert scale * max_grad < FP16_MAX
    assert 2 * scale * max_grad >= FP16_MAX or scale == 2.0**24


def test_no_suggestion_without_a_gradient_magnitude() -> None:
    assert largest_safe_scale(0.0) is None
    assert largest_safe_scale(float("inf")) is None


def test_tiny_loss_scale_shows_as_underflow_and_a_sane_one_does_not(run_cfg, tmp_path) -> None:
    def underflow_run(init_scale: str) -> dict:
        overrides = ("precision=fp16", "diagnostics.underflow_every=2", *TINY)
        return train(
            run_cfg(*overrides, f"precision.init_scale={init_scale}"), tmp_path / init_scale
        )

    tiny, sane = underflow_run("1e-12"), underflow_run("1024")
    assert tiny["underflow"]["step"] == 4
    assert tiny["underflow"]["scale"] == pytest.approx(1e-12)
    assert tiny["underflow"]["underflow_frac_scaled"] > 0.9
    assert sane["underflow"]["underflow_frac_scaled"] < 0.1
    assert len(sane["underflow"]["worst"]) == 5
    assert sane["suggested_init_scale"] >= 2.0**10


def test_overflow_in_one_layer_is_reported_as_the_first_overflow(run_cfg) -> None:
    from amp_exp.run import build

    built = build(run_cfg("precision=fp16", *TINY))
    calls = 0

    def poison_second_step(grad: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return grad * float("inf") if calls == 2 else grad

    built.model.head.weight.register_hook(poison_second_step)
    result = built.engine.fit(lambda row: None)
    assert result.progress.first_overflow == {
        "step": 2,
        "loss_finite": True,
        "parameters": ["head.weight"],
        "nonfinite_parameter_count": 1,
    }


def test_checks_pass_on_a_healthy_fp16_run(run_cfg, tmp_path) -> None:
    checks = train(run_cfg("precision=fp16", *TINY), tmp_path)["checks"]
    assert checks["master_weights_fp32"] == {"passed": True, "offenders": []}
    assert checks["unscaled_grads_fp32_finite"] == {"passed": True, "offenders": []}
    assert checks["activation_memory_lower"]["passed"] is None
    assert "not measurable on the CPU" in checks["activation_memory_lower"]["note"]


def test_a_planted_fp16_master_weight_is_caught_and_named(run_cfg, tmp_path, monkeypatch) -> None:
    import amp_exp.run

    real_build = amp_exp.run.build

    def build_with_fp16_bias(*args, **kwargs):
        built = real_build(*args, **kwargs)
        built.model.head.bias.data = built.model.head.bias.data.half()
        return built

    monkeypatch.setattr(amp_exp.run, "build", build_with_fp16_bias)
    # Under fp16 GradScaler itself refuses fp16 gradients; bf16 has no scaler to catch this.
    checks = train(run_cfg("precision=bf16", *TINY), tmp_path)["checks"]
    assert checks["master_weights_fp32"] == {"passed": False, "offenders": ["head.bias"]}
    assert checks["unscaled_grads_fp32_finite"]["offenders"] == ["head.bias"]


def test_custom_function_gets_fp32_inputs_only_with_the_amp_decorators() -> None:
    features = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half_input = torch.nn.functional.linear(features, torch.randn(8, 8))
        assert half_input.dtype == torch.bfloat16
        safe = l2_normalize_function("cpu", amp_safe=True).apply(half_input)
        unsafe = l2_normalize_function("cpu", amp_safe=False).apply(half_input)
    # Each function computes in the dtype it receives.
    assert safe.dtype == torch.float32
    assert unsafe.dtype == torch.bfloat16


def test_custom_function_gradient_is_correct() -> None:
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(l2_normalize_function("cpu").apply, (x,))


def test_model_with_the_custom_function_trains_in_fp16(run_cfg, tmp_path) -> None:
    summary = train(run_cfg("precision=fp16", "model.normalize_features=true", *TINY), tmp_path)
    assert summary["checks"]["unscaled_grads_fp32_finite"]["passed"]
    assert summary["final_loss"] is not None


def test_doctor_prints_findings_and_a_recommendation() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "amp_exp.doctor"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0].startswith("device: ")
    assert any(line.startswith("fp16: ") for line in lines)
    assert lines[-1].startswith("recommendation: precision=")


def test_activation_memory_is_compared_through_the_cuda_allocator(monkeypatch) -> None:
    from amp_exp.training.diagnostics import Diagnostics, forward_activation_bytes

    allocated = {"now": 1000, "peak": 1000}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: allocated.update(peak=1000)
    )

    def model(images: torch.Tensor) -> torch.Tensor:
        # What a forward keeps for backward: 4 bytes per element in fp32, 2 under autocast.
        allocated["peak"] += images.numel() * (2 if torch.is_autocast_enabled("cpu") else 4)
        return images

    images = torch.ones(8, 16)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    assert forward_activation_bytes(model, images, autocast, use_autocast=False) == 512
    assert forward_activation_bytes(model, images, autocast, use_autocast=True) == 256

    diagnostics = Diagnostics.__new__(Diagnostics)
    diagnostics.checks = {}
    diagnostics.activation_memory(lambda use_autocast: 256 if use_autocast else 512)
    assert diagnostics.checks["activation_memory_lower"] == {
        "passed": True,
        "fp32_bytes": 512,
        "autocast_bytes": 256,
    }
    diagnostics.activation_memory(lambda use_autocast: 600 if use_autocast else 512)
    assert diagnostics.checks["activation_memory_lower"]["passed"] is False
