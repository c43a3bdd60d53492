"""The block-scaled formats, quantized and dequantized by torchao's own casts, on any device.

A block-scaled tensor stores small elements and one scale per block of consecutive elements
along its last dimension:

- MXFP8 and MXFP4 (OCP Microscaling spec v1.0): 32-element blocks, power-of-two E8M0 scales,
  elements E4M3 or E5M2 (MXFP8) or E2M1 (MXFP4); ``MXTensor.to_mx`` with its scale rounding
  mode (torchao's ``ScaleCalculationMode``).
- NVFP4 (NVIDIA): 16-element blocks, E2M1 elements, E4M3 scales under an fp32 scale of the
  whole tensor (its absolute maximum over 6 x 448, so the block scales use E4M3's full range);
  ``NVFP4Tensor.to_nvfp4``.

``quantized`` hands back the dequantized values in fp32: what a block-scaled matmul multiplies.
Rounding to nearest is torchao's cast itself. Two parts of NVIDIA's NVFP4 training recipe that
torchao does not cast are built from torchao's parts: 16x16 weight tiles (one scale per tile,
torchao's scale of the tile's maximum) and stochastic rounding (onto the E2M1 values torchao's
cast produces, with torchao's scales). The random bits come from the tensor's device generator,
which a checkpoint saves (training/rng.py), so a resumed run draws what an uninterrupted one does.
"""

from __future__ import annotations

import functools

import scipy.linalg
import torch
import torch.nn.functional as F
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

from amp_exp.config.precisions import DType

MX_BLOCK = DType.mxfp4.block.size
NVFP4_BLOCK = DType.nvfp4.block.size
E2M1_MAX = 6.0
# NVFP4's tensor scale of an all-zero tensor would be 0 and its reciprocal inf (0 x inf = NaN):
# a floor on the amax keeps it finite. Values of a tensor whose amax is below it flush to zero.
NVFP4_MIN_AMAX = 1e-30


# The element dtype torchao casts each MX format's elements to (DType names the formats as the
# audit counts them).
MX_ELEMENTS = {
    DType.mxfp8_e4m3: torch.float8_e4m3fn,
    DType.mxfp8_e5m2: torch.float8_e5m2,
    DType.mxfp4: torch.float4_e2m1fn_x2,
}


