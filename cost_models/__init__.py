"""autopar.cost_models: hardware catalog, cluster topology, and compute/communication/memory costs.

Lives in the top-level ``cost_models/`` folder; ``setup.cfg`` maps it to ``autopar.cost_models``.
It knows nothing of the solver or of autopar's other packages (it never imports ``autopar``):

* ``hardware``: DeviceSpec and the presets (A100, H100, H200, B200, cpu), dtype keys;
* ``cluster``: the ``NxGxTYPE`` spec, Cluster, and GroupTopology of a mesh dimension;
* ``symbolic``: the collective, pipeline and matmul formulas as sympy expressions, and their
  rendering for users (``render_collective``);
* ``comm``: collective_time, the single entry point for collective costs (evaluates ``symbolic``);
* ``pipeline``: bubble fraction and microbatches in flight of a pipeline schedule;
* ``compute``: compute_time, a roofline for one kernel with its host dispatch; adamw_step_time, the
  optimizer update;
* ``memory``: AdamW state bytes and usable HBM;
* ``calibrate``: measure the machine (matmuls, memory, op floor, collectives) and write a cluster
  profile (``autopar calibrate``); it imports torch, so it is imported by name, not here.
"""

from .cluster import Cluster, ClusterSpecError, GroupTopology, parse_cluster
from .comm import COLLECTIVES, collective_bytes_per_rank, collective_time
from .compute import (adamw_step_time, backward_kind, compute_time, dispatched_time,
                      matmul_kind, op_efficiency)
from .hardware import DEVICES, DeviceSpec, dtype_key, get_device
from .memory import adamw_state_bytes, reserve_fraction, usable_bytes
from .pipeline import SCHEDULES, microbatches_in_flight, pipeline_bubble_fraction

__all__ = [
    "COLLECTIVES",
    "DEVICES",
    "Cluster",
    "ClusterSpecError",
    "DeviceSpec",
    "GroupTopology",
    "SCHEDULES",
    "adamw_state_bytes",
    "adamw_step_time",
    "backward_kind",
    "collective_bytes_per_rank",
    "collective_time",
    "compute_time",
    "matmul_kind",
    "dispatched_time",
    "dtype_key",
    "get_device",
    "microbatches_in_flight",
    "op_efficiency",
    "parse_cluster",
    "pipeline_bubble_fraction",
    "reserve_fraction",
    "usable_bytes",
]
