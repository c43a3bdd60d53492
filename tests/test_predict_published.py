"""The roofline's GEMM efficiency by shape, the compiled run's fused casts, and the published
table it is checked against: held-out rows marked and kept out of what tunes the roofline, and the
error statistics computed as docs/hardware.md reports them."""

from __future__ import annotations

import copy
import json
import math

import pytest

from amp_exp.config.values import validate
from amp_exp.predict.devices import PREDICTABLE
from amp_exp.predict.predict import predict_trace
from amp_exp.predict.published import (
    comparisons,
    error_summary,
    fitted_rows,
    published_rows,
)
from amp_exp.predict.roofline import LARGE_GEMM_EFFICIENCY, gemm_efficiency
from amp_exp.predict.trace import trace_step
from helpers.runs import FAST_TRAINER, composed

H100_SMS = PREDICTABLE["h100"].sms
HELD_OUT_ON = "2026-12-03"


def config(*overrides: str):
    return validate(copy.deepcopy(composed((*FAST_TRAINER, *overrides))))


def test_small_and_skinny_gemms_reach_less_of_the_peak_than_large_ones() -> None:
    """Caught: one efficiency for every shape (a 256-cube GEMM, one wave of 4 tiles on 132 SMs,
    costed like an 8192-cube), or a K of 64 (a ResNet 1x1 convolution's) costed like a K of
    4096."""
    large = gemm_efficiency(8192, 8192, 8192, H100_SMS)
    assert 0.6 < large <= LARGE_GEMM_EFFICIENCY
    assert gemm_efficiency(256, 256, 256, H100_SMS) < large / 5
    assert gemm_efficiency(65536, 64, 64, H100_SMS) < 0.6 * large
    # A skinny output with a long K (a weight gradient of a narrow layer) splits K across idle
    # SMs: better than one wave of its own 36 tiles, still short of a large GEMM.
    split = gemm_efficiency(768, 768, 65536, H100_SMS)
    assert 36 / H100_SMS * LARGE_GEMM_EFFICIENCY < split < large


def test_the_efficiency_grows_with_k_and_with_the_size_of_a_square_gemm() -> None:
    """Monotone where it should be: a deeper K never lowers it (the main loop's fill weighs
    less), nor does doubling every side of a square GEMM (more tiles fill the waves). Caught: a
    fill term that grows with K, or an occupancy that counts tiles per wave the wrong way round.
    (Between two sizes it is not monotone: 133 tiles take two waves where 132 take one.)"""
    along_k = [gemm_efficiency(4096, 4096, k, H100_SMS) for k in (64, 128, 512, 4096, 16384)]
    assert along_k == sorted(along_k) and along_k[0] < along_k[-1]
    squares = [gemm_efficiency(n, n, n, H100_SMS) for n in (128, 256, 512, 1024, 2048, 8192)]
    assert squares == sorted(squares) and squares[0] < 0.05 < 0.6 < squares[-1]


def test_a_convolution_is_traced_as_its_implicit_gemm() -> None:
    """tiny_cnn's 3x3 convolutions: M is every output pixel, N the output channels, K the input
    channels times 9 taps, so 2MNK is the forward's FLOPs. Caught: a convolution left without a
    shape (then costed at a large GEMM's efficiency), or K without the kernel's taps."""
    trace = trace_step(config("model=tiny_cnn", "dataset=synthetic", "dataset.image_size=8"))
    forward = [op for op in trace.ops if op.name == "convolution"]
    backward = [op for op in trace.ops if op.name == "convolution_backward"]
    assert forward and backward
    for op in forward:
        m, n, k = op.mnk
        assert 2 * m * n * k == op.flops
        assert k % 9 == 0
    assert all(op.mnk for op in backward)


def test_a_depthwise_convolution_backward_counts_its_own_flops() -> None:
    """MobileNet-V3's depthwise convolutions: each gradient is one GEMM of the forward's shape
    (2MNK FLOPs), not torch's formula's ungrouped count (C times as many, which put EfficientNet
    on an A100 at a fifth of its published speed). Caught: the formula's count kept."""
    trace = trace_step(
        config(
            "model=torchvision",
            "model.name=mobilenet_v3_small",
            "dataset=synthetic",
            "dataset.image_size=32",
            "dataset.batch_size=4",
        )
    )
    backward = [op for op in trace.ops if op.name == "convolution_backward"]
    assert any(op.mnk[1] == 1 for op in backward)  # a depthwise one: one channel per group
    for op in backward:
        assert op.flops in {2 * math.prod(op.mnk), 4 * math.prod(op.mnk)}, op


