"""The device mesh a plan runs on, over the job's process group, timing out as the job does; and the
model every rank starts from.

``init_device_mesh`` creates a process group per mesh dim (beyond a 1-D mesh over the whole world) with
torch's default timeout (30 minutes on gloo), whatever ``init_process_group(timeout=...)`` the job was
given: a rank that hangs would then stall its mesh-dim peers for half an hour. Here every dim's group
takes the job's own collective timeout, the one number a user sets (docs/architecture.md "Failing ranks").

Every rank builds the whole model and keeps only its shards of it (``passes/shard_parameters.py`` slices
locally, with no communication), so the ranks must build the same weights. ``start_from_rank_zero`` makes
sure they do, as DDP's constructor does: a job that seeds each rank differently, or loads weights on one
rank only, would otherwise train replicas that never agree, without a word. (A model built on the meta device
is the exception: no rank builds it whole, ``runtime/deferred_init.py``.)
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def job_device_type() -> str:
    """The device the job's collectives run on: CUDA under NCCL, else the CPU (gloo)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def init_job_mesh(device_type: str, shape: tuple[int, ...], dim_names: tuple[str, ...]) -> DeviceMesh:
    """``init_device_mesh`` whose per-dim groups time out after the default process group's timeout."""
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=dim_names)
    timeout = job_collective_timeout(device_type)
    if timeout is not None:
        for dim in range(mesh.ndim):
            mesh.get_group(dim).set_timeout(timeout)
    return mesh


def job_collective_timeout(device_type: str) -> timedelta | None:
    """The timeout the job's default process group was initialized with (torch has no public getter);
    None for a backend without options (the ``fake`` group that plans large worlds runs no collective)."""
    options = getattr(dist.group.WORLD._get_backend(torch.device(device_type)), "options", None)
    return getattr(options, "_timeout", None)


def start_from_rank_zero(model: nn.Module) -> None:
    """Set every rank's parameters and buffers to rank 0's, in place: one broadcast per tensor over the
    whole job, through a copy on ``job_device_type()`` where the tensor lives elsewhere (a CPU model under
    NCCL, which the runtime moves to the GPU as it shards it). torch's ``_sync_module_states`` (DDP's)
    buckets the broadcasts but needs the tensors on the backend's device already, hence this loop.
    Tensors on the meta device hold no values to agree on: the runtime makes and initializes their shards
    (``runtime/deferred_init.py``)."""
    device = job_device_type()
    for tensor in (t for t in itertools.chain(model.parameters(), model.buffers()) if not t.is_meta):
        data = tensor.detach()
        on_device = data.to(device)
        dist.broadcast(on_device, src=0)
        if on_device is not data:
            data.copy_(on_device)
