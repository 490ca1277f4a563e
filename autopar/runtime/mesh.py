"""The device mesh a plan runs on, over the job's process group, timing out as the job does.

``init_device_mesh`` creates a process group per mesh dim (beyond a 1-D mesh over the whole world) with
torch's default timeout (30 minutes on gloo), whatever ``init_process_group(timeout=...)`` the job was
given: a rank that hangs would then stall its mesh-dim peers for half an hour. Here every dim's group
takes the job's own collective timeout, the one number a user sets (docs/architecture.md "Failing ranks").
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


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
