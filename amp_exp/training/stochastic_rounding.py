"""Stochastic rounding to bf16, and optimizer hooks that apply it to every update.

bf16 keeps 8 significant bits, so an update smaller than half the gap between a weight and its
bf16 neighbour rounds back to the weight itself: with a small learning rate most weights stop
moving. Rounding up or down at random, with the probability of the distance to each neighbour,
keeps every update in expectation.

``StochasticRoundingStep`` does this for any torch optimizer: before the step it hands the
optimizer fp32 copies of the bf16 parameters, gradients and state; after it, it rounds them back
to bf16 stochastically. The random bits come from torch's generator of the parameters' device,
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
    """Runs an optimizer's step in fp32 on its bf16 parameters; rounds the results stochastically.

    For the step alone, each bf16 parameter with a gradient is replaced in its param group by an
    fp32 copy holding an fp32 copy of the gradient, and its state tensors shaped like it
    (momentum, moments; not AdamW's scalar step count) by fp32 copies. Afterwards the result is
    rounded into the parameter in place and the state back to bf16. The parameter object and its
    dtype never change, so DDP's gradient hooks and torch.compile's guards stay valid; between
    steps weights, gradients and state are bf16.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # (param group, index, the bf16 parameter, its fp32 stand-in) for the step under way.
        self._swapped: list[tuple[dict, int, torch.Tensor, torch.Tensor]] = []
        optimizer.register_step_pre_hook(self._upcast)
        optimizer.register_step_post_hook(self._round)

    @staticmethod
    def _convert(state: dict, like: torch.Tensor, convert) -> dict:
        return {
            key: convert(value)
            if isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.shape == like.shape
            else value
            for key, value in state.items()
        }

    def _upcast(self, optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            for index, p in enumerate(group["params"]):
                if p.dtype != torch.bfloat16 or p.grad is None:
                    continue
                stand_in = p.detach().float()
                stand_in.grad = p.grad.float()
                state = optimizer.state.pop(p, {})
                optimizer.state[stand_in] = self._convert(state, p, torch.Tensor.float)
                group["params"][index] = stand_in
                self._swapped.append((group, index, p, stand_in))

    @torch.no_grad()
    def _round(self, optimizer, args, kwargs) -> None:
        for group, index, p, stand_in in self._swapped:
            p.copy_(round_to_bf16_stochastically(stand_in))
            state = optimizer.state.pop(stand_in)
            optimizer.state[p] = self._convert(state, p, round_to_bf16_stochastically)
            group["params"][index] = p
        self._swapped.clear()
