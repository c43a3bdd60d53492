"""A decoder-only transformer language model (GPT-2's architecture), and its FLOPs per token.

Pre-LayerNorm blocks, causal self-attention through ``F.scaled_dot_product_attention``, a GELU
MLP, learned position embeddings, and an output head that shares the token embedding's weights.

Mixed precision: the model never casts by hand; autocast decides each op's dtype. The linear
layers and attention run in fp16/bf16. The residual stream stays fp32: the embeddings are fp32,
and adding a low-precision branch to it promotes. So LayerNorm normalizes fp32 input, and on CUDA
``layer_norm`` is on autocast's fp32 list anyway. The attention softmax runs inside the fused
kernel, which keeps its running max and sum in fp32 whatever the input dtype. The logits leave
the head in low precision; the task turns them to fp32 before the loss (tasks/lm.py), since a
log-softmax over 50,257 classes in fp16 loses the small probabilities the loss is made of.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from amp_exp.config.models import GPTConfig
from amp_exp.tasks.flops import decoder_flops_per_token, matmul_parameters


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        shape = (batch, time, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        # One fused kernel (flash or memory-efficient on CUDA): the T x T scores never reach
        # memory, and the kernel keeps its softmax statistics in fp32 whatever the input dtype.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's approximation
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids [batch, time] in, next-token logits [batch, time, vocab_size] out."""

    def __init__(self, cfg: GPTConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.wte = nn.Embedding(vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        # Tied: one matrix embeds the tokens and scores them (GPT-2, "Using the Output Embedding
        # to Improve Language Models"); it saves vocab_size x d_model parameters.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scales the projections into the residual stream by 1/sqrt(2 * n_layer), so the
        # stream's variance does not grow with depth.
        for name, parameter in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def flops_per_token(model: GPT, seq_len: int) -> float:
    """Training FLOPs per token, forward and backward: 6N + 12·L·H·Q·T (tasks/flops.py). N is
    every parameter but the position table; the token embedding counts once, as the output
    head it is tied to."""
    cfg = model.cfg
    return decoder_flops_per_token(
        matmul_parameters(model), cfg.n_layer, cfg.n_head, cfg.d_model // cfg.n_head, seq_len
    )
