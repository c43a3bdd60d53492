"""fp8's recipes in the roofline: which of a converted linear's three GEMMs run in fp8, what each
recipe's scaling costs, and that the recipe changes the prediction (docs/hardware.md)."""

from __future__ import annotations

import copy

import pytest

from amp_exp.config.values import validate
from amp_exp.devices import PREDICTABLE
from amp_exp.predict.predict import predict_trace
from amp_exp.predict.roofline import (
    KERNEL_OVERHEAD_S,
    MEMORY_EFFICIENCY,
    Setting,
    gemm_role,
    in_fp8,
    op_bytes,
    op_cost,
    quantize_cost,
    setting,
    traced_costs,
)
from amp_exp.predict.trace import Op, trace_step
from amp_exp.training.precisions.fp8 import Fp8Recipe
from helpers.runs import FAST_TRAINER, composed

H100 = PREDICTABLE["h100"]
# Two layers at Llama-3 8B's widths, seq 1024: GEMMs large enough that fp8's peak shows.
WIDE = [
    "model=hf",
    "model.name=llama",
    "+model.config.hidden_size=4096",
    "+model.config.intermediate_size=14336",
    "+model.config.num_hidden_layers=2",
    "+model.config.num_attention_heads=32",
    "+model.config.num_key_value_heads=8",
    "+model.config.vocab_size=128256",
    "+model.config.max_position_embeddings=1024",
    "dataset=synthetic_tokens",
    "dataset.seq_len=1024",
    "dataset.batch_size=2",
    "optimizer=adamw",
    "trainer.compile=true",
    "predict.devices=[h100]",
]


def config(*overrides: str):
    return validate(copy.deepcopy(composed((*FAST_TRAINER, *overrides))))


@pytest.fixture(scope="module")
def wide():
    cfg = config(*WIDE)
    return cfg, trace_step(cfg)


def with_recipe(cfg, recipe: str):
    cfg = copy.deepcopy(cfg)
    cfg.precision.name = "fp8"
    cfg.precision.options = {"recipe": recipe}
    return cfg


def runs(cfg, trace, recipe: str) -> Setting:
    return setting(with_recipe(cfg, recipe), trace, "fp8")


def test_a_linears_three_gemms_are_told_apart_by_shape() -> None:
    """A linear of M = 2048 tokens, N = 512 outputs, K = 256 inputs: its input gradient is
    2048 x 256 deep 512, its weight gradient 512 x 256 (or 256 x 512) deep 2048, and its
    forward recomputed in the backward (activation checkpointing) is still the output. Caught:
    the weight gradient taken for the input gradient (then gw_hp's bf16 GEMM is the wrong one)."""
    forward = (2048, 512, 256)

    def op(phase: str, mnk: tuple[int, int, int]) -> Op:
        return Op("mm", phase, 2.0 * mnk[0] * mnk[1] * mnk[2], 0, 0, mnk, "fc")

    assert gemm_role(op("forward", forward), forward) == "output"
    assert gemm_role(op("backward", forward), forward) == "output"
    assert gemm_role(op("backward", (2048, 256, 512)), forward) == "grad_input"
    assert gemm_role(op("backward", (512, 256, 2048)), forward) == "grad_weight"
    assert gemm_role(op("backward", (256, 512, 2048)), forward) == "grad_weight"


def test_rowwise_with_gw_hp_costs_its_weight_gradient_gemm_in_bf16(wide) -> None:
    """torchao's rowwise_with_gw_hp computes grad_weight in the high precision: exactly one
    GEMM per converted linear (the one reducing over the tokens) leaves fp8, and it is costed at
    the bf16 peak with 2-byte operands; under rowwise and tensorwise all three stay fp8. Caught:
    the weight gradient costed as fp8 (as rowwise), or the wrong GEMM moved to bf16."""
    cfg, trace = wide
    gw_hp, rowwise = runs(cfg, trace, "rowwise_with_gw_hp"), runs(cfg, trace, "rowwise")
    converted = [op for op in trace.ops if op.linear in gw_hp.fp8_linears]
    high = [op for op in converted if not in_fp8(op, gw_hp)]
    assert len(high) == len(gw_hp.fp8_linears)
    for op in high:
        assert op.phase == "backward"
        assert op.mnk[2] == gw_hp.linear_shapes[op.linear][0]  # deep in the tokens
    assert all(in_fp8(op, rowwise) for op in converted)
    bf16 = op_cost(high[0], sum(x * 2 for x in (high[0].read, high[0].written)), 989, H100)
    fp8 = op_cost(high[0], high[0].read + 2 * high[0].written, 1979, H100)
    assert bf16.seconds > 1.5 * fp8.seconds
    costs = [c for c in traced_costs(trace, gw_hp, H100) if c.name == bf16.name]
    assert costs and all(c.seconds == pytest.approx(bf16.seconds) for c in costs)