def test_fp8_is_predicted_compiled_as_auto_runs_it_and_its_casts_fuse() -> None:
    """trainer.compile=auto compiles fp8 on CUDA, not bf16: fp8's quantization costs less than
    eagerly (one cast kernel per operand for both matmuls), bf16 is as eager. Caught: the casts
    priced as separate HBM round trips under compile, or bf16 compiled by auto."""
    lm = ["model=gpt_tiny", "dataset=synthetic_tokens", "optimizer=adamw"]
    trace = trace_step(config(*lm))
    auto = predict_trace(config(*lm), trace)["devices"]["h100"]["precisions"]
    eager = predict_trace(config(*lm, "trainer.compile=false"), trace)["devices"]["h100"]
    eager = eager["precisions"]
    assert auto["fp8"]["casts_s"] < eager["fp8"]["casts_s"]
    assert auto["bf16"]["step_time_s"] == eager["bf16"]["step_time_s"]
    compiled = predict_trace(config(*lm, "trainer.compile=true"), trace)["devices"]["h100"]
    assert compiled["precisions"]["bf16"]["step_time_s"] < auto["bf16"]["step_time_s"]


def test_held_out_rows_are_dated_a_third_of_the_table_and_outside_every_band() -> None:
    """The held-out rows were set aside on one date, before the roofline changed, and are at
    least a third of the table; the only figures the code is held to (the speedup bands of
    tests/test_predict.py) and the rows a change may be tuned on exclude them. Caught: a row
    silently un-held, a held-out row given a band, or fitted_rows letting one through."""
    rows = published_rows()
    held = [row for row in rows if "held_out" in row]
    assert {row["held_out"] for row in held} == {HELD_OUT_ON}
    assert 3 * len(held) >= len(rows)
    assert not [row["name"] for row in held if "margin" in row]
    assert not [row for row in fitted_rows(rows) if "held_out" in row]
    assert len(fitted_rows(rows)) == len(rows) - len(held)


def test_every_row_names_its_source_and_the_llama_8b_anchor_its_batch_of_2() -> None:
    """Caught: a figure without a source, or the torchtitan anchor back at batch 1 (its
    table 1: local batch 2)."""
    rows = {row["name"]: row for row in published_rows()}
    for row in rows.values():
        assert row["source"].startswith("https://"), row["name"]
        assert row.get("measured") or row.get("published")
    assert "dataset.batch_size=2" in rows["llama3_8b_torchtitan"]["overrides"]
    assert rows["llama3_8b_torchtitan"]["published"] == pytest.approx(8532 / 6667)


def test_errors_are_summarised_by_kind_with_the_held_out_rows_apart(tmp_path) -> None:
    """Made-up rows with known errors: throughput and speedups apart, held-out rows apart, the
    median and the worst of the absolute relative errors. Caught: the held-out rows mixed into
    the others' figures, a signed median (errors of both signs cancelling), or a speedup taken
    the wrong way round."""
    made_up = {
        "rows": [
            {"name": "a", "baseline": "bf16", "precision": "fp8", "device": "h100",
             "measured": {"bf16": 100.0, "fp8": 150.0}},
            {"name": "b", "baseline": "bf16", "precision": "fp8", "device": "h100",
             "measured": {"bf16": 200.0, "fp8": 200.0}},
            {"name": "c", "baseline": "fp32", "precision": "fp16", "device": "a100",
             "measured": {"fp32": 10.0, "fp16": 30.0}, "held_out": HELD_OUT_ON},
        ]
    }  # fmt: skip
    path = tmp_path / "published.json"
    path.write_text(json.dumps(made_up))
    rows = {row["name"]: row for row in published_rows(path)}
    assert rows["a"]["published"] == 1.5
    found = [
        *comparisons(rows["a"], {"bf16": 110.0, "fp8": 135.0}),  # +10%, -10%; speedup 1.227
        *comparisons(rows["b"], {"bf16": 140.0, "fp8": 280.0}),  # -30%, +40%; speedup 2.0
        *comparisons(rows["c"], {"fp32": 10.0, "fp16": 20.0}),  # 0%, -33%; speedup 2.0
    ]
    summary = error_summary(found)
    throughput = summary["throughput", False]
    assert throughput["n"] == 4
    assert throughput["median"] == pytest.approx((0.1 + 0.3) / 2)
    assert throughput["worst"] == pytest.approx(0.4)
    speedups = summary["speedup", False]
    assert speedups["median"] == pytest.approx((1 - 135 / 110 / 1.5 + 1.0) / 2)
    assert speedups["worst"] == pytest.approx(1.0)
    assert summary["throughput", True] == {
        "n": 2,
        "median": pytest.approx(1 / 6),
        "worst": pytest.approx(1 / 3),
    }
    assert summary["speedup", True]["median"] == pytest.approx(1 / 3)
    signed = [c.error for c in found if c.row == "c" and c.kind == "speedup"]
    assert signed == [pytest.approx(2 / 3 - 1)]
