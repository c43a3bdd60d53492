"""FSDP2: the model sharded over the ranks with ``fully_shard``, under one mixed-precision policy.

Each rank keeps a shard of every parameter (a DTensor), of its gradient and of its optimizer
state. Before a block's forward the block's parameters are all-gathered; after its backward the
gradients are reduce-scattered in ``reduce_dtype``, then kept as fp32 shards for the optimizer.
By default the gathered parameters are the stored fp32 weights and autocast computes, as under
DDP: one precision is one computation under every strategy. With ``precision.fsdp_cast_params``
they are gathered already cast to the policy's ``param_dtype``, and the forward runs in it
without autocast (torchtitan's way: less traffic, another computation); BatchNorm and the modules
``precision.keep_fp32`` names are then sharded on their own, under an fp32 policy.

The model's state goes to and from DCP (torch.distributed.checkpoint) as sharded state dicts keyed
by parameter name, which is what lets a checkpoint written by N ranks load on M.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _BatchNorm

from amp_exp.config.precisions import SHORT_NAMES, DType, get
from amp_exp.config.schema import ReduceDtype
from amp_exp.errors import ConfigError

DTYPES = {name: dtype.torch for dtype, name in SHORT_NAMES.items()}


@dataclass(frozen=True)
class ShardingDtypes:
    """The dtypes of an FSDP2 run, by name: the forward's (``param``) and the gradient
    reduction's (``reduce``)."""

    param: str
    reduce: str

    @classmethod
    def for_precision(
        cls, precision: str, reduce: ReduceDtype | None, cast_params: bool = False
    ) -> ShardingDtypes:
        """The precision table's dtypes (config.precisions): the stored weights, or under
        ``cast_params`` its FSDP2 cast; ``reduce`` overrides the reduction's."""
        spec = get(precision).spec
        param = (spec.fsdp_param_dtype if cast_params else None) or spec.weight_dtype
        return cls(param.short, spec.reduce_dtype.short if reduce is None else reduce.value)

    @property
    def casts_params(self) -> bool:
        return self.param != DType.float32.short

    def policy(self, output_fp32: bool = False) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(
            param_dtype=DTYPES[self.param] if self.casts_params else None,
            reduce_dtype=DTYPES[self.reduce],
            output_dtype=torch.float32 if output_fp32 and self.casts_params else None,
        )

    def fp32_policy(self, cast_inputs: bool) -> MixedPrecisionPolicy:
        """A module kept in fp32 in a low-precision forward: its parameters stay fp32, and with
        ``cast_inputs`` its inputs come in as fp32 and its output goes back to the forward's
        dtype, which the next module's gathered parameters are in."""
        return MixedPrecisionPolicy(
            param_dtype=torch.float32 if cast_inputs else None,
            reduce_dtype=DTYPES[self.reduce],
            output_dtype=DTYPES[self.param] if cast_inputs else None,
            cast_forward_inputs=cast_inputs,
        )


def check_shardable_alone(model: nn.Module, names: Sequence[str]) -> None:
    """A module sharded on its own must own its parameters: one it shares with a module outside
    it (tied weights) would be gathered with this module's group and used, still sharded, by
    the other."""
    for name in names:
        kept = model.get_submodule(name)
        inside = {id(p) for p in kept.parameters()}
        modules_inside = {id(m) for m in kept.modules()}
        for other, module in model.named_modules():
            if id(module) in modules_inside:
                continue
            shared = [n for n, p in module.named_parameters(recurse=False) if id(p) in inside]
            if shared:
                raise ConfigError(
                    f"precision.keep_fp32: {name} shares its parameter {other}.{shared[0]} with a "
                    "module outside it (tied weights), which trainer.strategy=fsdp2 cannot shard "
                    "apart; keep a module that holds both, or use trainer.strategy=ddp"
                )


