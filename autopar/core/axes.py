"""Mesh axes: the names of device-mesh dims, as plans (``mesh["dim_names"]``) and DeviceMesh spell them.

One name, one meaning. A mesh axis names a dim of the device mesh; it is not a parallel degree. The
plan's ``degrees["dp"]`` counts every data-parallel rank (under HSDP, replicas x shards), while the mesh
axis spelled ``dp`` is only the inner of HSDP's two data-parallel dims: in code it is
``MeshAxis.DP_SHARD`` (torchtitan's ``dp_shard``), and the degree is ``MeshChoice.data_parallel_size``.
The spelled names stay those of ``autopar.plan/1``, so plan files and DeviceMesh dim names are unchanged.
"""

from __future__ import annotations

from enum import Enum


class MeshAxis(str, Enum):
    """A device-mesh dim. A ``str``: JSON and ``init_device_mesh(mesh_dim_names=...)`` take it as its name."""

    DP_REPLICATE = "dp_replicate"
    """HSDP's outer data-parallel dim, across nodes: parameters stay replicated over it."""
    DP_SHARD = "dp"
    """The data-parallel dim inside a replica group (without HSDP, every data-parallel rank): the batch is
    split over it, and parameters (``fsdp=3``) or optimizer state (ZeRO-1/2) may be sharded over it."""
    EP = "ep"
    """Expert parallelism: a data-parallel dim (the batch is split over it, dense parameters are replicated
    and their gradients all-reduced) over which expert weights are split on their expert dim, and the
    tokens move between the batch split and the expert split by all_to_all (``planning/roles.py``)."""
    CP = "cp"
    """Context parallelism: the user inputs are split on their sequence dim (dim 1) over it, parameters are
    replicated (their gradients all-reduced, as on ``dp``), and fused attention reads its queries split
    and its keys and values gathered (``planning/roles.py``, ``planning/strategies.py``)."""
    TP = "tp"
    """Tensor parallelism: weight matrices are split over it."""
    PP = "pp"
    """Pipeline stages: the runtime's outermost dim (``runtime/pipeline.py``); a plan's ``mesh`` is one
    stage's submesh, without it."""

    def __str__(self) -> str:  # the spelled name, as enum.StrEnum (Python 3.11+) gives it
        return self.value


DATA_PARALLEL_AXES = (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD)
"""The dims the batch is split over."""

ZERO_AXES = (MeshAxis.DP_SHARD, MeshAxis.CP)
"""The dims ZeRO-1/2 shards the optimizer state (and ZeRO-2 the gradients) over, as Megatron-Core's
distributed optimizer shards over its data-parallel group with context parallelism
(``parallel_state.get_data_parallel_group(with_context_parallel=True)``): ranks of both dims hold the same
parameters and reduce their gradients over both, so they can keep disjoint shards of the state."""
