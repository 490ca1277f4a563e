"""User inputs as the plan places them, one microbatch at a time.

Both runtimes run the program at the microbatch shape (it was captured at that shape) and take each
input either as the global microbatch, of which every rank keeps its shard, or with ``local=True`` as
this rank's slice of it already. What a step is given is checked first (``check_user_inputs``): as many
tensors as the plan has inputs, each of the planned dtype and shape (global, or this rank's slice). Each
microbatch's loss is weighted as the loss reduces the batch (``microbatch_weights``).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar.core.batch import batch_carriers
from autopar.core.errors import BadInputError
from autopar.core.placement import strs_to_placements
from autopar.core.plan import Plan
from autopar.ir.loss_reduction import LossReduction
from autopar.passes import shard_tensor
from autopar.passes.sequence_layout import in_layout


def carries_batch(plan: Plan, name: str) -> bool:
    """Whether the planned input (or targets) ``name`` carries the batch on dim 0 (``core/batch.batch_carriers``
    of the plan's inputs, in their order); one that does not is read whole by every rank and microbatch."""
    names = list(plan.inputs)
    return batch_carriers([plan.inputs[n]["shape"] for n in names])[names.index(name)]


def microbatch_shape(plan: Plan, name: str, microbatches: int) -> list[int]:
    """The global shape of one of ``microbatches`` microbatches of the planned input ``name``: cut on dim 0
    where it carries the batch (``carries_batch``), else whole."""
    shape = list(plan.inputs[name]["shape"])
    return [shape[0] // microbatches] + shape[1:] if carries_batch(plan, name) else shape


def pipeline_chunk_spec(carries: bool) -> Any:
    """How ``torch.distributed.pipelining`` cuts an input into microbatches, as ``microbatch_shape`` does: on
    dim 0 where it ``carries`` the batch, else repeated whole (its ``_Replicate``, a private name: the public
    ``TensorChunkSpec`` cuts every tensor)."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    return TensorChunkSpec(0) if carries else _Replicate


def check_user_inputs(plan: Plan, mesh: DeviceMesh, names: Sequence[str], tensors: Sequence[Any], local: bool,
                      microbatches: int, call: str) -> None:
    """Refuse what ``call`` (``step()``: the plan's ``microbatches``; ``forward()``: one) was given unless it
    is one tensor per planned input (the inputs, then the targets) of the planned dtype and shape."""
    if len(tensors) != len(names):
        raise BadInputError(f"{call} takes {len(names)} tensors (the inputs, then the targets if the step has "
                            f"any), got {len(tensors)}")
    for i, (name, x) in enumerate(zip(names, tensors), 1):
        what = f"{call} argument {i} ({name})"
        if not isinstance(x, torch.Tensor):
            raise BadInputError(f"{what} must be a tensor, got {type(x).__name__}")
        dtype = plan.inputs[name].get("dtype")
        if dtype is not None and str(x.dtype).removeprefix("torch.") != dtype:
            raise BadInputError(f"{what} has dtype {str(x.dtype).removeprefix('torch.')}, the plan was made for "
                                f"{dtype}")
        expected, whole = _expected_shape(plan, mesh, name, local, microbatches)
        if list(x.shape) != expected:
            scope = (f"this rank's slice with local=True (of the global shape {whole})" if local
                     else "the global shape (pass local=True to give this rank's slice)")
            raise BadInputError(f"{what} has shape {list(x.shape)}, expected {expected}: {scope}")


def _expected_shape(plan: Plan, mesh: DeviceMesh, name: str, local: bool, microbatches: int
                    ) -> tuple[list[int], list[int]]:
    """(the shape ``name`` must have, its global shape) for ``microbatches`` microbatches."""
    spec = plan.inputs[name]
    one = microbatch_shape(plan, name, plan.pipeline.microbatches)
    factor = microbatches if carries_batch(plan, name) else 1
    whole = _rows_times(one, factor)
    if not local:
        return whole, whole
    mine, _ = compute_local_shape_and_global_offset(one, mesh, strs_to_placements(spec["placements"]))
    return _rows_times(list(mine), factor), whole


def _rows_times(shape: list[int], factor: int) -> list[int]:
    return [shape[0] * factor] + shape[1:] if shape else shape


def user_input_shard(plan: Plan, mesh: DeviceMesh, name: str, x: torch.Tensor, local: bool) -> torch.Tensor:
    """This rank's shard of one microbatch of ``name``: the local tensor of ``user_input``'s DTensor without
    making one (``x`` itself with ``local=True``), cut as ``distribute_tensor`` cuts it (DTensor's own local
    shape and offset). A lowered pipeline chunk that reads its inputs as local tensors takes this: a
    DTensor made and unmade per microbatch costs about 0.1 ms of host time."""
    if local:
        return x
    spec = plan.inputs[name]
    whole = in_layout(x, plan, spec["placements"])
    region = _shard_region(tuple(whole.shape), mesh, tuple(spec["placements"]))
    return (whole if region is None else whole[region]).contiguous()


@functools.lru_cache(maxsize=64)
def _shard_region(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[str, ...]) -> tuple[slice, ...] | None:
    """This rank's region of a tensor of ``shape`` split with ``placements`` over ``mesh`` (None: all of it),
    as DTensor cuts it; the same for every microbatch of a step and every step, so worked out once."""
    shape_here, offset = compute_local_shape_and_global_offset(shape, mesh, strs_to_placements(placements))
    if tuple(shape_here) == shape:
        return None
    return tuple(slice(start, start + size) for start, size in zip(offset, shape_here))


def user_input(plan: Plan, mesh: DeviceMesh, name: str, x: torch.Tensor, local: bool) -> DTensor:
    """One microbatch of the input (or targets) ``name`` as a DTensor with the plan's placements (``x``
    was checked by ``check_user_inputs``). Under context parallelism's load-balanced layout this rank's
    slice of the sequence is its two chunks (``passes/sequence_layout.py``): with ``local=True``, give
    those, chunk r then chunk 2cp-1-r of 2cp for cp rank r."""
    spec = plan.inputs[name]
    shape = microbatch_shape(plan, name, plan.pipeline.microbatches)
    if x.requires_grad:  # differentiable, as DTensor's own constructors are
        if local:
            return DTensor.from_local(x, mesh, strs_to_placements(spec["placements"]), run_check=False,
                                      shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
        return shard_tensor(in_layout(x, plan, spec["placements"]), mesh, spec["placements"])
    shard = x if local else user_input_shard(plan, mesh, name, x, False)
    made = _input_spec(tuple(shape), mesh, id(mesh), tuple(spec["placements"]), x.dtype)
    return DTensor(shard, made, requires_grad=False)


@functools.lru_cache(maxsize=64)
def _input_spec(shape: tuple[int, ...], mesh: DeviceMesh, mesh_id: int, placements: tuple[str, ...],
                dtype: torch.dtype) -> DTensorSpec:
    """The spec of a user input of global ``shape`` and ``dtype`` placed so: made once, where ``distribute_tensor``
    (or ``from_local``) would work it out, with its checks, for every input of every step (about 0.1 ms each).
    ``mesh_id`` (``id(mesh)``) keys the cache by the mesh object, since meshes compare by value and a spec holds
    its own: each program gets specs of its mesh (which the cached spec keeps alive, so no other mesh takes its
    id while it is cached)."""
    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), dtype)
    return DTensorSpec(mesh, tuple(strs_to_placements(placements)), tensor_meta=meta)


def microbatch_weights(reduction: LossReduction, pieces: Sequence[Sequence[torch.Tensor]], plan: Plan,
                       mesh: DeviceMesh, names: Sequence[str], local: bool) -> list[float]:
    """Each microbatch's weight in the step's loss (``ir/loss_reduction.py``: with them the microbatches' losses
    and gradients add up to the global batch's), from its user inputs ``pieces`` (named ``names``). Given as
    this rank's slices (``local``), a divisor is computed on their DTensors, which reduce it over the ranks
    holding the rest of the microbatch."""
    def divisor_on_shards(piece: Sequence[torch.Tensor]) -> torch.Tensor:
        values = reduction.divisor(*(user_input(plan, mesh, names[i], piece[i], True) for i in reduction.reads))
        return torch.stack([(v.full_tensor() if isinstance(v, DTensor) else v).double().reshape(()) for v in values])

    return reduction.weights(pieces, divisor_on_shards if local else None)
