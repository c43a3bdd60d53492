"""Stochastic rounding to bf16, and optimizer hooks that apply it to every update.

bf16 keeps 8 significant bits, so an update smaller than half the gap between a weight and its
bf16 neighbour rounds back to the weight itself: with a small learning rate most weights stop
moving. Rounding up or down at random, with the probability of the distance to each neighbour,
keeps every update in expectation.

``StochasticRoundingStep`` does this for any torch optimizer: it steps each bf16 parameter on an
fp32 copy of it, its gradient and its state, and rounds the results back to bf16 stochastically,
one parameter at a time. The random bits come from torch's generator of the parameters' device,
which a checkpoint saves, so a resumed run rounds exactly as an uninterrupted one.
"""

from __future__ import annotations

import torch

# The 16 bits of an fp32 number that bf16 drops, and the 16 it keeps.
_DROPPED_BITS = 1 << 16
_KEPT_MASK = -_DROPPED_BITS  # 0xFFFF0000 as an int32


def round_to_bf16_stochastically(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) in bf16, rounded away from zero with probability (dropped bits) / 2^16.

    Adding uniform random bits below the kept mantissa and truncating carries into the kept part
    exactly that often. fp32 bit patterns are sign-magnitude, so this rounds the magnitude and
    works alike for negative numbers; a carry out of the mantissa correctly bumps the exponent.
    """
    noise = torch.randint(0, _DROPPED_BITS, x.shape, device=x.device, dtype=torch.int32)
    # In place in the noise: one temporary instead of three (this runs on every weight per step).
    noise.add_(x.contiguous().view(torch.int32)).bitwise_and_(_KEPT_MASK)
    # The low 16 bits are zero now, so the conversion to bf16 is exact.
    return noise.view(torch.float32).to(torch.bfloat16)


class StochasticRoundingStep:
    """Steps a torch optimizer on bf16 parameters in fp32, one parameter at a time, and rounds
    each result stochastically.

    The parameters that are not bf16 (norm layers) step first, together. Then each bf16
    parameter with a gradient steps alone: its param group holds an fp32 stand-in for it, with an
    fp32 copy of its gradient and of its state, for that one call of ``optimizer.step()``;
    afterwards the result is rounded into the parameter in place and the state back to bf16. So
    at any moment at most one parameter has fp32 copies (AMP keeps fp32 masters of all of them),
    the parameter object and its dtype never change (DDP's gradient hooks and torch.compile's
    guards stay valid), and between steps weights, gradients and state are bf16.

    State tensors take the parameter's dtype except the step count ``step``: torch.optim's own
    rule when it loads a state dict (``Optimizer._process_value_according_to_param_policy``).
    """

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        groups = optimizer.param_groups
        kept = [group["params"] for group in groups]
        try:
            for group, params in zip(groups, kept, strict=True):
                group["params"] = [p for p in params if p.dtype != torch.bfloat16]
            if any(group["params"] for group in groups):
                optimizer.step()
            for group in groups:
                group["params"] = []
            for group, params in zip(groups, kept, strict=True):
                for p in params:
                    if p.dtype == torch.bfloat16 and p.grad is not None:
                        self._step_one(optimizer, group, p)
        finally:
            for group, params in zip(groups, kept, strict=True):
                group["params"] = params

    @staticmethod
    @torch.no_grad()
    def _step_one(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> None:
        stand_in = p.detach().float()
        stand_in.grad = p.grad.float()
        state = optimizer.state.pop(p, {})
        optimizer.state[stand_in] = {
            key: value.float() if _rounds(key, value) else value for key, value in state.items()
        }
        group["params"] = [stand_in]
        try:
            optimizer.step()
        finally:
            group["params"] = []
            stepped = optimizer.state.pop(stand_in)
        p.copy_(round_to_bf16_stochastically(stand_in))
        # Into the bf16 tensors the state had (none before the first step), so that between
        # steps nothing is allocated anew.
        for key, value in stepped.items():
            if not _rounds(key, value):
                state[key] = value
            elif key in state:
                state[key].copy_(round_to_bf16_stochastically(value))
            else:
                state[key] = round_to_bf16_stochastically(value)
        optimizer.state[p] = state


def _rounds(key: str, value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step"
