"""GPT-2/GPT-3 style decoder-only transformer.

Token + learned position embeddings, pre-LayerNorm blocks (causal self
attention with separate q/k/v/o projections, GELU(tanh) MLP), a final
LayerNorm and a bias-free ``lm_head``. Written with export-friendly ops only
(see :mod:`autopar.models.common`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.core.errors import BadInputError

from .common import (
    ATTENTION_KINDS,
    causal_attention,
    check_positive,
    init_weights,
    merge_heads,
    split_heads,
)

__all__ = ["GPTConfig", "GPT", "GPTBlock", "GPTAttention", "GPTMLP"]


@dataclass
class GPTConfig:
    """Hyper-parameters of a GPT model."""

    layers: int  # number of transformer blocks
    hidden: int  # model (embedding) width
    heads: int  # attention heads; must divide hidden
    vocab: int  # vocabulary size
    seq: int  # maximum sequence length (size of the position table)
    mlp_ratio: int = 4  # MLP inner width as a multiple of hidden
    tie_embeddings: bool = False  # share the token embedding with lm_head
    bias: bool = True  # biases in the block Linears and LayerNorms
    attention: str = "fused"  # "fused" (SDPA) or "eager" (materialized scores, as Megatron-LM in 2021)

    def __post_init__(self) -> None:
        check_positive(self, ("layers", "hidden", "heads", "vocab", "seq", "mlp_ratio"))
        if self.attention not in ATTENTION_KINDS:
            raise BadInputError(f"attention={self.attention!r}: expected one of {', '.join(ATTENTION_KINDS)}")
        if self.hidden % self.heads:
            raise BadInputError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")


class GPTAttention(nn.Module):
    """Multi-head causal self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.attention = cfg.attention
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = split_heads(self.q_proj(x), self.heads)
        k = split_heads(self.k_proj(x), self.heads)
        v = split_heads(self.v_proj(x), self.heads)
        return self.o_proj(merge_heads(causal_attention(q, k, v, self.attention)))


class GPTMLP(nn.Module):
    """Two-layer MLP with a tanh-approximated GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        inner = cfg.mlp_ratio * cfg.hidden
        self.fc_in = nn.Linear(cfg.hidden, inner, bias=cfg.bias)
        self.fc_out = nn.Linear(inner, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


class GPTBlock(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.attn = GPTAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT language model: ``forward(idx [b, s] long) -> logits [b, s, vocab]``.

    The position ids are non-persistent buffers held once on
    the top-level module; after ``to_empty`` from meta call
    :meth:`reset_buffers` (and :meth:`reset_parameters`) to fill them.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.register_buffer("pos_ids", torch.arange(cfg.seq), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise all weights (N(0, 0.02), zero biases, unit norms)."""
        init_weights(self)

    def reset_buffers(self) -> None:
        """Recompute the non-persistent buffers on their current device."""
        device = self.pos_ids.device
        self.pos_ids = torch.arange(self.config.seq, device=device)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(self.pos_ids[:seq])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
