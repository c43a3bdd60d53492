"""The roofline's GEMM efficiency by shape, the compiled run's fused casts, and the published
table it is checked against: held-out rows marked and kept out of what tunes the roofline, and the
error statistics computed as docs/hardware.md reports them."""

from __future__ import annotations

import copy
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from amp_exp.config.values import validate
from amp_exp.devices import PREDICTABLE
from amp_exp.predict.markdown import prediction_markdown
from amp_exp.predict.predict import predict_trace
from amp_exp.predict.published import (
    STATED_INTERVAL,
    Comparison,
    comparisons,
    coverage,
    error_summary,
    fitted_rows,
    interval_factor,
    published_rows,
)
from amp_exp.predict.roofline import (
    ATTENTION,
    ATTENTION_EFFICIENCY,
    LARGE_GEMM_EFFICIENCY,
    TWO_PASS,
    gemm_efficiency,
    op_bytes,
    op_cost,
    setting,
    traced_costs,
)
from amp_exp.predict.trace import trace_step
from helpers.runs import FAST_TRAINER, composed

REPO = Path(__file__).resolve().parent.parent
H100 = PREDICTABLE["h100"]
H100_SMS = H100.sms
HELD_OUT_ON = "2026-12-03"


def config(*overrides: str):
    return validate(copy.deepcopy(composed((*FAST_TRAINER, *overrides))))


@pytest.fixture(scope="module")
def tiny_cfg_trace():
    """gpt_tiny's step on an H100 and an A100, traced once for the module."""
    cfg = config("model=gpt_tiny", "dataset=synthetic_tokens", "predict.devices=[h100,a100]")
    return cfg, trace_step(cfg)


@pytest.fixture(scope="module")
def tiny_cnn_trace():
    """tiny_cnn's step at 8x8 images (3x3 convolutions, batch norms), traced once for the
    module."""
    cfg = config("model=tiny_cnn", "dataset=synthetic", "dataset.image_size=8")
    return cfg, trace_step(cfg)


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


def test_a_convolution_is_traced_as_its_implicit_gemm(tiny_cnn_trace) -> None:
    """tiny_cnn's 3x3 convolutions: M is every output pixel, N the output channels, K the input
    channels times 9 taps, so 2MNK is the forward's FLOPs. Caught: a convolution left without a
    shape (then costed at a large GEMM's efficiency), or K without the kernel's taps."""
    _, trace = tiny_cnn_trace
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


def test_fp8_is_predicted_compiled_as_auto_runs_it_and_its_casts_fuse(tiny_cfg_trace) -> None:
    """trainer.compile=auto compiles fp8 on CUDA, not bf16: fp8's quantization costs less than
    eagerly (one cast kernel per operand for both matmuls), bf16 is as eager. Caught: the casts
    priced as separate HBM round trips under compile, or bf16 compiled by auto."""
    lm = ["model=gpt_tiny", "dataset=synthetic_tokens", "optimizer=adamw"]
    _, trace = tiny_cfg_trace  # the optimizer is costed from the parameters, not traced
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


def test_the_interval_factor_is_the_order_statistic_of_the_rows_not_held_out() -> None:
    """Made-up comparisons: 4 rows not held out, predicted 1.1, 1/1.2, 1.3 and 1.4 times their
    figure, and a held-out one 3 times. At 80%, k = ceil(0.8 x 5) = 4: the largest |log| of the
    four, 1.4; at 50%, k = 3: 1.3. Coverage counts the figures inside [P / F, P x F]. Caught:
    held-out rows used to set the interval, a signed error (1/1.2 taken as below every other),
    or a quantile without the (n + 1) of a prediction interval."""

    def compared(ratio: float, held: bool) -> Comparison:
        return Comparison("r", "throughput", "bf16", 100.0, 100.0 * ratio, held)

    found = [compared(r, False) for r in (1.1, 1 / 1.2, 1.3, 1.4)] + [compared(3.0, True)]
    assert interval_factor(found, "throughput", 0.8) == pytest.approx(1.4)
    assert interval_factor(found, "throughput", 0.5) == pytest.approx(1.3)
    assert coverage(found, "throughput", 1.3, held=False) == (3, 4)
    assert coverage(found, "throughput", 1.3, held=True) == (0, 1)


