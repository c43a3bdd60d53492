"""The long-run signals: what, measured over a short run, says whether a precision stays safe for
a long one (docs/forecast.md; amp_exp/forecast extrapolates them).

Per block (``tasks.blocks.model_blocks``: a transformer's layers; a model without them, such as
a ResNet, by its top-level children that hold parameters):

- ``act_absmax``: the largest magnitude of the block's output, and ``act_range_frac``, its share
  of the largest value of the format the run's matmuls read (fp16 65504, e4m3 448: torch.finfo
  of the precision's dtype, never a literal here). Outlier features grow here before an fp8 run
  diverges (Fishman et al. 2024).
- ``act_kurtosis``: the kurtosis of the block's output, an early sign of outliers
  (arXiv 2505.20524).
- ``attn_logit_max``: the largest pre-softmax attention logit of the block. Fused SDPA never
  materialises the logits, so on the log step only they are recomputed from its query and key
  (Wortsman et al. 2023: attention logits grow until the softmax saturates).
- ``update_ratio``: the RMS of the step's update over the RMS of the block's weights
  (arXiv 2304.13013: update spikes precede loss spikes).

Per model: ``logit_mean`` and ``logit_max`` of its output (output-logit drift, Wortsman et al.).
The gradient norm, the loss scale and the skipped steps are in the train row already.

Cost: nothing on unlogged steps, which run without a hook (``arm()`` registers them for one
step, ``collect()`` removes them and reads the statistics, kept on the device, in one host read).
Under torch.distributed every rank measures its own batch: the largest values are taken over
the ranks (all_reduce MAX) and the moments summed (SUM), so the figures describe the global
batch; the update and weight norms are summed too (``collect`` says why that is right under DDP
and FSDP2 alike).

The collector knows no engine or trainer: ``attach(model)``, then per logged step ``arm()``, the
forward and backward, ``before_update()``, the optimizer step, ``after_update()``, ``collect()``
(the engine through ``SignalsCallback``; other trainers' callbacks alike).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import lru_cache, partial, reduce
from itertools import repeat
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from amp_exp.config.precisions import PrecisionSpec
from amp_exp.runtime.fsdp import local
from amp_exp.tasks.blocks import model_blocks
from amp_exp.training.callbacks import StepCallback
from amp_exp.training.precisions.base import Gradients

# The statistics of each block's output, and in a last row the model's output logits: the
# largest values (MAX over the ranks): a block's largest magnitude, its attention logit and (in a
# block-scaled format, negated so that the MAX is the least) the least of its quantization blocks'
# nonzero maxima; the logits' largest value; the sums (SUM over the ranks): the element count and
# the first four power sums (of the logits, count and sum only).
ABSMAX, ATTN, NEG_LEAST_BLOCK = range(3)
COUNT, S1, S2, S3, S4 = range(5)
# The most attention scores recomputed at once (64 MiB in fp32).
SCORES_HELD = 2**24


@dataclass(frozen=True)
class Limits:
    """What the signals are measured against, from the precision's facts."""

    # The format the matmuls read activations in: a converted linear's (fp8's e4m3), otherwise
    # the compute dtype. Block-scaled formats rescale every block, so their range is that of
    # the compute dtype around them.
    format: str
    format_max: float
    # The attention logit at which a key scored 0 gets a softmax weight below the compute
    # dtype's smallest subnormal, so it rounds to zero: the softmax has saturated to one-hot.
    attn_logit_limit: float
    # A block-scaled format's (config.precisions.BlockFormat): its name, the elements a scale
    # covers and the range of its scales, which bounds how far its blocks' maxima may spread.
    block_format: str | None = None
    block_size: int | None = None
    scale_range: float | None = None

    @classmethod
    def of(cls, spec: PrecisionSpec) -> Limits:
        converted = [d for d in spec.engaged.converted_dtypes if not d.block_scaled]
        matmul = converted[0] if converted else spec.compute_dtype
        compute = torch.finfo(spec.compute_dtype.torch)
        scaled = next((d for d in spec.engaged.converted_dtypes if d.block_scaled), None)
        blocks: dict[str, Any] = {}
        if scaled is not None:
            size, scale_range = scaled.block.size, scaled.block.scale_range
            blocks = {"block_format": scaled.value, "block_size": size, "scale_range": scale_range}
        return cls(
            format=matmul.short,
            format_max=float(torch.finfo(matmul.torch).max),
            attn_logit_limit=-math.log(compute.tiny * compute.eps),
            **blocks,
        )


