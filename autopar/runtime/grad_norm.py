"""The gradient norm of the whole model, and clipping by it, on any plan.

``torch.nn.utils.clip_grad_norm_`` over ``pm.parameters()`` measures the parameters it is given. Under a
one-stage plan those are DTensors of the whole model, and DTensor's arithmetic reduces each shard's part of
the norm: the norm is the one-process norm. Under a pipeline they are only this rank's stages' parameters,
so each stage would clip by a norm of its own (on tiny-gpt, pp=2: 1.64 and 1.42 where the model's is 2.17),
and the ranks would train apart from one process without a word. ``clip_grad_norm`` adds the stages' parts
over the pipeline's group, counting a weight tied across stages (whose copies hold the same, summed
gradient) on its first stage only, as torchtitan adds its pipeline stages' norms; then every rank clips by
the same total, as ``torch.nn.utils.clip_grads_with_norm_`` does.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.runtime.mesh import job_device_type


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False, foreach: bool | None = None,
                   stage_group: dist.ProcessGroup | None = None,
                   counted: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that the model's total ``norm_type``-norm is at most
    ``max_norm``; returns that total norm (before clipping), a plain tensor equal on every rank.

    ``counted``: the parameters whose gradients make up this rank's part of the norm (default: all of
    ``parameters``); ``stage_group``: the pipeline's group over which the stages' parts add up."""
    parameters = [p for p in parameters if p.grad is not None]
    counted_grads = [p.grad for p in (parameters if counted is None else counted) if p.grad is not None]
    total = _whole(torch.nn.utils.get_total_norm(counted_grads, norm_type, False, foreach)
                   if counted_grads else torch.zeros(()), norm_type, stage_group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total.item()}: non-finite, "
                           "so they cannot be clipped (error_if_nonfinite=False clips by it all the same)")
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach)
    return total


def _whole(norm: torch.Tensor, norm_type: float, stage_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``norm`` (this rank's part, a DTensor's parts reduced over its mesh) over the whole model."""
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    if stage_group is None:
        return norm
    part = norm.detach().double().to(job_device_type())
    if math.isinf(norm_type):
        dist.all_reduce(part, op=dist.ReduceOp.MAX, group=stage_group)
        return part.to(norm.device, norm.dtype)
    part = part ** norm_type
    dist.all_reduce(part, group=stage_group)
    return (part ** (1.0 / norm_type)).to(norm.device, norm.dtype)
