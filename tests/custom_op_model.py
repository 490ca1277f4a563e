"""A model with an op DTensor has no sharding strategy for (a custom op), for the fallback tests.

Loaded by spec ``custom_op_model:make`` (``build_model`` imports it, in spawned ranks too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("autopar_test::soft_clip", mutates_args=())
def soft_clip(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2.0


@soft_clip.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return grad * 2.0 * (1 - torch.tanh(x) ** 2)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


soft_clip.register_autograd(_backward, setup_context=_setup)


class ClipMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(soft_clip(self.fc1(x)))


def make(global_batch: int = 8):
    model = ClipMLP()
    return model, (torch.randn(global_batch, 16),), torch.randn(global_batch, 8), F.mse_loss
