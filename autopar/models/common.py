"""Shared building blocks for the built-in model families.

Everything here is written with plain, export-friendly aten ops so that a
model captured with ``torch.export.export(..., strict=False)`` and decomposed
to core aten maps cleanly onto DTensor's registered sharding strategies:
fused causal attention (``F.scaled_dot_product_attention``, which never materializes the
s x s score matrix; autopar plans it with its own batch/head rule), rotary tables held in
non-persistent buffers, and no dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.core.errors import BadInputError

__all__ = [
    "RMSNorm",
    "check_positive",
    "causal_attention",
    "ATTENTION_KINDS",
    "split_heads",
    "merge_heads",
    "init_weights",
    "lm_loss",
    "mse_loss",
    "INIT_STD",
]

INIT_STD = 0.02


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[b, s, n_heads * hd] -> [b, n_heads, s, hd]`` via view + transpose."""
    b, s, h = x.shape
    return x.view(b, s, n_heads, h // n_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[b, nh, s, hd] -> [b, s, nh * hd]`` (inverse of :func:`split_heads`)."""
    b, nh, s, hd = x.shape
    return x.transpose(1, 2).reshape(b, s, nh * hd)


ATTENTION_KINDS = ("fused", "eager")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str = "fused") -> torch.Tensor:
    """Causal scaled dot-product attention; ``q, k, v`` are ``[b, nh, s, hd]``.

    ``fused``: one SDPA kernel (flash/memory-efficient attention) that never materializes the s x s
    scores. ``eager``: the scores are computed, masked and soft-maxed as separate ops, as in
    Megatron-LM before flash attention (Narayanan et al., SC21, whose published runs autopar's cost
    model is validated against).
    """
    if kind == "fused":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v


def check_positive(cfg: object, names: tuple[str, ...]) -> None:
    """Raise BadInputError if any of the named integer config fields is < 1."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise BadInputError(f"{name} must be >= 1, got {getattr(cfg, name)}")


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x * rsqrt(mean(x^2) + eps) * weight`` (no bias)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Set the scale back to ones."""
        with torch.no_grad():
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x * rms * self.weight


def is_meta(module: nn.Module) -> bool:
    """Whether every parameter of ``module`` lives on the meta device (and it has some)."""
    params = list(module.parameters())
    return bool(params) and all(p.is_meta for p in params)


@torch.no_grad()
def init_weights(module: nn.Module, std: float = INIT_STD) -> None:
    """Deterministically (given the RNG state) initialise every submodule.

    Linear / Embedding weights ~ N(0, std), biases 0, norm weights 1 and norm
    biases 0. Modules are visited in registration order, so the result only
    depends on ``torch.manual_seed``. A no-op on the meta device, where there are no values to set
    (and each init call would run torch's Python reference kernels: a third of building a 70B model).
    """
    if is_meta(module):
        return
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            nn.init.normal_(sub.weight, mean=0.0, std=std)
            if getattr(sub, "bias", None) is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.LayerNorm):
            if sub.weight is not None:
                nn.init.ones_(sub.weight)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, RMSNorm):
            nn.init.ones_(sub.weight)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy: ``logits [b, s, V]``, ``targets [b, s]`` long."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))


def mse_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error between ``output`` and float ``targets``."""
    return F.mse_loss(output, targets)
