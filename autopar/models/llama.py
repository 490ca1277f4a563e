"""Llama-3 style decoder-only transformer.

Token embedding, pre-norm blocks with rotary (rotate-half, from cached
cos/sin buffers) grouped-query attention and an MLP, a final norm and
an ``lm_head``. No biases anywhere. Written with export-friendly ops only
(see :mod:`autopar.models.common`).

The MLP and the norm are Llama's by default (SwiGLU, RMSNorm); ``mlp="squared-relu"`` and
``norm="layernorm"`` give Nemotron-4's instead (Parmar et al., "Nemotron-4 15B Technical Report",
arXiv:2402.16819, section 2: "squared ReLU activations in the MLP layers, no bias terms"; its NeMo
configs, e.g. NVIDIA/dgxc-benchmarking nemotron/nemotron4-340b-synth.yaml: ``activation: squared-relu``,
``normalization: layernorm1p``, ``bias: false``). ``layernorm1p`` stores the LayerNorm scale as
``weight - 1`` (zero-centred); that reparametrisation changes neither the ops nor their cost, so the
plain LayerNorm stands for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.core.errors import BadInputError

from .common import (
    RMSNorm,
    check_positive,
    init_weights,
    merge_heads,
    split_heads,
)

__all__ = [
    "LlamaConfig",
    "Llama",
    "LlamaBlock",
    "LlamaAttention",
    "SwiGLU",
    "SquaredReLUMLP",
    "RMSNorm",
    "MLP_KINDS",
    "NORM_KINDS",
    "rope_tables",
    "apply_rope",
    "grouped_causal_attention",
]


MLP_KINDS = ("swiglu", "squared-relu")
"""``swiglu``: ``w2(silu(w1 x) * w3 x)``, three matrices (Llama); ``squared-relu``: ``w2(relu(w1 x)^2)``,
two matrices (Nemotron-4)."""
NORM_KINDS = ("rmsnorm", "layernorm")
"""``rmsnorm``: RMSNorm (Llama); ``layernorm``: LayerNorm without bias (Nemotron-4)."""


@dataclass
class LlamaConfig:
    """Hyper-parameters of a Llama model."""

    layers: int  # number of transformer blocks
    hidden: int  # model (embedding) width
    heads: int  # query heads; must divide hidden
    kv_heads: int  # key/value heads (grouped-query attention); must divide heads
    vocab: int  # vocabulary size
    seq: int  # maximum sequence length (size of the rotary tables)
    ffn_hidden: int  # MLP inner width
    rope_theta: float = 500000.0  # rotary embedding base
    norm_eps: float = 1e-5  # norm epsilon
    mlp: str = "swiglu"  # one of MLP_KINDS
    norm: str = "rmsnorm"  # one of NORM_KINDS

    def __post_init__(self) -> None:
        check_positive(self, ("layers", "hidden", "heads", "kv_heads", "vocab", "seq", "ffn_hidden"))
        _check_choice("mlp", self.mlp, MLP_KINDS)
        _check_choice("norm", self.norm, NORM_KINDS)
        if self.hidden % self.heads:
            raise BadInputError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise BadInputError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise BadInputError(f"head dim hidden/heads ({self.head_dim}) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise BadInputError naming ``name`` and the valid ``choices`` unless ``value`` is one of them."""
    if value not in choices:
        raise BadInputError(f"{name}={value!r}: expected one of {', '.join(choices)}")


def rope_tables(
    seq: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(cos, sin)`` of shape ``[seq, head_dim]`` for rotate-half rotary.

    Uses the default dtype and plain torch ops, so it also works on meta.
    """
    dtype = torch.get_default_dtype()
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    positions = torch.arange(seq, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` along the last dim."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, nh, s, hd]`` by the ``[s, hd]`` cos/sin tables."""
    return x * cos + _rotate_half(x) * sin


def grouped_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal fused attention of ``q [b, nh, s, hd]`` against ``k, v [b, nkv, s, hd]`` (``nkv`` divides
    ``nh``): each key-value head serves its group of ``nh / nkv`` consecutive query heads, read where it
    is, never copied out per query head (grouped attention as Megatron-LM and NeMo run it). One SDPA op
    with ``enable_gqa``, which autopar captures and prices as any fused attention, and splits on heads
    where the key-value heads split too (``planning/strategies.LOCAL_RULES``)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[-3] != q.shape[-3])


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.kv_heads = cfg.kv_heads
        kv_width = cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        q = apply_rope(split_heads(self.q_proj(x), self.heads), cos, sin)
        k = apply_rope(split_heads(self.k_proj(x), self.kv_heads), cos, sin)
        v = split_heads(self.v_proj(x), self.kv_heads)
        out = grouped_causal_attention(q, k, v)
        return self.o_proj(merge_heads(out))


class SwiGLU(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SquaredReLUMLP(nn.Module):
    """Two-matrix MLP with a squared ReLU: ``w2(relu(w1 x)^2)`` (So et al., "Primer", NeurIPS 2021;
    Nemotron-4's MLP)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)).square())


def make_mlp(cfg: LlamaConfig) -> nn.Module:
    """The MLP ``cfg.mlp`` names."""
    return SwiGLU(cfg) if cfg.mlp == "swiglu" else SquaredReLUMLP(cfg)


def make_norm(cfg: LlamaConfig) -> nn.Module:
    """The norm ``cfg.norm`` names, over ``cfg.hidden``."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=False)


class LlamaBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = make_mlp(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama language model: ``forward(idx [b, s] long) -> logits [b, s, vocab]``.

    The rotary tables are non-persistent buffers held once on
    the top-level module; after ``to_empty`` from meta call
    :meth:`reset_buffers` (and :meth:`reset_parameters`) to fill them.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.seq, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise all weights (N(0, 0.02), unit norms)."""
        init_weights(self)

    def reset_buffers(self) -> None:
        """Recompute the non-persistent buffers on their current device/dtype."""
        cfg, device, dtype = self.config, self.rope_cos.device, self.rope_cos.dtype
        cos, sin = rope_tables(cfg.seq, cfg.head_dim, cfg.rope_theta, device=device)
        self.rope_cos, self.rope_sin = cos.to(dtype), sin.to(dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm_f(x))