def test_each_recipe_changes_the_prediction_in_torchaos_order(wide) -> None:
    """At Llama-3 8B's widths: tensorwise fastest, rowwise slower (twice the amax passes and the
    backward's rescale), rowwise_with_gw_hp's scaling cheaper than rowwise's (X and dY cast
    once) but its step slower than tensorwise's (a bf16 GEMM). Caught: precision.options.recipe
    ignored, or gw_hp's casts costed as rowwise's."""
    cfg, trace = wide
    steps = {}
    for recipe in Fp8Recipe:
        found = predict_trace(with_recipe(cfg, recipe.value), trace)["devices"]["h100"]
        steps[recipe.value] = found["precisions"]["fp8"]["step_time_s"]
    assert steps["tensorwise"] < steps["rowwise"]
    assert steps["tensorwise"] < steps["rowwise_with_gw_hp"]
    quantize = {r: quantize_cost(trace, runs(cfg, trace, r), H100, Fp8Recipe(r)) for r in steps}
    assert quantize["rowwise_with_gw_hp"].seconds < quantize["rowwise"].seconds
    assert quantize["tensorwise"].seconds < quantize["rowwise"].seconds


def test_a_4_bit_format_moves_half_of_fp8s_bytes_per_operand(wide) -> None:
    """NVFP4's elements are half a byte: a converted GEMM reads half the operand bytes fp8's
    does, and each cast writes half as much (its output stays bf16 in both). Caught: every
    converted format costed with 1-byte operands (fp4's memory-bound GEMMs and casts at fp8's
    cost)."""
    cfg, trace = wide
    fp8, fp4 = setting(cfg, trace, "fp8"), setting(cfg, trace, "nvfp4")
    assert (fp8.element_bytes, fp4.element_bytes) == (1, 0.5)
    gemm = next(op for op in trace.ops if op.linear in fp4.fp8_linears)
    assert op_bytes(gemm, fp4) == (gemm.read / 2, op_bytes(gemm, fp8)[1])
    assert op_bytes(gemm, fp8) == (gemm.read, 2 * gemm.written)
    tensorwise = Fp8Recipe.tensorwise
    assert (
        quantize_cost(trace, fp4, H100, tensorwise).seconds
        < quantize_cost(trace, fp8, H100, tensorwise).seconds
    )


def test_a_block_scaled_format_casts_twice_without_an_amax_pass_whatever_the_recipe(wide) -> None:
    """MXFP8 scales each 32-element block from its own amax inside the cast, along each GEMM's
    reduction axis: two casts per operand, each reading it (compiled too, as torchao's roofline
    takes them), no amax pass, and fp8_recipe (torchao float8's) does not apply. Caught: MXFP8
    costed with tensorwise fp8's amax pass and fused casts, or moved by fp8's recipe."""
    cfg, trace = wide
    mx = setting(cfg, trace, "mxfp8")
    assert mx.block_scaled and mx.compiled
    by_recipe = {quantize_cost(trace, mx, H100, recipe).seconds for recipe in Fp8Recipe}
    assert len(by_recipe) == 1
    eager = copy.deepcopy(cfg)
    eager.trainer.compile = False
    uncompiled = quantize_cost(trace, setting(eager, trace, "mxfp8"), H100, Fp8Recipe.tensorwise)
    assert uncompiled.seconds == pytest.approx(by_recipe.pop())
    # X, W and dY each read twice (in bf16, bf16 and from the fp32 master) and written twice.
    elements = sum(m * k + m * n for m, n, k in mx.linear_shapes.values())
    weights = sum(n * k for m, n, k in mx.linear_shapes.values())
    nbytes = elements * (2 * 2 + 2) + weights * (2 * 4 + 2)
    kernels = 6 * len(mx.linear_shapes)
    expected = nbytes / (H100.hbm_tb_per_s * 1e12 * MEMORY_EFFICIENCY) + kernels * KERNEL_OVERHEAD_S
    assert quantize_cost(trace, mx, H100, Fp8Recipe.rowwise).seconds == pytest.approx(expected)