def test_every_prediction_carries_its_stated_interval(tiny_cfg_trace) -> None:
    """predict.json states its uncertainty beside each figure: throughput and speedups each
    with [P / F, P x F] at the stated factors, and the rate they held. Caught: a bare figure
    presented without its interval, or the speedup's factor used for throughput."""
    cfg, trace = tiny_cfg_trace
    found = predict_trace(cfg, trace)
    assert found["interval_factors"] == STATED_INTERVAL
    fp8 = found["devices"]["h100"]["precisions"]["fp8"]
    low, high = fp8["interval"]["tokens_per_s"]
    factor = STATED_INTERVAL["throughput"]
    rate = fp8["tokens_per_s"]
    assert (low, high) == pytest.approx((rate / factor, rate * factor))
    low, high = fp8["interval"]["speedup_vs_bf16"]
    assert high / low == pytest.approx(STATED_INTERVAL["speedup"] ** 2)
    assert "predicted, not measured" in prediction_markdown(found)


def test_attention_runs_at_flash_attention_2s_share_of_each_devices_peak(tiny_cfg_trace) -> None:
    """FlashAttention-2 reaches about half an A100's peak and 35% of a Hopper's (it uses no
    wgmma): the same attention op costs a larger share of the H100's peak. Caught: a device
    without a figure (KeyError on a new device), or one efficiency for every device."""
    assert set(ATTENTION_EFFICIENCY) == set(PREDICTABLE)
    _, trace = tiny_cfg_trace
    attention = max((op for op in trace.ops if op.name in ATTENTION), key=lambda op: op.flops)
    big = replace(attention, flops=attention.flops * 1e6)  # compute-bound, past the launch
    seconds = {
        key: op_cost(big, 0, PREDICTABLE[key].tflops["bf16"], PREDICTABLE[key]).seconds
        for key in ("a100", "h100")
    }
    for key, spent in seconds.items():
        peak = PREDICTABLE[key].tflops["bf16"] * 1e12
        assert big.flops / peak / spent == pytest.approx(ATTENTION_EFFICIENCY[key], rel=1e-3)


def test_batch_norm_reads_its_inputs_twice_and_starts_a_fused_kernel(tiny_cnn_trace) -> None:
    """Training batch norm needs the batch's statistics before it normalises any element: its
    forward and backward read their inputs twice, and compiled, it cannot join the kernel of the
    op before it. Caught: batch norm costed as a one-pass elementwise op (ResNet-50's batch
    norms are a fifth of its fp16 step)."""
    cfg, trace = tiny_cnn_trace
    run = setting(cfg, trace, "fp32")
    norms = [op for op in trace.ops if op.name in TWO_PASS]
    assert {op.name for op in norms} == TWO_PASS
    for op in norms:
        assert op_bytes(op, run) == (2 * 4 * op.read, 4 * op.written)
    relu = next(op for op in trace.ops if op.name == "relu_")
    assert op_bytes(relu, run) == (4 * relu.read, 4 * relu.written)
    compiled = copy.deepcopy(cfg)
    compiled.trainer.compile = True
    starts = [c.name for c in traced_costs(trace, setting(compiled, trace, "fp32"), H100)]
    assert any(name.startswith("fused from native_batch_norm ") for name in starts)


