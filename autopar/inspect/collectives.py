"""The collectives one training step runs, as the plan predicts them: a count per kind.

Derived from the collectives the planner records per op (``plan.ops[name]["collectives"]``, built by
``planning/explanations.py``'s ``collective_terms`` from ``Pricer.edge_collectives`` and
``Pricer.gradient_collectives``), the way the runtime (``ParallelModule.step``) issues them:

* every op's forward and backward collectives run once per microbatch, since the whole program
  (forward, loss, backward) runs once per microbatch: parameter gathers and activation collectives
  alike;
* the gradient all_reduces of parameters (``grad_sync``) run once per step, after the last
  microbatch, in buckets: gradients are grouped by the mesh dims they are partial on and cut into
  25 MB buckets by the rule ``passes/gradient_sync.py`` applies, and each bucket is one all_reduce
  per partial mesh dim;
* under ZeRO-1/2 (``passes/zero.py``) a parameter with sharded optimizer state instead has one
  reduce_scatter of its gradient (per microbatch under ZeRO-2, once under ZeRO-1) and one all_gather
  of its updated value per step, per data-parallel dim, whatever number of ops read it.

This is the plan's prediction; ``tests/test_collective_parity.py`` holds it against what a step on
gloo ranks actually issues (counted by ``autopar.testing.counters.CollectiveCounter``) (docs/architecture.md "Correctness", collective parity), including where DTensor's backward
differs from pricing. Plans that did not record collectives predict none. Not for timing: the
seconds are in ``plan.predicted``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from autopar.passes.gradient_sync import BUCKET_BYTES, buckets

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
PHASES = ("forward", "backward", "grad_sync")
"""When a collective runs: in the forward program, in autograd's backward, or in the gradient sync
after the last microbatch's backward."""


@dataclass(frozen=True)
class StepCollective:
    """One collective a step issues (``times`` times): kind, phase and bytes as the group sees them."""

    kind: str
    phase: str
    nbytes: float
    mesh_dim: int
    times: float = 1  # a partial gradient's reduction shared by k readers counts 1/k at each


def step_collectives(plan_data: Mapping[str, Any], bucket_bytes: float = BUCKET_BYTES) -> list[StepCollective]:
    """Every collective one step of the plan issues: per-op ones (times the microbatch count, but for those
    run ``once_a_step``: a float8 weight's amax), then the bucketed gradient all_reduces."""
    microbatches = int(plan_data.get("pipeline", {}).get("microbatches", 1))
    ops = plan_data.get("ops", {}).values()
    found = [StepCollective(t["kind"], t["phase"], t["nbytes"], t["mesh_dim"],
                            (1 if t.get("once_a_step") else microbatches) * t.get("share", 1.0) * op.get("count", 1.0))
             for op in ops for t in op.get("collectives", []) if not t["grad_sync"]]
    syncs = [t for op in ops for t in _stood_for(op) if t["grad_sync"]]
    return (found + gradient_buckets([t for t in syncs if t["kind"] == "all_reduce"], bucket_bytes)
            + sharded_state_syncs([t for t in syncs if t["kind"] != "all_reduce"], microbatches))


def _stood_for(op: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The op's collective terms, once per real op it stands for (``count``: an op of a traced layer;
    its parameter gradients are other tensors in each layer, hence the tensor name's suffix)."""
    terms = op.get("collectives", [])
    times = round(op.get("count", 1.0))
    if times == 1:
        return terms
    return [{**t, "tensor": f"{t.get('tensor')}#{i}"} for i in range(times) for t in terms]


def sharded_state_syncs(terms: Iterable[Mapping[str, Any]], microbatches: int) -> list[StepCollective]:
    """ZeRO-1/2's per-parameter gradient reduce_scatters and parameter all_gathers: one per tensor,
    kind and mesh dim (a parameter read by several ops syncs once), repeated per microbatch when the
    term says so."""
    unique = {(t["tensor"], t["kind"], t["mesh_dim"]): t for t in terms}
    return [StepCollective(kind, "grad_sync", t["nbytes"], dim, microbatches if t["per_microbatch"] else 1)
            for (_, kind, dim), t in unique.items()]


def gradient_buckets(terms: Iterable[Mapping[str, Any]], bucket_bytes: float = BUCKET_BYTES
                     ) -> list[StepCollective]:
    """The all_reduces of ``GradientSync`` for the plan's parameter-gradient terms: one gradient per
    tensor (a term per mesh dim it is partial on), grouped by those dims and bucketed in the order
    backward finishes them (the reverse of first use); one all_reduce of the bucket's bytes per bucket
    and partial dim."""
    partial_dims: dict[str, list[int]] = {}
    nbytes: dict[str, float] = {}
    for t in terms:
        partial_dims.setdefault(t["tensor"], []).append(t["mesh_dim"])
        nbytes[t["tensor"]] = t["nbytes"]
    groups: dict[tuple[int, ...], list[str]] = {}
    for tensor, dims in reversed(partial_dims.items()):
        groups.setdefault(tuple(sorted(set(dims))), []).append(tensor)
    found = []
    for dims, tensors in groups.items():
        for bucket in buckets([nbytes[t] for t in tensors], bucket_bytes):
            size = sum(nbytes[tensors[i]] for i in bucket)
            found += [StepCollective("all_reduce", "grad_sync", size, d) for d in dims]
    return found


def predicted_collectives(plan_data: Mapping[str, Any], phases: Iterable[str] = PHASES) -> dict[str, int]:
    """Collectives per kind that one step of the plan issues (in ``phases``), kinds with none left out."""
    totals: dict[str, float] = {}
    wanted = set(phases)
    for c in step_collectives(plan_data):
        if c.phase in wanted:
            totals[c.kind] = totals.get(c.kind, 0.0) + c.times
    return {kind: round(total) for kind, total in totals.items() if round(total)}
