"""Small models of drawn shapes for the property tests: a residual stack of MLP, attention and norm blocks.

Loaded by spec ``random_models:stack`` (``build_model`` imports it, in spawned ranks too); the drawn sizes
arrive as its keyword arguments (the run's overrides). ``blocks`` names the stack from bottom to top, one
letter a block: ``m`` an MLP (Linear, GELU, Linear), ``a`` causal self-attention, ``n`` a LayerNorm, ``r``
an RMSNorm; each adds its output to the residual stream. A Linear head maps the stream to ``out`` features,
trained against random targets with the mean squared error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.common import RMSNorm, causal_attention, init_weights, merge_heads, mse_loss, split_heads

BLOCKS = "manr"


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t, self.heads) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(merge_heads(causal_attention(q, k, v)))


class Mlp(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(width, hidden)
        self.fc_out = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Stack(nn.Module):
    def __init__(self, blocks: str, width: int, hidden: int, heads: int, out: int) -> None:
        super().__init__()
        make = {"m": lambda: Mlp(width, hidden), "a": lambda: Attention(width, heads),
                "n": lambda: nn.LayerNorm(width), "r": lambda: RMSNorm(width)}
        self.blocks = nn.ModuleList(make[kind]() for kind in blocks)
        self.head = nn.Linear(width, out)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def stack(blocks: str = "man", width: int = 16, hidden: int = 32, heads: int = 2, out: int = 8, seq: int = 4,
          global_batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor], torch.Tensor, object]:
    """The model and an example batch: inputs ``[global_batch, seq, width]``, targets ``[..., out]``."""
    if not blocks or set(blocks) - set(BLOCKS) or width % heads:
        raise ValueError(f"blocks {blocks!r} must be letters of {BLOCKS!r} and heads {heads} must divide width {width}")
    model = Stack(blocks, width, hidden, heads, out)
    return model, (torch.randn(global_batch, seq, width),), torch.randn(global_batch, seq, out), mse_loss
