"""Shard parameters and buffers as the plan places them.

Every rank holds the same full tensor (same seed, or a loaded checkpoint) and keeps only its own
chunk: ``distribute_tensor`` with ``src_data_rank=None`` slices locally, with no communication.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.core.placement import strs_to_placements


def shard_tensor(tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[str]) -> DTensor:
    return distribute_tensor(tensor.detach(), mesh, strs_to_placements(placements), src_data_rank=None)


def shard_parameters(
    named: Mapping[str, torch.Tensor], placements: Mapping[str, Sequence[str]], mesh: DeviceMesh
) -> dict[str, nn.Parameter]:
    """fqn -> ``nn.Parameter`` wrapping a DTensor that holds this rank's shard, frozen where the model's
    parameter is (``requires_grad=False``: no gradient, so the optimizer leaves it as it is)."""
    missing = sorted(set(placements) - set(named))
    if missing:
        raise KeyError(f"the plan places parameters the model does not have: {', '.join(missing[:5])}")
    return {fqn: nn.Parameter(shard_tensor(named[fqn].detach(), mesh, placements[fqn]), named[fqn].requires_grad)
            for fqn in placements}
