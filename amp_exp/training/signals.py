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
batch; weights are summed only where they are sharded (FSDP2's DTensors), as under DDP every
rank holds them whole.

The collector knows no engine or trainer: ``attach(model)``, then per logged step ``arm()``, the
forward and backward, ``before_update()``, the optimizer step, ``after_update()``, ``collect()``
(the engine through ``SignalsCallback``; other trainers' callbacks alike).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
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

# One block's activation statistics: the largest magnitude and the attention logit (reduced
# with MAX), then the element count and the first four power sums (reduced with SUM).
ABSMAX, ATTN, COUNT, S1, S2, S3, S4 = range(7)
SUMS = 7 - COUNT
# The most attention scores recomputed at once (64 MiB in fp32).
SCORES_HELD = 2**24
# The model's output logits: largest (MAX), then count and sum (SUM).
LOGIT_MAX, LOGIT_COUNT, LOGIT_SUM = range(3)


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

    @classmethod
    def of(cls, spec: PrecisionSpec) -> Limits:
        converted = [d for d in spec.engaged.converted_dtypes if not d.block_scaled]
        matmul = converted[0] if converted else spec.compute_dtype
        compute = torch.finfo(spec.compute_dtype.torch)
        return cls(
            format=matmul.short,
            format_max=float(torch.finfo(matmul.torch).max),
            attn_logit_limit=-math.log(compute.tiny * compute.eps),
        )


def signal_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks, or its top-level children with parameters (a ResNet's stages)."""
    names = {id(module): name for name, module in model.named_modules()}
    blocks = model_blocks(model)
    if blocks is not None:
        return [(names[id(block)], block) for block in blocks]
    return [
        (name, child)
        for name, child in model.named_children()
        if any(True for _ in child.parameters())
    ]


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
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The largest logit ``F.scaled_dot_product_attention`` computes inside its kernel: the
    scaled QKᵀ, plus a float mask, over the positions a mask lets through. A few samples at a
    time, so at most ``SCORES_HELD`` scores are held at once."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
    rows, cols = query.shape[-2], key.shape[-2]
    keep = torch.ones(rows, cols, dtype=torch.bool, device=query.device).tril()
    per_sample = query[:1].numel() // query.shape[-1] * cols
    chunk = max(1, SCORES_HELD // max(per_sample, 1))
    largest = torch.full((), -math.inf, device=query.device)
    for start in range(0, query.shape[0], chunk):
        part = slice(start, start + chunk)
        scores = (query[part].float() @ key[part].float().transpose(-2, -1)) * scale
        if is_causal:
            scores = scores.masked_fill(~keep, -math.inf)
        if attn_mask is not None:
            per_sample_mask = attn_mask.dim() == query.dim() and attn_mask.shape[0] > 1
            mask = attn_mask[part] if per_sample_mask else attn_mask
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, -math.inf)
            else:
                scores = scores + mask.float()
        largest = torch.maximum(largest, scores.amax())
    return largest


class _AttentionLogits(TorchFunctionMode):
    """Inside one block's forward on a logged step: each SDPA call also records its max logit."""

    def __init__(self, stats: torch.Tensor) -> None:
        super().__init__()
        self.stats = stats

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, key = args[0], args[1]
            options = {
                name: kwargs[name]
                for name in ("attn_mask", "is_causal", "scale", "enable_gqa")
                if name in kwargs
            }
            # SDPA's positional order: query, key, value, attn_mask, dropout_p, is_causal, scale.
            for index, name in ((3, "attn_mask"), (5, "is_causal"), (6, "scale")):
                if len(args) > index:
                    options[name] = args[index]
            with torch.no_grad():
                largest = attention_logit_max(query.detach(), key.detach(), **options)
                self.stats[ATTN] = torch.maximum(self.stats[ATTN], largest.double())
        return func(*args, **kwargs)


class SignalCollector:
    """Measures the signals on the steps it is armed for; see the module docstring."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.blocks: list[tuple[str, nn.Module]] = []
        self.model: nn.Module | None = None
        self.device = torch.device("cpu")
        self.armed = False
        self.activations = True
        self._handles: list[RemovableHandle] = []
        self._modes: dict[int, _AttentionLogits] = {}
        self._block_stats: list[torch.Tensor | None] = []
        self._logit_stats: torch.Tensor | None = None
        self._before: list[list[torch.Tensor]] | None = None
        self._updates: torch.Tensor | None = None

    def attach(self, model: nn.Module, activations: bool = True) -> SignalCollector:
        """Measure ``model`` (the module inside any DDP or compile wrapper). ``activations``
        False measures the updates alone: a hook on a compiled model's modules breaks its graph
        (and recompiles it) at every log step, so a compiled run leaves its activation and logit
        signals unmeasured (None) rather than pay that."""
        self.model = model
        self.activations = activations
        self.blocks = signal_blocks(model)
        first = next(model.parameters(), None)
        self.device = torch.device("cpu") if first is None else local(first).device
        return self

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, device=self.device, dtype=torch.float64)

    # --- a logged step ---------------------------------------------------------------------

    def arm(self) -> None:
        """Measure the next step's forward passes (every micro-batch of it)."""
        assert self.model is not None, "attach(model) first"
        self.armed = True
        self._block_stats = [None] * len(self.blocks)
        self._logit_stats = None
        self._before, self._updates = None, None
        if not self.activations:
            return
        for index, (_, block) in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._entering(index)))
            self._handles.append(
                block.register_forward_hook(self._leaving(index), always_call=True)
            )
        self._handles.append(self.model.register_forward_hook(self._model_output))

    def _stats(self, index: int) -> torch.Tensor:
        stats = self._block_stats[index]
        if stats is None:
            stats = self._zeros(7)
            stats[ATTN] = -math.inf
            self._block_stats[index] = stats
        return stats

    def _entering(self, index: int):
        @torch.compiler.disable
        def hook(module: nn.Module, args: Any) -> None:
            mode = _AttentionLogits(self._stats(index))
            mode.__enter__()
            self._modes[index] = mode

        return hook

    def _leaving(self, index: int):
        @torch.compiler.disable
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            mode = self._modes.pop(index, None)
            if mode is not None:
                mode.__exit__(None, None, None)
            tensor = _first_tensor(output)
            if tensor is None or not tensor.is_floating_point():
                return
            with torch.no_grad():
                values = tensor.detach().double().flatten()
                stats = self._stats(index)
                stats[ABSMAX] = torch.maximum(stats[ABSMAX], values.abs().amax())
                stats[COUNT] += values.numel()
                powers = values.clone()
                for moment in (S1, S2, S3, S4):
                    stats[moment] += powers.sum()
                    powers.mul_(values)

        return hook

    @torch.compiler.disable
    def _model_output(self, module: nn.Module, args: Any, output: Any) -> None:
        tensor = _first_tensor(output)
        if tensor is None or not tensor.is_floating_point():
            return
        with torch.no_grad():
            logits = tensor.detach().double()
            if self._logit_stats is None:
                self._logit_stats = self._zeros(3)
                self._logit_stats[LOGIT_MAX] = -math.inf
            stats = self._logit_stats
            stats[LOGIT_MAX] = torch.maximum(stats[LOGIT_MAX], logits.amax())
            stats[LOGIT_COUNT] += logits.numel()
            stats[LOGIT_SUM] += logits.sum()

    def before_update(self) -> None:
        """The gradients are final and the weights not yet updated: keep a copy of each block's
        weights (this rank's shards) until ``after_update``."""
        if not self.armed:
            return
        self._before = [
            [local(p).detach().clone() for p in block.parameters() if p.requires_grad]
            for _, block in self.blocks
        ]

    def after_update(self) -> None:
        """The optimizer stepped: each block's squared update and weight norms, on the device."""
        if not self.armed or self._before is None:
            return
        sums = []
        for (_, block), before in zip(self.blocks, self._before, strict=True):
            after = [local(p).detach() for p in block.parameters() if p.requires_grad]
            squares = [
                torch.stack([(a.double() - b.double()).square().sum(), b.double().square().sum()])
                for a, b in zip(after, before, strict=True)
            ]
            # A block without trainable weights has no ratio: 0/0 reads as None.
            sums.append(torch.stack(squares).sum(dim=0) if squares else self._zeros(2))
        self._before = None
        self._updates = torch.stack(sums)

    def collect(self) -> dict[str, Any]:
        """The step's signals as a row's fields (plain numbers, None where nothing was measured),
        after one MAX and one SUM over the ranks, in one host read; disarms. Every rank calls
        it, whether or not its own forward measured anything."""
        self.disarm()
        blocks = len(self.blocks)
        table = (
            torch.stack([self._stats(i) for i in range(blocks)]) if blocks else self._zeros(0, 7)
        )
        # A block that did not run has no largest value, whatever its zeroed statistics say.
        table[:, ABSMAX] = torch.where(table[:, COUNT] > 0, table[:, ABSMAX], -math.inf)
        logits = self._logit_stats
        if logits is None:
            logits = self._zeros(3)
            logits[LOGIT_MAX] = -math.inf
        updates = self._zeros(blocks, 2) if self._updates is None else self._updates
        largest = torch.cat([table[:, :COUNT].flatten(), logits[:LOGIT_COUNT]])
        sums = [table[:, COUNT:].flatten(), logits[LOGIT_COUNT:]]
        sharded = _sharded(self.blocks)
        sums = torch.cat([*sums, updates.flatten()] if sharded else sums)
        if distributed():
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        read = torch.cat([largest, sums] if sharded else [largest, sums, updates.flatten()])
        values = read.tolist()  # the step's one host read
        maxima, values = values[: blocks * COUNT], values[blocks * COUNT :]
        logit_max, values = values[0], values[1:]
        moments, values = values[: blocks * SUMS], values[blocks * SUMS :]
        logit_count, logit_sum, values = values[0], values[1], values[2:]
        row: dict[str, Any] = asdict(self.limits)
        for index, (name, _) in enumerate(self.blocks):
            stats = (
                maxima[index * COUNT : (index + 1) * COUNT]
                + moments[index * SUMS : (index + 1) * SUMS]
            )
            row.update(self._block_fields(name, stats))
            update_sq, weight_sq = values[2 * index : 2 * index + 2]
            row[f"update_ratio/{name}"] = math.sqrt(update_sq / weight_sq) if weight_sq else None
        row["logit_max"] = logit_max if logit_count else None
        row["logit_mean"] = logit_sum / logit_count if logit_count else None
        return row

    def _block_fields(self, name: str, values: list[float]) -> dict[str, Any]:
        absmax = kurtosis = attn = None
        if values[COUNT] > 0:
            count = values[COUNT]
            absmax = values[ABSMAX]
            attn = values[ATTN] if math.isfinite(values[ATTN]) else None
            mean = values[S1] / count
            m2 = values[S2] / count - mean**2
            m4 = (
                values[S4] / count
                - 4 * mean * values[S3] / count
                + 6 * mean**2 * values[S2] / count
                - 3 * mean**4
            )
            kurtosis = m4 / m2**2 if m2 > 0 else None
        return {
            f"act_absmax/{name}": absmax,
            f"act_range_frac/{name}": None if absmax is None else absmax / self.limits.format_max,
            f"act_kurtosis/{name}": kurtosis,
            f"attn_logit_max/{name}": attn,
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


def distributed() -> bool:
    """Whether there are other ranks to reduce over."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _sharded(blocks: list[tuple[str, nn.Module]]) -> bool:
    return any(local(p) is not p for _, block in blocks for p in block.parameters())


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
