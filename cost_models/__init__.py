"""autopar.cost_models: hardware catalog, cluster topology, and compute/communication/memory costs.

Lives in the top-level ``cost_models/`` folder; ``setup.cfg`` maps it to ``autopar.cost_models``.
It knows nothing of the solver or of autopar's other packages (it never imports ``autopar``):

* ``hardware``: DeviceSpec and the presets (A100, H100, H200, B200, cpu), dtype keys;
* ``cluster``: the ``NxGxTYPE`` spec, Cluster, and GroupTopology of a mesh dimension;
* ``comm``: collective_time, the single entry point for collective costs;
* ``compute``: compute_time, a roofline for one kernel;
* ``memory``: AdamW state bytes and usable HBM.
"""

from .cluster import Cluster, ClusterSpecError, GroupTopology, parse_cluster
from .comm import COLLECTIVES, collective_bytes_per_rank, collective_time
from .compute import compute_time, op_efficiency
from .hardware import DEVICES, DeviceSpec, dtype_key, get_device
from .memory import adamw_state_bytes, reserve_fraction, usable_bytes

__all__ = [
    "COLLECTIVES",
    "DEVICES",
    "Cluster",
    "ClusterSpecError",
    "DeviceSpec",
    "GroupTopology",
    "adamw_state_bytes",
    "collective_bytes_per_rank",
    "collective_time",
    "compute_time",
    "dtype_key",
    "get_device",
    "op_efficiency",
    "parse_cluster",
    "reserve_fraction",
    "usable_bytes",
]
