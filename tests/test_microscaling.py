"""The block-scaled formats' numerics (training/microscaling): torchao's casts, NVFP4's tiles,
stochastic rounding and Hadamard transform, and the emulated linear's three matmuls."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchao.prototype.mx_formats.config import ScaleCalculationMode

from amp_exp.config.precisions import DType
from amp_exp.config.schema import PrecisionConfig
from amp_exp.training.audit.matmuls import MatmulRecorder
from amp_exp.training.linears import replacement
from amp_exp.training.microscaling.formats import (
    hadamard_rotation,
    quantized,
    rotate_rows,
    round_e2m1_stochastically,
)
from amp_exp.training.microscaling.linear import MicroscalingLinear, Recipe
from amp_exp.training.precisions.base import create

F = DType
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def sqnr(reference: torch.Tensor, approximate: torch.Tensor) -> float:
    noise = (reference - approximate).pow(2).sum()
    return (10 * torch.log10(reference.pow(2).sum() / noise)).item()


def normal(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# torchao 0.18 on a 256x512 normal tensor (issue 33), with the OCP spec's floor scales. Each
# block size next to the right one moves these by 0.15 dB or more (e4m3 in 16-blocks: 30.0), and
# a missing cast would give inf: a 0.1 dB tolerance catches both.
@pytest.mark.parametrize(
    ("fmt", "expected_db"),
    [(F.mxfp8_e4m3, 30.6), (F.mxfp8_e5m2, 25.4), (F.mxfp4, 18.8), (F.nvfp4, 20.4)],
)
def test_each_format_loses_what_torchao_measured(fmt: DType, expected_db: float) -> None:
    x = normal(256, 512)
    assert sqnr(x, quantized(x, fmt, ScaleCalculationMode.FLOOR)) == pytest.approx(
        expected_db, abs=0.1
    )


@pytest.mark.parametrize("fmt", [d for d in F if d.block_scaled])
def test_a_non_finite_value_stays_non_finite(fmt: DType) -> None:
    """A NaN or inf gradient must reach the engine's skip check, not be rounded to a number."""
    for bad in (float("nan"), float("inf")):
        x = normal(64, 64)
        x[5, 7] = bad
        assert not quantized(x, fmt).isfinite().all()


def test_a_width_off_the_block_is_padded_not_refused() -> None:
    x = normal(3, 5, 40)
    q = quantized(x, F.mxfp4)
    assert q.shape == x.shape
    # The last 8 columns make a block of their own: quantized, not left exact or zeroed.
    assert 0 < (q - x)[..., 32:].abs().max() < x[..., 32:].abs().max()


def test_nvfp4_tiles_take_torchaos_scale_of_each_tile_and_transpose_alike() -> None:
    x = normal(64, 96)
    # Where every 16-element block of a tile holds the tile's maximum, a tile's scale is each of
    # its blocks' scale: tiles must give torchao's own cast, bit for bit.
    x[:, ::16] = x.abs().reshape(4, 16, 6, 16).amax(dim=(1, 3)).repeat_interleave(16, 0)
    assert torch.equal(quantized(x, F.nvfp4, tiles=True), quantized(x, F.nvfp4))
    w = normal(48, 80, seed=1)
    tiled = quantized(w, F.nvfp4, tiles=True)
    # The point of tiles: the transpose quantizes to the same values (blocks along rows do not).
    assert torch.equal(quantized(w.t(), F.nvfp4, tiles=True), tiled.t())
    assert not torch.equal(quantized(w.t(), F.nvfp4).t(), quantized(w, F.nvfp4))


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour() -> None:
    torch.manual_seed(0)
    values = torch.tensor([0.2, 1.1, -1.9, 2.25, 3.7, -5.0, 4.0, 0.0])
    draws = round_e2m1_stochastically(values.repeat(40_000, 1))
    assert set(draws.abs().unique().tolist()) <= set(E2M1_VALUES)
    # Each value's two neighbours, and the variance of a choice between them.
    grid = torch.tensor(E2M1_VALUES)
    upper = torch.searchsorted(grid, values.abs())
    gap = grid[upper] - grid[(upper - 1).clamp(min=0)]
    p = (values.abs() - grid[(upper - 1).clamp(min=0)]) / gap.clamp(min=1e-9)
    stderr = gap * (p * (1 - p) / draws.shape[0]).sqrt()
    assert ((draws.mean(0) - values).abs() <= 4 * stderr + 1e-7).all()
    # A value on the grid is left alone; one off it is rounded both ways.
    assert (draws[:, 6] == 4.0).all() and (draws[:, 7] == 0.0).all()
    assert draws[:, 1].unique().tolist() == [1.0, 1.5]
    # Round to nearest would always pick 1.0 for 1.1: stochastic rounding is not it.
    assert (draws[:, 1] == 1.5).float().mean() == pytest.approx(0.2, abs=0.01)


def test_stochastic_rounding_repeats_under_a_seed() -> None:
    x = normal(32, 64)
    torch.manual_seed(3)
    first = quantized(x, F.nvfp4, stochastic=True)
    torch.manual_seed(3)
    assert torch.equal(quantized(x, F.nvfp4, stochastic=True), first)
    assert not torch.equal(quantized(x, F.nvfp4, stochastic=True), first)


