"""Whether a plan fits the device this rank runs on, checked before the runtime builds anything.

A plan predicts each device's peak memory (``predicted.peak_memory_bytes``: parameters, gradients,
optimizer state and activations, for the device it was priced for). A plan made for a larger device, or
for a model too large for this machine, would otherwise run until the allocator fails mid-step (or, on
CPU, until the kernel's out-of-memory killer ends the rank without a word). ``check_plan_fits`` refuses
it up front with ``NoFeasiblePlanError``, naming both numbers and what to do.

This device's memory (``device_memory_bytes``): on CUDA the current device's total memory; on CPU the
host's memory (physical, or the cgroup's limit when a container sets a lower one) divided among the
ranks on this host (``LOCAL_WORLD_SIZE``, which torchrun sets; without it every rank of the job is taken
to be on this host, as ``autopar.api.local_cluster_spec`` assumes). The comparison is with the whole of
it: the planner already kept its reserve (``cost_models/memory.py``) when it chose the plan, so the
runtime refuses only a plan whose own prediction exceeds everything the device has.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.core.errors import NoFeasiblePlanError
from autopar.core.plan import Plan
from autopar.core.units import fmt_bytes

CGROUP_MEMORY_LIMIT = Path("/sys/fs/cgroup/memory.max")
"""cgroup v2's memory limit of this process's container: a number of bytes, or ``max`` for none."""


def check_plan_fits(plan: Plan, device_type: str) -> None:
    """Raise ``NoFeasiblePlanError`` if ``plan``'s predicted per-device peak exceeds this device's memory."""
    need = int(plan.predicted["peak_memory_bytes"])
    have, where = device_memory_bytes(device_type)
    if need <= have:
        return
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.predicted["memory_bytes"].items())
    priced = plan.cluster.get("hbm_bytes")
    raise NoFeasiblePlanError(
        f"the plan needs {fmt_bytes(need)} per device ({parts}), but this rank has {fmt_bytes(have)} ({where}); "
        f"the plan was priced for {plan.cluster.get('spec', 'another cluster')}"
        + (f" with {fmt_bytes(priced)} per device" if priced else "")
        + ". Re-plan for this machine (autoparallelize(..., plan=None, cluster=None)), run on more ranks, or pin "
        "checkpointing='full' or more microbatches; pass check_memory=False to run it anyway")


def device_memory_bytes(device_type: str) -> tuple[int, str]:
    """(bytes this rank may use, how they were found) on this host's ``device_type`` (``cuda`` or ``cpu``)."""
    if device_type == "cuda":
        index = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        return total, f"{torch.cuda.get_device_name(index)}, cuda:{index}"
    host, source = _host_memory_bytes()
    ranks = _ranks_on_this_host()
    return host // ranks, f"{source} {fmt_bytes(host)} shared by {ranks} rank{'s' * (ranks > 1)} on this host"


def _host_memory_bytes() -> tuple[int, str]:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = CGROUP_MEMORY_LIMIT.read_text().strip()
    except OSError:
        return physical, "physical memory"
    if limit.isdigit() and int(limit) < physical:
        return int(limit), "the container's memory limit"
    return physical, "physical memory"


def _ranks_on_this_host() -> int:
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    return dist.get_world_size() if dist.is_initialized() else 1
