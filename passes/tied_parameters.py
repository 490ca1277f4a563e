"""Parameters read by several pipeline stages: each stage holds a copy, their gradients are summed.

A weight tied across stages (GPT-2's, BERT's and the small Llama models' output layer is their input
embedding: the embedding runs on the first stage, the head on the last) is one parameter of the
model. As in Megatron-LM (``_allreduce_word_embedding_grads``), every stage that reads it holds a copy
of the same shard and, after the schedule's backward, the copies' gradients are all-reduced among
those stages' ranks at the same position of the stage mesh; each copy then holds the gradient of the
whole model, and an optimizer stepping them alike keeps them equal.

Inside one stage (a rank running several chunks that read it, or a plan without pipeline) the
parameter is one tensor and autograd already sums its uses. This is not a graph pass: like
``gradient_sync`` it acts on the runtime's gradients after backward, last, on the tensors the optimizer
steps (under ZeRO-1/2 the dp- (and cp-) sharded copies, whose shards sit alike on every stage).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .program import Stage


def stages_reading(chunks: Sequence[Stage], params: Mapping[str, str], pp: int) -> dict[str, tuple[int, ...]]:
    """fqn -> the pipeline stages that read it (chunk ``i`` runs on stage ``i mod pp``), for every
    parameter read on more than one stage."""
    readers: dict[str, set[int]] = {}
    for chunk in chunks:
        for name in chunk.program.placeholders:
            if name in params:
                readers.setdefault(params[name], set()).add(chunk.program.index % pp)
    return {fqn: tuple(sorted(stages)) for fqn, stages in readers.items() if len(stages) > 1}


class TiedGradientSync:
    """Sums, after backward, the gradients of this rank's copies of parameters tied across stages
    (``parameters``: fqn -> the tensor the optimizer steps), in ``reduce_dtype`` when one is given (the
    plan's ``precision.reduce``).

    Building it is collective: every rank of ``world_mesh`` (``pp x stage mesh``) creates the same
    process groups, one per set of stages sharing parameters and position in the stage mesh."""

    def __init__(self, tied: Mapping[str, tuple[int, ...]], world_mesh: DeviceMesh,
                 parameters: Mapping[str, nn.Parameter], timeout: timedelta | None,
                 reduce_dtype: torch.dtype | None = None):
        self._parameters = parameters
        self._reduce_dtype = reduce_dtype
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        me = dist.get_rank()
        for stages in sorted(set(tied.values())):
            for ranks in _ranks_per_position(world_mesh, stages):
                group = dist.new_group(ranks, timeout=timeout)
                if me in ranks:
                    self._groups[stages] = group
        self._mine = {fqn: self._groups[stages] for fqn, stages in tied.items() if fqn in parameters}

    def __call__(self) -> None:
        for fqn, group in self._mine.items():
            param = self._parameters[fqn]
            if not param.requires_grad:
                continue  # frozen: no copy has a gradient
            if param.grad is None:  # this stage reads its copy without a gradient (under torch.no_grad, say)
                param.grad = torch.zeros_like(param)
            grad = param.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            # reduce in row-major order: the copies' gradients may lie in memory differently (one made by
            # an embedding's backward, the other by a matmul's, transposed), and a collective adds storage
            summed = local.contiguous().to(self._reduce_dtype or local.dtype)
            dist.all_reduce(summed, group=group)
            if summed is not local:
                local.copy_(summed)

    def __len__(self) -> int:
        return len(self._mine)


def _ranks_per_position(world_mesh: DeviceMesh, stages: tuple[int, ...]) -> list[list[int]]:
    """For each position in the stage mesh, the global ranks at that position of ``stages``."""
    per_stage = [world_mesh.mesh[s].flatten().tolist() for s in stages]
    return [list(ranks) for ranks in zip(*per_stage)]
