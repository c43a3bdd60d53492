"""The probe measures each precision's kernels, and its cache spares later runs the measurement."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest
import torch

import amp_exp.capability.probe
from amp_exp.capability.cache import cache_dir, read_entries
from amp_exp.capability.device import Capability, capability_of, kernels_of
from amp_exp.capability.probe import (
    CACHE_FILE,
    KERNELS,
    KernelTime,
    Shapes,
    cache_key,
    measure,
    probe,
    remember,
)
from amp_exp.config.values import validate
from amp_exp.run import build
from helpers.probes import timing_at
from helpers.runs import FAST, FAST_LM, TINY

CPU = torch.device("cpu")
TINY_SHAPES = Shapes(matmul=16, conv=(1, 4, 4), attention=(1, 4, 8, 2))


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "amp_exp"


def test_measure_times_every_kernel_forward_and_backward_in_each_precision() -> None:
    timings = measure(CPU, ["fp32", "bf16"], shapes=TINY_SHAPES, budget_s=0.001, max_rounds=3)
    assert set(timings) == {"fp32", "bf16"}
    for timing in timings.values():
        assert set(timing) == set(KERNELS)
        assert all(0 < k.ms < 1000 and math.isfinite(k.tflops) for k in timing.values())
    # 16^3 multiply-adds forward, twice that backward.
    matmul = timings["fp32"]["matmul"]
    assert matmul.tflops == pytest.approx(6 * 16**3 / (matmul.ms / 1e3) / 1e12)


def test_measure_leaves_the_global_random_streams_alone() -> None:
    before = torch.get_rng_state()
    measure(CPU, ["fp32"], shapes=TINY_SHAPES, budget_s=0.001, max_rounds=2)
    assert torch.equal(torch.get_rng_state(), before)


def spread_out(timing: dict[str, KernelTime], spread: float) -> dict[str, KernelTime]:
    return {name: dataclasses.replace(k, spread=spread) for name, k in timing.items()}


def test_probe_measures_all_precisions_together_when_the_cache_lacks_one_or_spreads_wide(
    own_cache, monkeypatch, caplog
) -> None:
    """A speed is a ratio to fp32's time in the same rounds: a precision the cache lacks is
    measured with fp32 beside it, and so is a cache whose figure lies 25% from its typical
    round, once: the second measurement is kept however wide (each costs 17 s here)."""
    measured = []

    def fake_measure(device, precisions):
        measured.append(list(precisions))
        return {p: spread_out(timing_at(0.5), 0.3) for p in precisions}

    monkeypatch.setattr(amp_exp.capability.probe, "measure", fake_measure)
    remember(CPU, {"fp32": timing_at(1.0)})
    timings = probe(CPU, ["fp32", "bf16"])
    assert measured == [["fp32", "bf16"]] and timings["bf16"]["conv"].spread == 0.3
    with caplog.at_level(logging.INFO, logger="amp_exp"):
        probe(CPU, ["fp32", "bf16"])
    assert measured == [["fp32", "bf16"]] * 2
    assert "lie 30% from their typical round, more than 25%; measuring again" in caplog.text
    assert probe(CPU, ["fp32", "bf16"])["bf16"]["conv"].spread == 0.3  # kept: measured again
    assert len(measured) == 2
    remember(CPU, {p: spread_out(timing_at(0.5), 0.1) for p in ("fp32", "bf16")})
    probe(CPU, ["fp32", "bf16"])  # within 25%: reused
    assert len(measured) == 2
    probe(CPU, ["fp32", "bf16"], refresh=True)
    assert len(measured) == 3


def test_the_spread_is_how_far_the_figure_lies_from_its_typical_round(monkeypatch) -> None:
    """Rounds of 1, 2 and 2 ms for fp32 and of 2, 2 and 2 ms for bf16: the fastest rounds say
    0.5x, the typical round 1x, so the figure lies 100% off, though bf16's own rounds agree."""
    times = iter([9, 9, 1e-3, 2e-3, 2e-3, 2e-3, 2e-3, 2e-3])  # the first round is not kept

    def one_pass(device, precision, forward, leaves):
        return next(times)

    monkeypatch.setattr(amp_exp.capability.probe, "_forward_backward", one_pass)
    monkeypatch.setattr(
        amp_exp.capability.probe, "_kernels", lambda shapes, device: {"matmul": (None, (), 1.0)}
    )
    timings = measure(CPU, ["fp32", "bf16"], budget_s=0, min_rounds=4, max_rounds=4)
    assert timings["bf16"]["matmul"].spread == pytest.approx(1.0)
    assert timings["fp32"]["matmul"].spread == 0 and timings["fp32"]["matmul"].ms == 1.0


