"""A model whose first input is a 0-dim tensor (a scale read by every sample), then the batch.

Loaded by spec ``scalar_input_model:make`` (``build_model`` imports it, in spawned ranks too).
"""

from __future__ import annotations

import torch
from torch import nn


class ScaledMLP(nn.Module):
    """A stack of alike blocks, so that pipelines cut it; every block reads the scale (later stages too)."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.fc_in = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(blocks))
        self.fc_out = nn.Linear(32, 8)

    def forward(self, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc_in(x))
        for block in self.blocks:
            h = torch.relu(block(h)) * scale
        return self.fc_out(h)


def make(global_batch: int = 8):
    x, targets = torch.randn(global_batch, 16), torch.randn(global_batch, 8)
    return ScaledMLP(), (torch.tensor(0.5), x), targets, nn.functional.mse_loss