def _blocked_rows(x: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """``x`` as a contiguous fp32 matrix whose rows are zero-padded to a multiple of the block
    (a zero changes no block's maximum and adds nothing to a product), and its true width."""
    rows = x.reshape(-1, x.shape[-1]).float()
    width = rows.shape[-1]
    return F.pad(rows, (0, -width % multiple)).contiguous(), width


def quantized(
    x: torch.Tensor,
    fmt: DType,
    scale_mode: ScaleCalculationMode = ScaleCalculationMode.RCEIL,
    *,
    tiles: bool = False,
    stochastic: bool = False,
) -> torch.Tensor:
    """``x`` rounded to ``fmt`` in blocks along its last dimension, dequantized to fp32.

    ``tiles`` (NVFP4, a matrix): one scale per 16x16 tile, so the matrix and its transpose
    quantize alike. ``stochastic`` (NVFP4): elements rounded up or down at random, unbiased.
    """
    if fmt is not DType.nvfp4:
        # tiles and stochastic are NVFP4's: Recipe refuses them with another format.
        rows, width = _blocked_rows(x, MX_BLOCK)
        mx = MXTensor.to_mx(rows, MX_ELEMENTS[fmt], MX_BLOCK, scaling_mode=scale_mode)
        return mx.dequantize(torch.float32)[:, :width].reshape(x.shape)
    if tiles:
        return _nvfp4_tiles(x, stochastic)
    rows, width = _blocked_rows(x, NVFP4_BLOCK)
    return _nvfp4(rows, rows, stochastic)[:, :width].reshape(x.shape)


def _nvfp4(rows: torch.Tensor, scaled_by: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """``rows`` in NVFP4 with the block scales torchao gives ``scaled_by`` (``rows`` itself, or
    each tile's maximum in all its places) and the tensor scale of ``rows``."""
    amax = rows.abs().amax().clamp(min=NVFP4_MIN_AMAX)
    tensor_scale = per_tensor_amax_to_scale(amax)
    cast = NVFP4Tensor.to_nvfp4(scaled_by, NVFP4_BLOCK, per_tensor_scale=tensor_scale)
    if scaled_by is rows and not stochastic:
        return cast.dequantize(torch.float32)
    # torchao's own arithmetic (nvfp4_quantize, dequantize): scale by the reciprocals, clamp to
    # E2M1's range, round the elements, multiply by the tensor scale times the block scale.
    block_scales = cast.scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    scaled = rows * ((1.0 / tensor_scale) / block_scales)
    scaled = scaled.clamp(-E2M1_MAX, E2M1_MAX)
    elements = round_e2m1_stochastically(scaled) if stochastic else round_e2m1(scaled)
    return elements * (tensor_scale * block_scales)


def _nvfp4_tiles(x: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """A matrix in NVFP4 with one scale per 16x16 tile: torchao's block scale of the tile's
    maximum, which is each of the tile's row blocks' scale once every element of the tile is
    replaced by that maximum."""
    height, width = x.shape
    padded = F.pad(x.float(), (0, -width % NVFP4_BLOCK, 0, -height % NVFP4_BLOCK)).contiguous()
    rows, cols = padded.shape
    tiled = padded.abs().reshape(rows // NVFP4_BLOCK, NVFP4_BLOCK, cols // NVFP4_BLOCK, -1)
    tile_max = tiled.amax(dim=(1, 3), keepdim=True).expand_as(tiled).reshape(rows, cols)
    return _nvfp4(padded, tile_max.contiguous(), stochastic)[:height, :width]


def round_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """Values within E2M1's range rounded to the nearest E2M1 value (torchao's cast)."""
    return f4_unpacked_to_f32(f32_to_f4_unpacked(scaled))


@functools.cache
def _e2m1_magnitudes(device: torch.device) -> torch.Tensor:
    """The eight non-negative E2M1 values, ascending (0, 0.5, ..., 6), as torchao decodes them."""
    return f4_unpacked_to_f32(torch.arange(8, dtype=torch.uint8, device=device))


def round_e2m1_stochastically(scaled: torch.Tensor) -> torch.Tensor:
    """Values within E2M1's range rounded to one of their two neighbouring E2M1 values, the upper
    with probability (distance from the lower) / (gap between them): the expectation is the
    value itself. A value on the grid stays where it is."""
    grid = _e2m1_magnitudes(scaled.device)
    magnitude = scaled.abs()
    upper = torch.searchsorted(grid, magnitude).clamp(max=grid.numel() - 1)
    high, low = grid[upper], grid[(upper - 1).clamp(min=0)]
    gap = high - low
    p_up = torch.where(gap > 0, (magnitude - low) / gap.clamp(min=grid[1]), 0.0)
    up = torch.rand(scaled.shape, device=scaled.device) < p_up
    return torch.where(up, high, low).copysign(scaled)


@functools.cache
def _hadamard(size: int, device: torch.device) -> torch.Tensor:
    """Sylvester's ``size``x``size`` Hadamard matrix, normalised to be orthogonal."""
    return torch.from_numpy(scipy.linalg.hadamard(size)).float().to(device) / size**0.5


def hadamard_rotation(device: torch.device, size: int = NVFP4_BLOCK) -> torch.Tensor:
    """A random orthogonal ``size``x``size`` matrix H·diag(signs), the signs drawn from the
    device's generator: NVIDIA's random Hadamard transform."""
    signs = torch.randint(0, 2, (size,), device=device).float() * 2 - 1
    return _hadamard(size, device) * signs


def rotate_rows(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x`` (a matrix, fp32) with each run of ``len(rotation)`` consecutive rows multiplied by
    ``rotation``; rows are zero-padded to a multiple of it. Two matrices rotated alike keep
    their product over the rows: (R a)ᵀ (R b) = aᵀ b, as R is orthogonal."""
    size = rotation.shape[0]
    padded = F.pad(x, (0, 0, 0, -x.shape[0] % size))
    runs = padded.reshape(-1, size, padded.shape[-1])
    return torch.matmul(rotation, runs).reshape(padded.shape)