def shard_model(
    model: nn.Module,
    dtypes: ShardingDtypes,
    device: torch.device,
    blocks: Sequence[nn.Module] = (),
    keep_fp32: Sequence[str] = (),
) -> nn.Module:
    """Shard each ``keep_fp32`` module and each BatchNorm under an fp32 policy, each of the
    model's repeated ``blocks`` (tasks/blocks.py finds them), then the root (which takes every
    other parameter).

    The model changes in place (its parameters become DTensor shards): build its optimizer after.
    """
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    if dtypes.casts_params:
        check_shardable_alone(model, keep_fp32)
        for name in keep_fp32:
            fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=dtypes.fp32_policy(True))
        # BatchNorm keeps fp32 weights, as FSDP1's MixedPrecision does by default: its running
        # statistics are fp32 buffers, and the CPU and cuDNN kernels take them beside a
        # low-precision input only when weight and bias are fp32 too. Its input stays as it comes.
        kept = {id(m) for name in keep_fp32 for m in model.get_submodule(name).modules()}
        for module in model.modules():
            if isinstance(module, _BatchNorm) and id(module) not in kept:
                fully_shard(module, mesh=mesh, mp_policy=dtypes.fp32_policy(False))
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=dtypes.policy())
    # Without autocast nothing would run the loss in fp32 (autocast keeps cross_entropy and
    # softmax there): the root hands its output over in fp32.
    fully_shard(model, mesh=mesh, mp_policy=dtypes.policy(output_fp32=True))
    return model


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally; the last micro-batch reduce-scatters the sum."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[nn.Module]:
    """Every parameter gathered for the length of an evaluation.

    Its forwards then need no all-gather, so a rank with fewer eval batches than another (or
    none) leaves no one waiting in a collective. Costs one unsharded model per rank meanwhile.
    """
    root: Any = model
    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
    root.set_reshard_after_forward(False)
    for module in sharded:
        module.unshard()
    try:
        yield model
    finally:
        for module in sharded:
            module.reshard()
        # fully_shard's own defaults: every module reshards after its forward but the root,
        # whose parameters the backward needs at once.
        root.set_reshard_after_forward(True)
        root.set_reshard_after_forward(False, recurse=False)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict | None]:
    """The model's and optimizer's sharded state dicts, keyed by parameter name.

    None for an optimizer without state yet (no step taken): DCP's state dict would create its
    state by a zero-lr step, and an SGD momentum buffer so created holds weight_decay x param, not
    the nothing a fresh optimizer starts from.
    """
    state = state_template(model, optimizer, with_optimizer=bool(optimizer.state))
    return state["model"], state.get("optimizer")


def state_template(
    model: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool
) -> dict[str, Any]:
    """Sharded state dicts for DCP to load into: this run's shapes, the checkpoint's values.

    The optimizer's entries, created by a zero-lr step if it has none yet, are all overwritten
    by the load.
    """
    # DCP is imported here, when a sharded run saves or loads, rather than at every start-up
    # (about 0.2 s; fully_shard and DTensor come with torch.optim's import of torch._dynamo).
    from torch.distributed.checkpoint import state_dict as dcp

    template: dict[str, Any] = {"model": dcp.get_model_state_dict(model)}
    if with_optimizer:
        template["optimizer"] = dcp.get_optimizer_state_dict(model, optimizer)
    return template


def load_sharded_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any] | None,
) -> None:
    from torch.distributed.checkpoint import state_dict as dcp  # see state_template

    dcp.set_model_state_dict(model, model_state)
    if optimizer_state is not None:
        dcp.set_optimizer_state_dict(model, optimizer, optimizer_state)


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a sharded DTensor: all ranks call it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def policies_in_force(model: nn.Module) -> list[tuple[str, torch.dtype, torch.dtype]]:
    """(module name, param dtype, reduce dtype) of each sharded module, as ``fully_shard``
    keeps its policy: unset dtypes resolved to what runs (the stored dtype, the param dtype)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        policy = module._get_fsdp_state()._mp_policy
        stored = next(module.parameters()).dtype
        param = policy.param_dtype or stored
        found.append((name, param, policy.reduce_dtype or param))
    return found
