"""Counting the collectives a step runs on real ranks, to hold them against what the plan predicts
(``autopar.inspect.collectives.predicted_collectives``; docs/architecture.md "Correctness").
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.core.plan import DTENSOR

_OP_KINDS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
    "send": "send_recv",
}
"""Collective ops (functional collectives, and c10d ops such as the gradient sync's ``dist.all_reduce``)
by the name of the op, to the kinds plans use."""
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd", "recv_", "recv_any_source_"}
"""Ops of the collective namespaces not counted: those that move no data (waiting on a collective,
wrapping its result), and the receiving half of a point-to-point exchange, counted by its send
(``send_recv``: ring attention's exchanges, ``passes/ring_attention.py``)."""


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives run inside it, per plan kind (``counts``): to hold a step's collectives
    against ``predicted_collectives``; ``dtypes`` records the dtypes each kind moved.

    Where we diverge from ``torch.distributed.tensor.debug.CommDebugMode``, which counts the same way
    (letting DTensor desugar first, then counting the collective ops it dispatches): its module
    tracker fails when a module runs forward again after a backward, as ``ParallelModule.step`` does
    with several microbatches."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.dtypes: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run and desugar into the collectives counted below
        name = getattr(func, "_overloadpacket", func).__name__
        if getattr(func, "namespace", None) in ("c10d", "_c10d_functional") and name not in _NOT_COLLECTIVES:
            kind = _OP_KINDS.get(name, name)  # a collective no plan predicts keeps its own name
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.dtypes.setdefault(kind, set()).update(_tensor_dtypes(args))
        return func(*args, **(kwargs or {}))


def _tensor_dtypes(args: tuple) -> set[torch.dtype]:
    """The dtypes of the tensors a collective was given (directly or in a list)."""
    flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
    return {a.dtype for a in flat if isinstance(a, torch.Tensor)}


def planned_for_dtensor(constraints: Mapping[str, Any] | None) -> dict[str, Any]:
    """``constraints`` for a plan run on the DTensor runtime: priced for it (``runtime=dtensor``) unless they
    pin a runtime."""
    return {"runtime": DTENSOR, **(constraints or {})}


def counted_step(name: str, overrides: Mapping[str, Any] | None, global_batch: int,
                 constraints: Mapping[str, Any], step: bool = True) -> dict[str, Any]:
    """On this rank: the built-in ``name`` planned under ``constraints`` for this world and the DTensor
    runtime (``runtime=dtensor`` unless they pin one), and parallelized on it (its collectives are the
    plan's, one per redistribute; the lowered runtime's buckets merge some: ``tests/test_lowering.py``),
    then one forward and (with ``step``) one training step on one batch, each counted: the plan as JSON,
    and the collectives of the forward and of the step per kind."""
    from autopar.api import autoparallelize
    from autopar.models import build_model
    from autopar.testing.parity import batches

    bundle = build_model(name, overrides=overrides, global_batch=global_batch, device="cpu")
    pm = autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                         example_targets=bundle.example_targets, constraints=planned_for_dtensor(constraints),
                         lowered=False)
    (batch,) = batches(bundle, 1, seed=0)
    with CollectiveCounter() as forward:
        pm(*batch)
    counted: dict[str, Any] = {"plan": pm.plan.to_dict(), "forward": forward.counts, "microbatches": pm.microbatches}
    if step:
        with CollectiveCounter() as stepped:
            pm.step(*batch)
        counted["step"] = stepped.counts
    return counted


def as_run_on_gloo(counts: Mapping[str, int]) -> dict[str, int]:
    """Predicted collective counts as gloo runs them: DTensor's S(i) -> S(j) all_to_all
    (``shard_dim_alltoall``) runs as an all_gather and a local chunk on CPU/gloo, which has no all_to_all of
    the kind it needs: counted as one all_gather."""
    out = {k: v for k, v in counts.items() if k != "all_to_all"}
    if counts.get("all_to_all"):
        out["all_gather"] = out.get("all_gather", 0) + counts["all_to_all"]
    return out
