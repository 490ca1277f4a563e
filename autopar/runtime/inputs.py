"""User inputs as the plan places them, one microbatch at a time.

Both runtimes run the program at the microbatch shape (it was captured at that shape) and take each
input either as the global microbatch, of which every rank keeps its shard, or with ``local=True`` as
this rank's slice of it already.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.core.errors import BadInputError
from autopar.core.placement import strs_to_placements
from autopar.core.plan import Plan
from autopar.passes import shard_tensor


def microbatch_shape(shape: Sequence[int], microbatches: int) -> list[int]:
    """The global shape of one microbatch of an input whose whole-batch shape is ``shape``."""
    shape = list(shape)
    return [shape[0] // microbatches] + shape[1:] if shape else shape


def user_input(plan: Plan, mesh: DeviceMesh, name: str, x: torch.Tensor, local: bool) -> DTensor:
    """One microbatch of the input (or targets) ``name`` as a DTensor with the plan's placements."""
    spec = plan.inputs[name]
    shape = microbatch_shape(spec["shape"], plan.pipeline.microbatches)
    if local:
        return DTensor.from_local(x, mesh, strs_to_placements(spec["placements"]), run_check=False,
                                  shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
    if list(x.shape) != shape:
        raise BadInputError(f"input {name} has shape {list(x.shape)} per microbatch, the plan was made for "
                            f"{shape} (pass local=True for per-rank slices)")
    return shard_tensor(x, mesh, spec["placements"])