def test_hadamard_rotation_is_orthogonal_random_and_keeps_products() -> None:
    torch.manual_seed(0)
    rotation = hadamard_rotation(torch.device("cpu"))
    assert torch.allclose(rotation @ rotation.t(), torch.eye(16), atol=1e-6)
    assert (rotation.abs() == 0.25).all()
    assert not torch.equal(hadamard_rotation(torch.device("cpu")), rotation)
    # Rows not a multiple of 16 are padded; the product over the rows is unchanged.
    a, b = normal(40, 24), normal(40, 8, seed=1)
    product = rotate_rows(a, rotation).t() @ rotate_rows(b, rotation)
    assert torch.allclose(product, a.t() @ b, atol=1e-4)
    assert not torch.allclose(rotate_rows(a, rotation)[:40], a, atol=0.1)


MXFP8 = Recipe(F.mxfp8_e4m3, F.mxfp8_e4m3)
FULL_NVFP4 = Recipe(
    F.nvfp4, F.nvfp4, hadamard_wgrad=True, weight_tiles=True, stochastic_gradients=True
)
# The SQNR (dB) of each recipe's gradients against fp32's, at least: its format's error.
RECIPES = [
    (MXFP8, 25.0),
    (Recipe(F.mxfp8_e4m3, F.mxfp8_e5m2), 20.0),
    (Recipe(F.mxfp4, F.mxfp4), 13.0),
    (Recipe(F.nvfp4, F.nvfp4), 14.0),
    (FULL_NVFP4, 12.0),
]


def outputs(layer: nn.Module) -> tuple[torch.Tensor, ...]:
    """The layer's output and its gradients: of the input, the weight and the bias."""
    x = normal(4, 64, 256).requires_grad_()
    out = layer(x)
    out.backward(normal(4, 64, 128, seed=1))
    return out, x.grad, layer.weight.grad, layer.bias.grad


def pair(recipe: Recipe) -> tuple[nn.Module, nn.Module]:
    """An emulated layer and an fp32 one with the same weights."""
    reference = nn.Linear(256, 128)
    layer = replacement(nn.Linear(256, 128), MicroscalingLinear, recipe=recipe)
    layer.load_state_dict(reference.state_dict())
    return layer, reference


@pytest.mark.parametrize(("recipe", "min_db"), RECIPES)
def test_the_emulated_linear_quantizes_forward_and_both_backward_matmuls(
    recipe: Recipe, min_db: float
) -> None:
    torch.manual_seed(0)
    layer, reference = pair(recipe)
    *got, bias_grad = outputs(layer)
    *want, want_bias_grad = outputs(reference)
    # Output, grad_input and grad_weight each carry the format's error: a straight-through
    # backward (fp32 gradients) would give inf dB for the two gradients.
    for mine, exact in zip(got, want, strict=True):
        assert mine.dtype == exact.dtype
        assert min_db < sqnr(exact, mine) < 40.0
    # The bias gradient is a sum of grad_out, in no matmul.
    assert torch.allclose(bias_grad, want_bias_grad, atol=1e-4)


def test_wgrad_in_high_precision_leaves_only_the_weight_gradient_exact() -> None:
    layer, reference = pair(Recipe(F.mxfp8_e4m3, F.mxfp8_e4m3, wgrad_high_precision=True))
    (_, grad_x, grad_w, _), (_, want_x, want_w, _) = outputs(layer), outputs(reference)
    assert torch.allclose(grad_w, want_w, atol=1e-4)
    assert sqnr(want_x, grad_x) < 40.0


def test_the_audit_counts_each_matmul_in_its_format() -> None:
    layer, _ = pair(Recipe(F.mxfp8_e4m3, F.mxfp8_e5m2))
    with MatmulRecorder(layer, layer) as recorder, torch.autocast("cpu", torch.bfloat16):
        outputs(layer)
    flops = 2 * 256 * 256 * 128  # 256 tokens
    assert recorder.flops.by_dtype("forward") == {"mxfp8_e4m3": flops}
    # E5M2 gradients meet E4M3 weights and activations: the gradient names the matmul.
    assert recorder.flops.by_dtype("backward") == {"mxfp8_e5m2": 2 * flops}


def test_the_layer_runs_in_the_autocast_dtype_and_keeps_its_parameters() -> None:
    linear = nn.Linear(64, 32)
    layer = replacement(linear, MicroscalingLinear, recipe=FULL_NVFP4)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    with torch.autocast("cpu", torch.bfloat16):
        assert layer(normal(8, 64)).dtype == torch.bfloat16


def test_nvfp4_only_switches_are_refused_on_mx() -> None:
    with pytest.raises(ValueError, match="NVFP4"):
        Recipe(F.mxfp4, F.mxfp4, stochastic_gradients=True)


@pytest.mark.parametrize(
    ("precision", "options", "expected"),
    [
        ("mxfp8", {}, Recipe(F.mxfp8_e4m3, F.mxfp8_e4m3)),
        (
            "mxfp8",
            {"e5m2_gradients": True, "scale_mode": "floor", "wgrad_high_precision": True},
            Recipe(
                F.mxfp8_e4m3,
                F.mxfp8_e5m2,
                ScaleCalculationMode.FLOOR,
                wgrad_high_precision=True,
            ),
        ),
        ("mxfp4", {"scale_mode": "even"}, Recipe(F.mxfp4, F.mxfp4, ScaleCalculationMode.EVEN)),
        (
            "nvfp4",
            {"weight_tiles": False},
            Recipe(F.nvfp4, F.nvfp4, hadamard_wgrad=True, stochastic_gradients=True),
        ),
    ],
)
def test_each_format_s_options_reach_its_recipe(precision, options, expected) -> None:
    """The recipe is built from the options by their names: one dropped (mxfp8's E5M2
    gradients, a scale mode, nvfp4's tiles) would train another recipe under its name."""
    cfg = PrecisionConfig(name=precision, emulate=True, options=options)
    assert create(precision, cfg, torch.device("cpu")).recipe() == expected
