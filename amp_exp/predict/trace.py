"""One training step traced on the meta device: every aten op's shapes, FLOPs and bytes moved.

The model is built under ``torch.device("meta")`` (workload.build_model, the builder a run uses),
so its parameters and activations have shapes and dtypes and no storage: Llama-3 8B traces on a
laptop. The forward and backward run for real, as a run's would, under a ``TorchDispatchMode``
that records each op; the optimizer's step, whose arithmetic is elementwise and whose kernels
read a step count off the device (impossible on meta), is costed from the parameter count
(predict/roofline.py). The trace runs in fp32: a precision's dtypes and casts are modelled from
its row of the precision table (predict/roofline.py), not re-traced.

What each op records:
- matmuls (mm, addmm, bmm, convolutions, fused attention): FLOPs by torch.utils.flop_counter's
  registered formulas, M, N and K where the op is a GEMM, and the linear layer it belongs to
  (fp8 converts linears, so its matmuls are found by layer, forward and backward alike);
- every op: the floating-point elements it reads and writes, and whether it runs inside the
  task's loss (kept in fp32 by every precision) or a layer the precisions keep in fp32 (norms).
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

from amp_exp.config.schema import RunConfig
from amp_exp.tasks.blocks import checkpoint_blocks, model_blocks
from amp_exp.tasks.sampling import Placement
from amp_exp.tasks.workload import build_data, build_model, make_task
from amp_exp.training.keep_fp32 import keeps_fp32
from amp_exp.training.linears import is_linear

aten = torch.ops.aten
# Ops that return memory they have not written (the next op writes into it): their output is
# whatever it held before.
ALLOCATIONS = frozenset(
    {
        aten.empty,
        aten.empty_like,
        aten.new_empty,
        aten.new_empty_strided,
        aten.empty_strided,
        aten.empty_permuted,
    }
)
# Ops that move no data, beside the views (``is_view``) and the allocations: a dtype cast in
# fp32 is none (the casts a precision adds are modelled), and a copy no kernel runs on a GPU.
FREE = ALLOCATIONS | {aten._unsafe_view, aten._to_copy, aten.clone}
GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
CONVOLUTIONS = {aten.convolution, aten.convolution_backward}
FLASH_FORWARD = aten._scaled_dot_product_flash_attention
FLASH = {
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_backward,
}


SDPA = F.scaled_dot_product_attention


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    """``F.scaled_dot_product_attention`` as a GPU runs it, one fused flash kernel each way. On
    the meta device it would decompose into the math path (bmm, softmax, bmm), whose T x T
    scores a GPU never writes to memory. Grouped-query keys and values are repeated to the
    query's heads first, as the math path does. The flash kernel takes [batch, heads, length,
    width]; SDPA takes any leading dimensions (a single head's [batch, length, width] too), so
    they are folded into those four and the output unfolded."""
    if attn_mask is not None:
        return SDPA(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)
    shape = (*query.shape[:-1], value.shape[-1])
    query, key, value = (four_dimensional(t) for t in (query, key, value))
    if kwargs.pop("enable_gqa", False) or key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    return aten._scaled_dot_product_flash_attention(
        query, key, value, dropout_p, is_causal, False, scale=kwargs.get("scale")
    )[0].reshape(shape)


def four_dimensional(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as [batch, heads, length, width]: leading dimensions folded into the batch,
    missing ones added in front."""
    while tensor.dim() < 4:
        tensor = tensor.unsqueeze(0)
    return tensor.reshape(-1, *tensor.shape[-3:])


@dataclass(frozen=True)
class Op:
    name: str
    phase: str  # "forward" or "backward"
    flops: float  # 0 for a memory-bound op
    read: int  # floating-point elements read
    written: int
    mnk: tuple[int, int, int] | None = None
    # The fully qualified name of the linear layer (linears.is_linear) the matmul
    # belongs to, if any.
    linear: str | None = None
    # Runs in fp32 under every precision: the task's loss (outside the model), norm layers.
    fp32: bool = False
    loss: bool = False


@dataclass
class StepTrace:
    ops: list[Op]
    # Trainable elements, each once (a tied weight is one parameter).
    parameters: int
    # Floating-point elements autograd saves for the backward at the trace's batch: in the
    # precision's activation dtype, and in fp32 (the loss, norm layers).
    saved_elements: int
    saved_fp32_elements: int
    # The elements of each linear layer's weight, by name (fp8's layers and autocast's casts).
    linear_weights: dict[str, int]
    batch_size: int
    units_per_sample: int
    unit: str
    model: nn.Module = field(repr=False)


def _floats(values: Any) -> Iterator[torch.Tensor]:
    for value in tree_flatten(values)[0]:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            yield value


def _mnk(func: Any, args: tuple, out: Any) -> tuple[int, int, int] | None:
    """A GEMM's M, N, K (batched: M counts every batch's rows). A convolution's are those of
    its implicit GEMM, per group (M: every output pixel of every group; N: output channels; K:
    input channels times the kernel's taps); its backward is costed at its forward's shape."""
    packet = func._overloadpacket
    if packet in CONVOLUTIONS:
        # convolution(input, weight, ..., groups); convolution_backward(grad_output, input,
        # weight, ..., groups, output_mask).
        forward = packet is aten.convolution
        output, weight = (out, args[1]) if forward else (args[0], args[2])
        groups = args[8] if forward else args[9]
        channels = weight.shape[0]
        return output.numel() // channels * groups, channels // groups, math.prod(weight.shape[1:])
    if func._overloadpacket not in GEMMS:
        return None
    first = args[1] if func._overloadpacket in {aten.addmm, aten.baddbmm} else args[0]
    k = first.shape[-1]
    n = out.shape[-1]
    return out.numel() // n, n, k


class OpRecorder(TorchDispatchMode):
    """Records each aten op of the step, attributed to the module it runs in."""

    def __init__(
        self, tracker: ModuleTracker, linears: dict[str, str], fp32_modules: set[str], root: str
    ) -> None:
        super().__init__()
        self.tracker = tracker
        self.linears = linears  # tracker's name of a linear -> its fully qualified name
        self.fp32_modules = fp32_modules
        self.model_name = root
        self.ops: list[Op] = []

    def where(self) -> tuple[bool, bool]:
        """(in the task's loss, in fp32) for the op running now."""
        parents = self.tracker.parents
        loss = self.model_name not in parents
        return loss, loss or bool(parents & self.fp32_modules)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in FREE or func.is_view:
            return out
        parents = self.tracker.parents
        formula = flop_registry.get(packet)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula else 0.0
        causal = 4 if packet is FLASH_FORWARD else 11
        # The dispatcher drops trailing arguments left at their defaults (is_causal=False).
        if packet in FLASH and len(args) > causal and args[causal]:
            flops /= 2  # causal: flash skips the masked half (the formula counts it)
        mnk = _mnk(func, args, out) if flops else None
        if packet is aten.convolution_backward and mnk:
            # torch's formula counts a grouped convolution's gradients as if ungrouped (a
            # depthwise one's C times over): one forward-shaped GEMM per gradient output_mask asks.
            flops = 2.0 * math.prod(mnk) * sum(args[10][:2])
        linear = next((self.linears[p] for p in parents if p in self.linears), None)
        loss, fp32 = self.where()
        self.ops.append(
            Op(
                name=packet.__name__,
                phase="backward" if self.tracker.is_bw else "forward",
                flops=flops,
                read=sum(t.numel() for t in _floats((args, kwargs))),
                written=sum(t.numel() for t in _floats(out)),
                mnk=mnk,
                linear=linear if flops else None,
                fp32=fp32,
                loss=loss,
            )
        )
        return out


def one_batch(cfg: RunConfig) -> RunConfig:
    """``cfg`` with synthetic data of one batch per split: one batch is all the trace reads, and
    sampling a synthetic set of 8,192-token sequences whole takes most of a minute."""
    cfg = copy.deepcopy(cfg)
    if hasattr(cfg.dataset, "train_size"):
        cfg.dataset.train_size = cfg.dataset.batch_size
        cfg.dataset.eval_size = cfg.dataset.eval_batch_size or cfg.dataset.batch_size
    return cfg


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """transformers asks whether position ids pack several sequences into a row, a question of
    values meta tensors do not have. amp_exp's token batches hold one sequence per row: no."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    with mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None):
        yield


def trace_step(cfg: RunConfig) -> StepTrace:
    """The forward and backward of one batch of ``cfg``'s run, op by op."""
    # The run's model on the meta device, its task, and one batch of its data on the CPU.
    data = build_data(one_batch(cfg), Placement(cfg.seed, torch.device("cpu")))
    with torch.device("meta"):
        model = build_model(cfg, data.facts)
    task = make_task(cfg, data.facts, torch.device("meta"), channels_last=False)
    model.train()
    block_inputs = []
    if cfg.trainer.activation_checkpointing:
        # As the run does (build.py): each block recomputes its forward in the backward, which
        # the trace then records, and keeps only its input.
        checkpoint_blocks(model, cfg.model.name)
        for block in model_blocks(model):
            block.register_forward_pre_hook(
                lambda _, args: block_inputs.extend(t.numel() for t in _floats(args))
            )
    # ModuleTracker's names: the root's class name, then the path below it.
    root = type(model).__name__
    names = {module: (f"{root}.{n}" if n else root) for n, module in model.named_modules()}
    linears = {names[m]: n for n, m in model.named_modules() if is_linear(m)}
    # Autocast runs batch norm in its input's dtype (it is on no autocast list): only the other
    # kept layers (LayerNorm, RMSNorm, ...) compute in fp32 under every precision.
    fp32_modules = {
        names[m] for m in model.modules() if keeps_fp32(m) and not isinstance(m, _BatchNorm)
    }
    tracker = ModuleTracker()
    recorder = OpRecorder(tracker, linears, fp32_modules, root)
    saved: dict[int, tuple[torch.Tensor, bool]] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        # A view saves its base's storage, once however many views of it are saved.
        base = tensor._base if tensor._base is not None else tensor
        saved[id(base)] = (base, recorder.where()[1])
        return tensor

    params = {id(p) for p in model.parameters()}
    inputs, targets = task.to_device(next(iter(data.train)))
    if isinstance(inputs, dict):
        # Which tokens are padding is a question of values, which meta tensors do not have
        # (transformers reads them to choose its mask). The trace costs every sequence at its
        # full length, as flash attention runs it.
        inputs = {key: value for key, value in inputs.items() if key != "attention_mask"}
    batch = (inputs, targets)
    with (
        unpacked_sequences(),
        tracker,
        recorder,
        mock.patch.object(F, "scaled_dot_product_attention", fused_attention),
    ):
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = task.loss(model, batch)
        loss.backward()
    activations = [
        (t.numel(), fp32)
        for key, (t, fp32) in saved.items()
        if key not in params and t.is_floating_point()
    ]
    return StepTrace(
        ops=recorder.ops,
        parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        saved_elements=sum(n for n, fp32 in activations if not fp32) + sum(block_inputs),
        saved_fp32_elements=sum(n for n, fp32 in activations if fp32),
        linear_weights={n: m.weight.numel() for n, m in model.named_modules() if is_linear(m)},
        batch_size=task.batch_samples(batch),
        units_per_sample=task.units_per_sample,
        unit=task.unit,
        model=model,
    )
