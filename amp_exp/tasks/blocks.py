"""A model's repeated blocks (``model.blocks``), the unit that is checkpointed, compiled and
sharded one at a time.

A transformer keeps its layers in an ``nn.ModuleList`` named ``blocks``; a Hugging Face model keeps
them in the list of the layer classes it names in ``_no_split_modules`` (what accelerate never
splits across devices). Recomputing, compiling and sharding it block by block is what torchtitan
does: in that order, so that each compiled region holds one block's recomputation and each
all-gather brings in one block's parameters. Models without blocks (the image models) are
compiled and sharded whole.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from amp_exp.config.cross_checks import no_blocks
from amp_exp.config.schema import CompileMode


def model_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The model's transformer blocks, or None for a model that keeps none."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return blocks
    no_split = {name for m in model.modules() for name in getattr(m, "_no_split_modules", ()) or ()}
    if not no_split:
        return None
    return next(
        (
            m
            for m in model.modules()
            if isinstance(m, nn.ModuleList) and len(m) and all(_is_one_of(b, no_split) for b in m)
        ),
        None,
    )


def _is_one_of(block: nn.Module, class_names: set[str]) -> bool:
    """By class name, through a checkpoint wrapper and FSDP2's subclass of the block's class."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    return any(cls.__name__ in class_names for cls in type(inner).__mro__)


def checkpoint_blocks(model: nn.Module, model_name: str) -> None:
    """Make each block recompute its activations in the backward instead of keeping them.

    Only blocks: a model without them is refused. Checkpointing its top-level children instead
    would recompute BatchNorm layers, whose running statistics the recomputation updates a
    second time, and the layers of a plain MLP each keep their input anyway, which is all a
    checkpoint keeps.
    """
    blocks = model_blocks(model)
    if blocks is None:
        raise no_blocks(model_name)
    for index, block in enumerate(blocks):
        # The non-reentrant checkpoint, which torch recommends: it supports inputs that need no
        # gradient and, under FSDP2, gathers the block's parameters again for the recomputation.
        blocks[index] = checkpoint_wrapper(block)


def compile_blocks(model: nn.Module, mode: CompileMode) -> None:
    """Compile each block in place, or the whole model when it has no blocks.

    In place (``Module.compile``), so parameter names, and with them the keys of a checkpoint,
    are the same with and without compilation.
    """
    for module in model_blocks(model) or [model]:
        module.compile(mode=mode.value)
