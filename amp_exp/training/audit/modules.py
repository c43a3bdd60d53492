"""Which module ran an op, forward, backward or recomputed: the module whose forward ran it.

``ModuleOps`` puts a forward pre-hook and a forward hook on every module of a model. In the
forward, the innermost module whose forward is running owns an op. When a module's forward
returns, every autograd node its forward created is tagged with its name (in the node's
``metadata``; an inner module's nodes keep their own); in backward, the op belongs to the module
that tagged the node autograd is running (``torch._C._current_autograd_node``). So a Dropout
owns no matmul, since no matmul node is its, and the names do not depend on which backward hooks
fire in which order (which the FSDP2 hooks change). A forward that runs while a backward node
runs is activation checkpointing's recompute, and is counted as such, not as backward.

Names are the model's ``named_modules()`` paths with the wrappers' own names taken out
(activation checkpointing's ``_checkpoint_wrapped_module``, ``torch.compile``'s ``_orig_mod``),
the names ``precision.keep_fp32`` and fp8's conversion are matched on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

# The attributes under which wrappers hold the module they wrap.
WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})
FORWARD, BACKWARD, RECOMPUTE = "forward", "backward", "recompute"
# What the records call the code outside every module (the loss).
OUTSIDE = "Global"
METADATA_KEY = "amp_exp_module"


def unwrapped_name(name: str) -> str:
    """``name`` without the wrappers' parts: ``blocks.0._checkpoint_wrapped_module.attn`` is
    ``blocks.0.attn``."""
    return ".".join(part for part in name.split(".") if part and part not in WRAPPER_NAMES)


def _grad_fns(value: Any) -> list:
    return [
        leaf.grad_fn
        for leaf in tree_leaves(value)
        if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None
    ]


def _tag(outputs: list, stop: set, name: str) -> None:
    """Tag the nodes between a forward's inputs (``stop``) and its ``outputs`` with ``name``,
    leaving those an inner module tagged as they are."""
    seen: set = set()
    pending = list(outputs)
    while pending:
        node = pending.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        node.metadata.setdefault(METADATA_KEY, name)
        pending.extend(next_node for next_node, _ in node.next_functions)


class ModuleOps:
    """While entered: ``current()``, the module and phase of the op running now."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.running: list[str] = []
        self._inputs: list[set] = []
        self._handles: list = []

    def current(self) -> tuple[str, str]:
        """(module, phase) of the op running now: forward, backward or recompute."""
        node = torch._C._current_autograd_node()
        if node is None:
            return (self.running[-1] if self.running else OUTSIDE), FORWARD
        if self.running:
            return self.running[-1], RECOMPUTE
        return node.metadata.get(METADATA_KEY, OUTSIDE), BACKWARD

    def __enter__(self) -> ModuleOps:
        for name, module in self.model.named_modules():
            name = unwrapped_name(name)

            def before(module, args, kwargs, name=name) -> None:
                self.running.append(name)
                self._inputs.append(set(_grad_fns((args, kwargs))))

            def after(module, args, kwargs, output, name=name) -> None:
                self.running.pop()
                stop = self._inputs.pop()
                if torch.is_grad_enabled():
                    _tag(_grad_fns(output), stop, name)

            self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            self._handles.append(
                module.register_forward_hook(after, with_kwargs=True, always_call=True)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