@pytest.fixture(scope="module")
def check_script():
    """scripts/check_published.py as a module: its check and report, called in this process."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "scripts"))
        import check_published
    return check_published


@pytest.fixture(scope="module")
def fitted_checked(check_script):
    """Every row not held out, predicted once for the module as the script predicts it: the
    rows the stated interval is derived from, and every row with a band."""
    return check_script.check(fitted_rows(published_rows()))


@pytest.mark.slow
def test_the_stated_interval_is_the_one_the_rows_not_held_out_give(fitted_checked) -> None:
    """The interval factor the script derives from the rows not held out (its 80% order
    statistic) is the one predict states, and every such row is predicted. Caught:
    STATED_INTERVAL left behind when the roofline or a row changes, or a row that no longer
    traces (then left out of the factor unseen)."""
    assert not fitted_checked.failed
    for kind, stated in STATED_INTERVAL.items():
        assert interval_factor(fitted_checked.found, kind) == pytest.approx(stated, abs=0.005)


@pytest.mark.slow
@pytest.mark.parametrize(
    "anchor",
    [row for row in published_rows() if "band" in row],
    ids=lambda anchor: anchor["name"],
)
def test_predictions_stay_inside_the_published_bands(fitted_checked, anchor) -> None:
    """Each published speedup of published.json with a margin, predicted from its setting
    (Llama-3 8B and 70B traced whole, on the meta device). Caught: any change to the roofline,
    the trace or the device table that moves a prediction out of the band its data file
    states."""
    (found,) = [c for c in fitted_checked.found if c.row == anchor["name"] and c.kind == "speedup"]
    low, high = anchor["band"]
    assert low <= found.predicted <= high, (anchor["name"], found.predicted, anchor["band"])


def test_the_check_scripts_summary_is_the_one_its_table_gives(
    check_script, tmp_path, monkeypatch, capsys
) -> None:
    """scripts/check_published.py's main on two made-up rows of one gpt_tiny setting, one held
    out and naming fp8's rowwise recipe: each median and worst error of the printed summary is
    the one its printed per-figure table gives, and the setting is traced once for both rows
    and all their precisions. Caught: a summary that drifts from the table (docs/hardware.md
    quotes both), or a trace per row or precision where one setting serves them all."""
    tiny = ["model=gpt_tiny", "dataset=synthetic_tokens", "optimizer=adamw"]
    made_up = {
        "rows": [
            {"name": "tiny", "device": "h100", "per_s": "tokens_per_s", "baseline": "bf16",
             "precision": "fp8", "measured": {"bf16": 1.5e6, "fp8": 1.2e6}, "overrides": tiny},
            {"name": "tiny_rowwise", "device": "h100", "per_s": "tokens_per_s",
             "baseline": "bf16", "precision": "fp8", "measured": {"bf16": 2e6, "fp8": 2.5e6},
             "overrides": [*tiny, "precision=fp8", "precision.options.recipe=rowwise"],
             "held_out": HELD_OUT_ON},
        ]
    }  # fmt: skip
    path = tmp_path / "published.json"
    path.write_text(json.dumps(made_up))
    monkeypatch.setattr(check_script, "published_rows", lambda: published_rows(path))
    check_script.main([])
    lines = capsys.readouterr().out.splitlines()
    figures = [line.split(" | ") for line in lines if line.count(" | ") == 5]
    figures = [cells for cells in figures if cells[1] in {"yes", "no"}]
    assert len(figures) == 6  # two throughputs and a speedup per row
    errors: dict[tuple[str, bool], list[float]] = {}
    for cells in figures:
        kind = cells[2].split()[0]
        errors.setdefault((kind, cells[1] == "yes"), []).append(abs(percent(cells[5])))
    kinds = ("| throughput |", "| speedup |")
    summary = [line.split(" | ") for line in lines if line.startswith(kinds)]
    summary = [cells for cells in summary if cells[1] in {"held out", "not held out"}]
    assert len(summary) == len(errors) == 4
    for cells in summary:
        found = errors[cells[0][2:], cells[1] == "held out"]
        assert int(cells[2]) == len(found)
        assert abs(percent(cells[3]) - statistics.median(found)) <= 1  # rounded percents
        assert percent(cells[4]) == max(found)
    assert lines[-1].startswith("1 settings traced in ")


def percent(cell: str) -> int:
    """A table cell such as "+13%" or "55% |" as 13 or 55."""
    return int(cell.rstrip(" |").rstrip("%"))
