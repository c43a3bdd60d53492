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

    Only bf16 parameters with a gradient are touched, and of their state only the tensors shaped
    like the parameter (momentum, moments; not AdamW's scalar step count). The fp32 copies live
    during the step alone: between steps weights, gradients and state stay bf16.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # Each upcast parameter's bf16 gradient, given back after the step.
        self._grads: dict[torch.nn.Parameter, torch.Tensor] = {}
        optimizer.register_step_pre_hook(self._upcast)
        optimizer.register_step_post_hook(self._round)

    def _state_tensors(self, p: torch.nn.Parameter, dtype: torch.dtype) -> list[str]:
        state = self.optimizer.state.get(p, {})
        return [
            key
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.dtype == dtype and value.shape == p.shape
        ]

    def _upcast(self, optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16 or p.grad is None:
                    continue
                self._grads[p] = p.grad
                p.data = p.data.float()
                p.grad = self._grads[p].float()
                state = optimizer.state[p]
                for key in self._state_tensors(p, torch.bfloat16):
                    state[key] = state[key].float()

    def _round(self, optimizer, args, kwargs) -> None:
        for p, grad in self._grads.items():
            # The gradient goes first: a parameter may not hold a gradient of another dtype.
            p.grad = None
            p.data = round_to_bf16_stochastically(p.data)
            p.grad = grad
            state = optimizer.state[p]
            for key in self._state_tensors(p, torch.float32):
                state[key] = round_to_bf16_stochastically(state[key])
        self._grads.clear()