def signal_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks, or its top-level children with parameters (a ResNet's stages)."""
    names = {id(module): name for name, module in model.named_modules()}
    blocks = model_blocks(model)
    if blocks is not None:
        return [(names[id(block)], block) for block in blocks]
    children = model.named_children()
    return [(name, child) for name, child in children if next(child.parameters(), None) is not None]


def _first_tensor(output: Any) -> torch.Tensor | None:
    """A module's output tensor: itself, a Hugging Face output's ``logits``, or a tuple's first."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def attention_logit_max(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The largest logit ``F.scaled_dot_product_attention`` computes inside its kernel (this
    takes its arguments): the scaled QKᵀ, plus a float mask, over the positions a mask lets
    through. A few samples at a time, so at most ``SCORES_HELD`` scores are held at once."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
    future = _future(query.shape[-2], key.shape[-2], query.device) if is_causal else None
    per_sample = math.prod(query.shape[1:-1]) * key.shape[-2]
    chunk = max(1, SCORES_HELD // max(per_sample, 1))
    parts: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    if query.shape[0] <= chunk:  # the common case: one chunk, without views made
        parts = [(query, key, attn_mask)]
    else:
        per_sample_mask = attn_mask is not None and attn_mask.dim() == query.dim()
        per_sample_mask = per_sample_mask and attn_mask.shape[0] > 1
        masks = attn_mask.split(chunk) if per_sample_mask else repeat(attn_mask)
        # the masks repeat when one serves every sample
        parts = zip(query.split(chunk), key.split(chunk), masks, strict=False)
    # A positive scale commutes with the max (rounding is monotonic), so it multiplies the one
    # largest score instead of every score; a float mask adds to the scaled scores.
    scale_each = scale <= 0 or (attn_mask is not None and attn_mask.dtype != torch.bool)
    largest = None
    for queries, keys, mask in parts:
        scores = queries.float() @ keys.float().transpose(-2, -1)
        if scale_each:
            scores.mul_(scale)  # in place, as below: the scores are this chunk's own
        if future is not None:
            scores.masked_fill_(future, -math.inf)
        if mask is not None:
            if mask.dtype == torch.bool:
                scores.masked_fill_(~mask, -math.inf)
            else:
                scores = scores + mask.float()
        top = scores.amax()
        largest = top if largest is None else torch.maximum(largest, top)
    if largest is None:
        return torch.full((), -math.inf, device=query.device)
    return largest if scale_each else largest * scale


@lru_cache(maxsize=4)
def _future(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """SDPA's causal mask as the positions it hides: query i sees keys 0..i. Kept for the next
    block and log step (a model has one or two sequence lengths; seq_len² bytes each)."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).triu(1)


def _fold_max(largest: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``largest`` (a view into a collector's table) the larger of itself and ``value``,
    in place, a NaN winning as in ``torch.maximum``."""
    torch.maximum(largest, value, out=largest)


def _least_block_max(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """The least nonzero maximum magnitude over the tensor's quantization blocks (``size``
    consecutive elements of a row of its last dimension, zero-padded as the block-scaled casts
    pad them); inf where every block is zero."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    rows = F.pad(rows, (0, -rows.shape[-1] % size))
    maxima = rows.reshape(-1, size).abs().amax(dim=1).double()
    return torch.where(maxima > 0, maxima, math.inf).amin()


_SDPA = F.scaled_dot_product_attention


class _AttentionLogits(TorchFunctionMode):
    """Inside one block's forward on a logged step: each SDPA call also records its max logit."""

    def __init__(self, largest: torch.Tensor) -> None:
        super().__init__()
        self.largest = largest

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every op of the block passes here: the common case returns at once.
        if func is not _SDPA:
            return func(*args, **kwargs) if kwargs else func(*args)
        with torch.no_grad():
            _fold_max(self.largest, attention_logit_max(*args, **(kwargs or {})))
        return func(*args, **(kwargs or {}))


class SignalCollector:
    """Measures the signals on the steps it is armed for; see the module docstring."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._limit_fields = asdict(limits)  # every row's first fields, made once
        self.blocks: list[tuple[str, nn.Module]] = []
        # Each block's pre-hook and hook, made once: arm() only registers them.
        self._hooks: list[tuple[partial, partial]] = []
        # The blocks' trainable weights, block after block; how many elements each block has
        # (of this rank's shards); the dtype their copy is kept in.
        self._weights: list[nn.Parameter] = []
        self._sizes: list[int] = []
        self._copy_dtype = torch.float32
        self.model: nn.Module | None = None
        self.device = torch.device("cpu")
        self.armed = False
        self.activations = True
        self._handles: list[RemovableHandle] = []
        self._modes: dict[int, _AttentionLogits] = {}
        self._before: torch.Tensor | None = None
        self._current: list[torch.Tensor] = []
        self._weight_norms: tuple[torch.Tensor, ...] = ()
        self._start()

    def attach(self, model: nn.Module, activations: bool = True) -> SignalCollector:
        """Measure ``model`` (the module inside any DDP or compile wrapper). ``activations``
        False measures the updates alone: a hook on a compiled model's modules breaks its graph
        (and recompiles it) at every log step, so a compiled run leaves its activation and logit
        signals unmeasured (None) rather than pay that."""
        self.model = model
        self.activations = activations
        self.blocks = signal_blocks(model)
        indices = range(len(self.blocks))
        self._hooks = [(partial(self._entering, i), partial(self._leaving, i)) for i in indices]
        trainable = [[p for p in block.parameters() if p.requires_grad] for _, block in self.blocks]
        self._weights = [p for weights in trainable for p in weights]
        self._sizes = [sum(local(p).numel() for p in weights) for weights in trainable]
        # At least float32, where the difference of two bf16 or fp16 weights is exact.
        dtypes = (local(p).dtype for p in self._weights)
        self._copy_dtype = reduce(torch.promote_types, dtypes, torch.float32)
        first = next(model.parameters(), None)
        self.device = torch.device("cpu") if first is None else local(first).device
        self._start()
        return self

    def _start(self) -> None:
        """The step's table, made once per model: in one buffer, so that ``collect`` reduces it
        in two parts and reads it in one, the largest values (a row of 3 per block and one for
        the logits; MAX over the ranks), then the sums (a row of 5 each) and the squared update
        and weight norms (2 rows of one per block; SUM)."""
        rows, blocks = len(self.blocks) + 1, len(self.blocks)
        table = torch.empty(8 * rows + 2 * blocks, device=self.device, dtype=torch.float64)
        self._table, self._maxima, self._totals = table, table[: 3 * rows], table[3 * rows :]
        self._largest = self._maxima.view(rows, 3)
        self._sums = table[3 * rows : 8 * rows].view(rows, 5)
        self._norms = table[8 * rows :]
        # Views made once, not once an output: each row's largest magnitude, attention logit
        # and sums, a scratch row the sums are written into (one add folds them in, no
        # stack), the logits'.
        self._absmax = self._largest[:, ABSMAX].unbind()
        self._attn = self._largest[:, ATTN].unbind()
        self._sum_rows = [*self._sums[:-1].unbind(), self._sums[-1, : S1 + 1]]
        self._scratch = torch.empty(5, device=self.device, dtype=torch.float64)
        self._scratch_parts = (*self._scratch.unbind(), self._scratch[: S1 + 1])
        self._reset()

    def _reset(self) -> None:
        """Nothing measured yet; no update (a block without one reads 0 and 0: None)."""
        self._maxima.fill_(-math.inf)
        self._totals.zero_()
        self._before = None

    # --- a logged step ---------------------------------------------------------------------

    def arm(self) -> None:
        """Measure the next step's forward passes (every micro-batch of it)."""
        assert self.model is not None, "attach(model) first"
        self.armed = True
        self._reset()
        if not self.activations:
            return
        for (_, block), (entering, leaving) in zip(self.blocks, self._hooks, strict=True):
            self._handles.append(block.register_forward_pre_hook(entering))
            self._handles.append(block.register_forward_hook(leaving, always_call=True))
        self._handles.append(self.model.register_forward_hook(self._model_output))

    @torch.compiler.disable
    def _entering(self, index: int, module: nn.Module, args: Any) -> None:
        mode = _AttentionLogits(self._attn[index])
        mode.__enter__()
        self._modes[index] = mode

    @torch.compiler.disable
    def _leaving(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        mode = self._modes.pop(index, None)
        if mode is not None:
            mode.__exit__(None, None, None)
        self._record(index, output)

    @torch.compiler.disable
    def _model_output(self, module: nn.Module, args: Any, output: Any) -> None:
        self._record(len(self.blocks), output)

    @torch.no_grad()
    def _record(self, row: int, output: Any) -> None:
        """Fold a module's float output into row ``row``: a block's largest magnitude, count and
        first four power sums; the logits' largest value, count and sum."""
        tensor = _first_tensor(output)
        if tensor is None or not tensor.is_floating_point():
            return
        count, s1, s2, s3, s4, logit_scratch = self._scratch_parts
        if row == len(self.blocks):
            largest, scratch = tensor.amax(), logit_scratch
            torch.sum(tensor.flatten(), 0, dtype=torch.float64, out=s1)
        else:
            values = tensor.double().flatten()
            square = values.square()
            largest, scratch = tensor.abs().amax(), self._scratch
            torch.sum(values, 0, out=s1)
            torch.sum(square, 0, out=s2)
            torch.dot(square, values, out=s3)
            torch.dot(square, square, out=s4)
            if self.limits.block_size is not None:
                least = _least_block_max(tensor, self.limits.block_size)
                _fold_max(self._largest[row, NEG_LEAST_BLOCK], -least)
        count.fill_(tensor.numel())
        _fold_max(self._absmax[row], largest)
        self._sum_rows[row].add_(scratch)

    def before_update(self) -> None:
        """The gradients are final and the weights not yet updated: keep one flat copy of the
        blocks' weights (this rank's shards) until ``after_update``, and each block's norm."""
        if not self.armed or not self._weights:  # every step calls it: return at once
            return
        with torch.no_grad():
            # The same tensors after the update: the optimizer steps them in place. Kept as they
            # are, not flattened: a weight not contiguous in memory (channels_last) flattens to
            # a copy, which the step would leave behind.
            self._current = [local(p) for p in self._weights]
            copy = self._current[0].new_empty(sum(self._sizes), dtype=self._copy_dtype)
            self._before = torch.cat([weight.flatten() for weight in self._current], out=copy)
            self._weight_norms = torch._foreach_norm(copy.split(self._sizes), dtype=torch.float64)

    def after_update(self) -> None:
        """The optimizer stepped: each block's squared update and weight norms, on the device.
        The copy becomes minus the update in place, so no second copy of the weights is made:
        exact for bf16 and fp16 weights, rounded as float32 rounds for float32 ones. The squares
        are summed in float64."""
        if not self.armed or self._before is None:
            return
        with torch.no_grad():
            pieces = self._before.split([weight.numel() for weight in self._current])
            shaped = [piece.view(w.shape) for piece, w in zip(pieces, self._current, strict=True)]
            torch._foreach_sub_(shaped, self._current)
            norms = torch._foreach_norm(self._before.split(self._sizes), dtype=torch.float64)
            # The updates', then the weights'. A block without trainable weights has 0 and 0:
            # its ratio 0/0 reads as None.
            torch.stack([*norms, *self._weight_norms], out=self._norms).square_()
        self._before, self._current = None, []

    def collect(self) -> dict[str, Any]:
        """The step's signals as a row's fields (plain numbers, None where nothing was measured),
        after one MAX and one SUM over the ranks, in one host read; disarms. Every rank calls
        it, whether or not its own forward measured anything.

        The update and weight norms are summed too: sharded (FSDP2), the shards add up to the
        whole; whole on every rank (DDP), each sum is the world size times one rank's, which
        leaves their ratio as it is."""
        self.disarm()
        blocks = len(self.blocks)
        if distributed():
            dist.all_reduce(self._maxima, op=dist.ReduceOp.MAX)
            dist.all_reduce(self._totals, op=dist.ReduceOp.SUM)
        values = self._table.tolist()  # the step's one host read
        rows = blocks + 1
        largest, sums = _rows(values[: 3 * rows], 3), _rows(values[3 * rows : 8 * rows], 5)
        update_sq, weight_sq = values[8 * rows : 8 * rows + blocks], values[8 * rows + blocks :]
        row: dict[str, Any] = dict(self._limit_fields)
        for (name, _), maxima, moments, update, weight in zip(
            self.blocks, largest[:-1], sums[:-1], update_sq, weight_sq, strict=True
        ):
            row.update(self._block_fields(name, maxima, moments))
            row[f"update_ratio/{name}"] = math.sqrt(update / weight) if weight else None
        logit_count, logit_sum = sums[-1][COUNT], sums[-1][S1]
        row["logit_max"] = largest[-1][ABSMAX] if logit_count else None
        row["logit_mean"] = logit_sum / logit_count if logit_count else None
        return row

    def _block_fields(self, name: str, maxima: list[float], sums: list[float]) -> dict[str, Any]:
        absmax = kurtosis = attn = spread = None
        count = sums[COUNT]
        if count > 0:
            absmax = maxima[ABSMAX]
            attn = maxima[ATTN] if math.isfinite(maxima[ATTN]) else None
            least = -maxima[NEG_LEAST_BLOCK]
            # The spread the block scales must span: the largest block maximum over the least.
            spread = absmax / least if 0 < least < math.inf else None
            mean = sums[S1] / count
            m2 = sums[S2] / count - mean**2
            m4 = (
                sums[S4] / count
                - 4 * mean * sums[S3] / count
                + 6 * mean**2 * sums[S2] / count
                - 3 * mean**4
            )
            kurtosis = m4 / m2**2 if m2 > 0 else None
        return {
            f"act_absmax/{name}": absmax,
            f"act_range_frac/{name}": None if absmax is None else absmax / self.limits.format_max,
            f"act_kurtosis/{name}": kurtosis,
            f"attn_logit_max/{name}": attn,
            **({} if self.limits.block_size is None else {f"act_block_spread/{name}": spread}),
        }

    def disarm(self) -> None:
        """Remove the hooks (and leave any attention mode a failed forward left entered)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for mode in self._modes.values():
            mode.__exit__(None, None, None)
        self._modes.clear()
        self.armed = False


def _rows(values: list[float], width: int) -> list[list[float]]:
    return [values[start : start + width] for start in range(0, len(values), width)]


def distributed() -> bool:
    """Whether there are other ranks to reduce over."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class SignalsCallback(StepCallback):
    """The engine's driver of a ``SignalCollector``: the weights before and after the update of
    an armed step. The engine arms it before a log step and collects it at the log row."""

    name = "signals"

    def __init__(self, collector: SignalCollector) -> None:
        self.collector = collector

    def after_clip(self, step: int, gradients: Gradients) -> None:
        self.collector.before_update()

    def after_step(self, step: int) -> None:
        self.collector.after_update()
