"""ZeRO-1/2: the optimizer's parameters are shards; the program computes with whole (replicated) ones.

A plan with ``degrees["zero"]`` 1 or 2 replicates parameters on the data-parallel mesh dim (as DDP)
but prices each rank with only its share of the optimizer state, and under ZeRO-2 of the gradient
(Rajbhandari et al., "ZeRO", SC20). This pass makes that true at run time:

* **shards** (``ShardedOptimizerState.shards``): for every parameter that
  ``autopar.core.placement.optimizer_shard_dim`` can split, a second ``nn.Parameter`` holding this rank's
  slice of it over the ZeRO dims (``autopar.core.axes.ZERO_AXES``: ``dp``, and ``cp`` where the mesh has
  it, as Megatron-Core's distributed optimizer shards over dp x cp), ``Shard(d)`` on each where the plan
  says ``R`` (the same tensor dim on both: dp's slices, each cut again over cp);
  ``ParallelModule.parameters()`` hands these to the user's optimizer, so its state (AdamW's moments) is
  sharded with no change to the optimizer;
* **gather** before a step's first forward: each replicated parameter the program reads is refreshed
  from its shard (an all_gather on each ZeRO dim: the "parameter all_gather after the update" of ZeRO);
* **reduce** its gradient onto the shard: DTensor's ``Partial -> Shard`` redistribute, a
  reduce_scatter on each ZeRO dim (outermost first, each on what the one before left: DTensor runs them
  one mesh dim at a time, as ``Pricer.zero_share`` prices them), from a post-accumulate-grad hook as
  backward finishes the gradient. ZeRO-2 does it
  every microbatch, so the whole gradient is freed as soon as it is reduced and never accumulates
  across microbatches; ZeRO-1 once, during the last microbatch's backward (``arm``, as
  ``GradientSync``: the runtime says how many accumulations a step makes), overlapping what backward
  is left; what an unarmed step leaves is reduced by ``reduce_gradients`` after backward.

Under mixed precision (``passes/mixed_precision.py``) the shards are the fp32 master weights and
the whole parameters the program computes with are leaves in the compute dtype (``compute_dtype``), as
in Megatron-LM's distributed optimizer: the gather casts the updated shard first, so it moves
compute-dtype bytes, and the gradient, accumulated in the compute dtype, is reduce-scattered in
``reduce_dtype`` and lands on the shard in fp32.

Parameters it cannot split keep the plan's placement and are synchronized like DDP's
(``passes/gradient_sync.py``). Where we diverge from ``torch.distributed.optim.ZeroRedundancyOptimizer``
(which gives each rank whole parameters and broadcasts them after the step): that class owns the
optimizer and supports only ZeRO-1, while here the user's optimizer, whatever it is, sees DTensor
shards and the collectives are the reduce_scatter/all_gather pair that ``autopar.planning.pricing`` prices.
Where we diverge from DeepSpeed: collectives are per parameter, not over flat buckets (as FSDP2 shards
each parameter on its own).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.core.axes import ZERO_AXES
from autopar.core.placement import optimizer_shard_dim


class ShardedOptimizerState:
    """The shard parameters of ZeRO-1 (``stage`` 1) or ZeRO-2 (``stage`` 2) for ``params`` (key -> the
    parameter as the plan places it, replicated on dp and cp, in the optimizer's dtype) on ``mesh``. With
    ``compute_dtype`` the program's whole copy of each split parameter is a new leaf in that dtype
    (``full``); without, ``params`` themselves."""

    def __init__(self, params: Mapping[str, nn.Parameter], mesh: DeviceMesh, stage: int,
                 compute_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage {stage}: this pass runs stages 1 and 2 (3 is a sharded plan)")
        self.stage = stage
        self.mesh = mesh
        self.reduce_dtype = reduce_dtype
        self.shards = {key: nn.Parameter(_shard_of(p, dim, dims, mesh)) for key, p in params.items()
                       if (dims := _zero_dims(p, mesh)) and (dim := _shard_dim(p, dims, mesh)) is not None}
        self.full = {key: nn.Parameter(p.detach().to(compute_dtype)) if compute_dtype and key in self.shards else p
                     for key, p in params.items()}
        self._pending: dict[str, int] = {}  # ZeRO-1, armed: accumulations left before a gradient is reduced
        for key in self.shards:
            self.full[key].register_post_accumulate_grad_hook(lambda p, key=key: self._on_gradient(key))

    def unsharded(self) -> list[nn.Parameter]:
        """The program's parameters this pass leaves whole (their gradients need DDP's sync)."""
        return [p for key, p in self.full.items() if key not in self.shards]

    @torch.no_grad()
    def gather(self) -> None:
        """Refresh every replicated parameter from its (possibly updated) shard: one all_gather each."""
        for key, shard in self.shards.items():
            full = self.full[key]
            full.copy_(shard.to(full.dtype).redistribute(self.mesh, full.placements))

    def arm(self, accumulations: int = 1) -> None:
        """ZeRO-1: reduce-scatter each gradient as soon as the coming backward passes have accumulated
        it ``accumulations`` times (1: during the next backward)."""
        self._pending = {key: accumulations for key in self.shards}

    def _on_gradient(self, key: str) -> None:
        if self.stage == 2:
            self._reduce(key)
        elif key in self._pending:
            self._pending[key] -= 1
            if self._pending[key] == 0:
                del self._pending[key]
                self._reduce(key)

    def reduce_gradients(self) -> None:
        """After backward: ZeRO-1 reduce-scatters what backward has not (ZeRO-2 did it all in backward)."""
        if self.stage == 1:
            for key in self.shards:
                self._reduce(key)
        self._pending = {}

    def _reduce(self, key: str) -> None:
        full, shard = self.full[key], self.shards[key]
        if full.grad is None:
            return
        grad = full.grad.to(self.reduce_dtype or full.grad.dtype).redistribute(self.mesh, shard.placements)
        grad = grad.to(shard.dtype)
        full.grad = None
        shard.grad = grad if shard.grad is None else shard.grad + grad


def _zero_dims(param: nn.Parameter, mesh: DeviceMesh) -> list[int]:
    """The mesh dims (of ``ZERO_AXES``, in mesh order) this parameter's state is split over: those of more
    than one rank on which the plan replicates it."""
    if not isinstance(param, DTensor):
        return []
    names = mesh.mesh_dim_names or ()
    return [i for i, name in enumerate(names)
            if name in ZERO_AXES and param.placements[i] == Replicate() and mesh.size(i) > 1]


def _shard_dim(param: DTensor, dims: list[int], mesh: DeviceMesh) -> int | None:
    """The tensor dim split over the mesh ``dims`` together, as ``Pricer._zero_dims`` prices it."""
    ways = 1
    for i in dims:
        ways *= mesh.size(i)
    return optimizer_shard_dim(tuple(param.shape), param.placements, ways)


def _shard_of(param: DTensor, dim: int, dims: list[int], mesh: DeviceMesh) -> DTensor:
    """This rank's slice of ``param`` over the mesh ``dims``: slicing a replicated tensor needs no communication."""
    placements = [Shard(dim) if i in dims else p for i, p in enumerate(param.placements)]
    return param.detach().redistribute(mesh, placements).clone()
