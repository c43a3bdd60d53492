"""Training FLOPs per token of a decoder-only transformer: 6N + 12·L·H·Q·T.

The formula of the PaLM paper (Chowdhery et al. 2022, appendix B), which nanoGPT's
``estimate_mfu`` and torchtitan use; Kaplan et al. (2020, table 1) and Chinchilla (Hoffmann et
al. 2022, appendix F) count the same 6N and the same attention term.

- 6N: each matmul parameter does one multiply-add (2 FLOPs) per token in the forward, and two in
  the backward (gradients of the input and of the weight).
- 12·L·H·Q·T: per layer and token, the scores Q·K^T and their weighted sum of V each take
  2·T·H·Q FLOPs in the forward (H query heads of width Q, T the sequence length), times 3 for
  forward and backward. Under grouped-query attention the K and V projections are narrower (K
  heads, not H), which N counts as they are, but every query head still scores against all T
  keys, so this term keeps H. The causal mask is not discounted, by the same convention (flash
  kernels skip the masked half of the scores, so by this count MFU is slightly generous).

N counts the parameters as the model holds them: a SwiGLU MLP's three matrices (gate, up, down)
and a GQA model's narrow K and V projections are exactly what they are.
"""

from __future__ import annotations

from torch import nn

from amp_exp.errors import ConfigError


def matmul_parameters(model: nn.Module) -> int:
    """N of the formula: every parameter but the embedding tables that are looked up, not
    multiplied (nanoGPT's ``get_num_params(non_embedding=True)``): position tables, and a token
    embedding with its own output head. A token embedding tied to the output head counts once,
    as the head. Biases and norm weights are included; they are under 0.1% of GPT-2 small."""
    multiplied = {
        id(module.weight)
        for module in model.modules()
        if not isinstance(module, nn.Embedding)
        and isinstance(getattr(module, "weight", None), nn.Parameter)
    }
    looked_up = sum(
        module.weight.numel()
        for module in model.modules()
        if isinstance(module, nn.Embedding) and id(module.weight) not in multiplied
    )
    return sum(p.numel() for p in model.parameters()) - looked_up


def decoder_flops_per_token(
    matmul_params: int, layers: int, heads: int, head_dim: int, seq_len: int
) -> float:
    """6N + 12·L·H·Q·T: forward and backward FLOPs per trained token. A count of 0 or less
    comes only from sizes that make no model (a negative layer count), and is refused rather
    than reported as a figure."""
    flops = 6 * matmul_params + 12 * layers * heads * head_dim * seq_len
    if flops <= 0:
        raise ConfigError(
            f"the model's training FLOPs per token come to {flops} (6·N + 12·L·H·Q·T with "
            f"N={matmul_params}, L={layers} layers, H={heads} heads, Q={head_dim}, T={seq_len}), "
            "not a positive count: its sizes, layer and head counts must be 1 or more"
        )
    return flops