def test_cache_entries_are_per_device_torch_version_and_precision(own_cache) -> None:
    remember(CPU, {"fp32": timing_at(1.0), "fp16": timing_at(0.1)})
    assert cache_dir() == own_cache
    keys = set(read_entries(CACHE_FILE))
    assert keys == {cache_key(CPU, "fp32"), cache_key(CPU, "fp16")}
    assert all(f"torch {torch.__version__}" in key for key in keys)


def test_an_unreadable_cache_is_measured_again(own_cache, monkeypatch) -> None:
    own_cache.mkdir(parents=True)
    (own_cache / CACHE_FILE).write_text("{not json")
    monkeypatch.setattr(
        amp_exp.capability.probe, "measure", lambda device, ps: {p: timing_at(1.0) for p in ps}
    )
    assert set(probe(CPU, ["fp32"])) == {"fp32"}
    assert cache_key(CPU, "fp32") in read_entries(CACHE_FILE)


def test_a_gpu_without_native_bf16_is_probed_in_fp32_and_fp16_only(own_cache, monkeypatch) -> None:
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    remember(gpu, {"fp32": timing_at(1.0), "fp16": timing_at(4.0)})
    capability = capability_of(gpu)  # from the cache: nothing runs on the (absent) GPU
    assert list(capability.measured) == ["fp32", "fp16"]
    assert capability.facts == {
        "compute_capability": "7.5",
        "tensor_cores": True,
        "native_bf16": False,
    }
    assert capability.trial_candidates() == ["fp32", "fp16"]


def test_fp32_on_a_gpu_is_cached_apart_with_and_without_tf32(monkeypatch) -> None:
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert cache_key(gpu, "fp32") == f"NVIDIA H200 | torch {torch.__version__} | fp32+tf32"
        torch.backends.cuda.matmul.allow_tf32 = False
        assert cache_key(gpu, "fp32").endswith(" | fp32")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize(
    ("kernel", "ms", "why"),
    [
        ("matmul", 0, "matmul: fp16 took 0 ms"),
        ("conv", -1, "conv: fp16 took -1 ms"),
        ("attention", float("nan"), "attention: fp16 took nan ms"),
        # The doctor's "625525164x": faster than any kernel can be timed.
        ("matmul", 1e-9, "matmul: fp16 took 1e-09 ms"),
        # A time of its own, but 5000 times fp32's 1 ms.
        ("matmul", 5000.0, "matmul: fp16 took 5e+03x fp32's time"),
        ("conv", "fast", "conv: fp16 took 'fast' ms"),
    ],
)
def test_cached_timings_that_cannot_be_measurements_are_measured_again(
    own_cache, monkeypatch, caplog, kernel, ms, why
) -> None:
    measured = []

    def fake_measure(device, precisions):
        measured.append(list(precisions))
        return {p: timing_at(0.5) for p in precisions}

    monkeypatch.setattr(amp_exp.capability.probe, "measure", fake_measure)
    precisions = ["fp32", "bf16", "fp16"]
    remember(CPU, {p: timing_at(1.0) for p in precisions})
    entries = read_entries(CACHE_FILE)
    entries[cache_key(CPU, "fp16")]["kernels"][kernel]["ms"] = ms
    (own_cache / CACHE_FILE).write_text(json.dumps(entries))
    with caplog.at_level(logging.WARNING):
        timings = probe(CPU, precisions)
    assert measured == [precisions]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        f"{own_cache / CACHE_FILE} holds timings that are no measurement ({why}); measuring again"
    )
    assert timings["fp16"] == timing_at(0.5)
    # What the doctor and precision=auto then read is a measurement again, from the cache.
    assert capability_of(CPU).relative_speed("fp16") == pytest.approx(1.0)
    assert measured == [precisions]


@pytest.mark.parametrize(
    ("overrides", "kernels"),
    [
        ((*FAST, *TINY), ("conv",)),
        ((*FAST, "model=mlp"), ("matmul",)),
        (FAST_LM, ("matmul", "attention")),
    ],
)
def test_a_model_is_judged_by_the_probes_kernels_of_its_own_kind(
    compose_cfg, overrides, kernels
) -> None:
    """A GPT judged by the probe's convolution was told fp16 ran 6.62x slower than fp32; its own
    trial measured 1.6x. Here the convolution is 10x slower in fp16 and the matmul and the
    attention block no slower: only the CNN is warned."""
    built = build(validate(compose_cfg(*overrides, fast=False)))
    assert kernels_of(built.model) == kernels == tuple(built.hardware["advice_kernels"])
    measured = {
        "fp32": timing_at(1.0),
        "fp16": {**timing_at(1.0), "conv": KernelTime(ms=10.0, tflops=0.1)},
    }
    capability = Capability("cpu", "test cpu", {}, measured, key="test cpu")
    advice = capability.advice("fp16", kernels, {})
    assert advice == (
        ["the probe's conv kernels ran fp16 about 10x slower than fp32 here: use precision=fp32"]
        if kernels == ("conv",)
        else []
    )
