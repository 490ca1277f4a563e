"""A small multi-layer perceptron used by quick tests and the demo."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from autopar.core.errors import BadInputError

from .common import check_positive, init_weights

__all__ = ["MLP", "MLPConfig"]


@dataclass
class MLPConfig:
    """Shape of the ``mlp`` preset: in_dim -> hidden x (layers-1) -> out_dim."""

    in_dim: int = 64  # input features
    hidden: int = 256  # width of every hidden layer
    layers: int = 3  # number of Linear layers (>= 1)
    out_dim: int = 64  # output features

    def __post_init__(self) -> None:
        check_positive(self, ("in_dim", "hidden", "layers", "out_dim"))

    @property
    def dims(self) -> list[int]:
        """Layer widths including input and output, e.g. ``[64, 256, 256, 64]``."""
        return [self.in_dim] + [self.hidden] * (self.layers - 1) + [self.out_dim]


class MLP(nn.Module):
    """Stack of ``Linear`` + ``ReLU`` (no ReLU after the last Linear).

    ``dims = [d0, d1, ..., dn]`` gives ``n`` Linear layers ``d_i -> d_{i+1}``.
    """

    def __init__(self, dims: Sequence[int]) -> None:
        super().__init__()
        dims = list(dims)
        if len(dims) < 2:
            raise BadInputError(f"MLP needs at least two dims, got {dims}")
        self.dims = dims
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise all weights (N(0, 0.02), zero biases)."""
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last:
                x = torch.relu(x)
        return x
