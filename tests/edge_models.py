"""Small models at the edges of what the planner and runtimes meet in the wild, for parity runs.

Loaded by spec ``edge_models:NAME`` (``build_model`` imports it, in spawned ranks too):

* ``experts``: a stack of expert matrices applied by ``torch.bmm`` to every token (its weights' expert dim is the
  bmm's batch dim, so an ep dim may split them), a mean-squared loss that an ep dim leaves ``Partial(avg)``,
  and a router it never uses (a parameter without a gradient);
* ``grouped_conv``: ``Conv1d`` and ``GroupNorm``, whose DTensor backward fails on a batch split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    def __init__(self, width: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.router = nn.Linear(width, experts)  # unused: no gradient, in single-process training too
        self.w1 = nn.Parameter(torch.randn(experts, width, 2 * width) / 4)
        self.w2 = nn.Parameter(torch.randn(experts, 2 * width, width) / 4)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        b, t, d = h.shape
        tokens = h.reshape(1, b * t, d).expand(self.w1.shape[0], b * t, d)
        y = torch.bmm(torch.bmm(tokens, self.w1).relu(), self.w2)
        return self.out(y.mean(0).reshape(b, t, d)).squeeze(-1)


def experts(global_batch: int = 8, seq: int = 8):
    return Experts(), torch.randn(global_batch, seq, 8), torch.randn(global_batch, seq), F.mse_loss


class GroupedConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.silu(self.norm(self.conv(x))).mean(-1))


def grouped_conv(global_batch: int = 8, seq: int = 32):
    return GroupedConv(), torch.randn(global_batch, 4, seq), torch.randint(0, 5, (global_batch,)), F.cross_entropy
