"""Prices of node strategies and of resharding edges on one mesh of one cluster.

This module turns the cost formulas of ``autopar.cost_models`` (compute roofline, collective alpha-beta,
optimizer memory) into the numbers the solver needs for a captured graph on a mesh shape:

* ``Pricer.node``: compute time of a node's strategy (forward + backward on its local shard), the
  backward collectives the strategy implies, and the activation bytes it keeps for backward;
* ``Pricer.placeholder``: memory of a parameter's local shard (parameter, gradient, AdamW state);
* ``Pricer.edge``: the collectives that move a tensor from its producer's placement to the one its
  consumer needs, in forward and (as the dual collective) in backward.

Rules, per mesh dimension (we price the forward graph and derive its backward, docs/architecture.md "Execution"):
* a node whose strategy shards anything on a mesh dim splits its work over that dim; an all-``R`` node
  computes everything on every rank. Backward costs twice the forward (two matmuls per matmul).
  A view launches no kernel but is dispatched like any op, so it costs the host's dispatch
  (``compute_time`` of no work: nothing on the presets, ``host_op_s`` on a calibrated CPU).
* a parameter costs the host one dispatch per microbatch in backward: autograd accumulates its
  gradient into ``.grad`` (``AccumulateGrad``; measured on tiny-gpt's step on one CPU rank: 24 us
  each against a calibrated ``host_op_s`` of 25 us). The later microbatches' add moves 3x the
  gradient's bytes, which is not priced; on the presets (``host_op_s`` 0) the term is zero.
* an input that is ``R`` on a dim where the node's output is not ``R`` is used differently by each
  rank, so its gradient is a partial sum that must be all-reduced in backward. For a parameter this is
  the data-parallel gradient all_reduce (bucketed and overlapped with backward: reported apart as
  ``grad_sync``); for an activation it is Megatron's "f" all_reduce on the critical path.
* a collective on the critical path (a resharding, an activation's partial gradient) costs the
  link's formula plus the device's ``redistribute_s``: DTensor runs it inside the step, and on a
  calibrated CPU that costs more than the bare collective (nothing on the presets). The bucketed
  gradient sync runs plain c10d all_reduces and is charged its host work per gradient instead.
* a parameter gathered for an op that saves it for backward (``mm`` keeps its weight) is gathered
  again in backward: the runtime does not hold the gathered copy from forward to backward
  (``passes/reshard.py``, FSDP's reshard-after-forward), so such an edge's forward collectives run
  again in backward, on the critical path, whatever the layer's checkpointing (a recomputed layer
  re-gathers once, as part of its recompute). So is an activation gathered for ops that keep it
  (sequence parallelism's norm output, read whole by the projections whose weight gradients need it:
  ``passes/rematerialize.py``), once for the readers that share its move (``moved_again``).
* on the lowered runtime (``runtime``: one-stage meshes by default, ``roles.priced_runtime``) an FSDP
  parameter's backward regather (an all_gather, ``prefetched``) and its gradient reduce_scatter
  (``_overlapped_where_lowered``) are issued ahead of their use and waited on late
  (``passes/lower_buckets.py``): gradient sync, hidden behind its microbatch's backward compute with the
  rest of it; so is an activation's backward regather, launched before the matmul ahead of its readers
  (``Cost.split_regather_s``: its microbatches' pieces, one per backward); an FSDP parameter's forward
  all_gather, issued a unit ahead too, hides behind forward's compute
  (``Cost.prefetched_s``). Both are the ILP's constraint (3) (``OverlapSlack``), and the compute they run
  beside runs slower (``DeviceSpec.overlap_slowdown``).
* a parameter sharded where it is stored and gathered to be read (FSDP) has its gradient reduced by
  the gather's backward, on the critical path (a reduce_scatter onto the shard), not by the gradient
  sync: ``Pricer.node`` prices the sync of an ungathered parameter and ``gathered_root_delta`` the
  difference, which the solver adds when the op and the parameter's placement are chosen together
  (``problem.RootSharding``, constraint (9));
* so is an activation read through a view and gathered on its way (sequence parallelism's
  sequence-split norm output, read by q, k and v through their own views): the gather's backward
  reduce-scatters the gradient, instead of the one all_reduce the readers of an ungathered value
  share (below). The readers of one value needing it in one placement share one redistribute
  (``passes/insert_redistributes.py``), whose backward reduces their summed gradient once: each of
  the ``k`` readers pays ``1/k`` of that reduction, and the move itself is priced once for all of
  them (``problem.SharedResharding``; ``Pricer.edge(..., shared=True)`` prices an edge without it);
* an activation several ops read, left partial by each of them, is reduced once: autograd sums the
  partial gradients first and DTensor keeps the sum partial (q, k and v projections of one normed
  input run one all_reduce, not three). Each of the ``k`` edges pays ``1/k`` of the reduction
  (``partial_share``; ``k`` counts the value's non-view readers, so it is exact when all of them
  leave it partial, the usual case).
* resharding an edge, forward -> backward: S->R all_gather -> (none); P->R all_reduce -> (none);
  P->S reduce_scatter -> all_gather; R->S (local slice) -> all_gather; S(i)->S(j) all_to_all ->
  all_to_all. A partial gradient never needs the backward of R->P, and a value without a gradient
  (inputs, buffers and what is made of them alone: a rotary table's slice) has no backward at all.
  The moves are DTensor's, one mesh dim at a time in its order (``redistribute_steps``), each sized by
  what the dims before it left: a shard nested inside another out of order (FSDP's ``S(1)`` outside
  TP's, read ``(R, S(1))``) is gathered on the inner dim first, so the outer gather and the gradient's
  reduce_scatter move the whole tensor; the planner sees that price and shards another tensor dim.
* fused attention over a sequence split on cp (``_charge_ring_attention``): with its keys and values
  gathered (their edges' all_gather and reduce_scatter), the runtime gathers them again in backward
  rather than keep the gathered copies (``moved_again``), so what it keeps is charged split, as made; as
  ring attention it keeps its own block and pays the part of its point-to-point exchanges
  (``ring_collectives``) that the blocks' compute does not hide (``ring_exposed_s``).

Precision: on accelerators activations and parameters are priced in the compute dtype (bf16 by
default) with ZeRO's mixed-precision accounting of 16 bytes per parameter (2 param + 2 grad + 12
AdamW: fp32 master, momentum, variance; Rajbhandari et al., SC20); on ``cpu`` everything is fp32. With
bf16 masters (``precision.master``, ``master_dtype``) the optimizer state is priced in bf16
(``Pricer.parameter_memory``).

Float8 linears (``precision.fp8``; which ops: ``ir/float8.float8_linears``; how they run:
``passes/float8.py``): the matmul and its two backward products run at the device's FP8 peak on operands of
one byte; around them the scaling kernels, bandwidth-bound (``Float8Work``): each microbatch's forward an amax
(one read) and a cast (a read, a one-byte write) of the activation, its backward an amax and a cast of the
output's gradient; the weight's amax and cast once a step (``passes/float8.StepCasts``, Transformer Engine's
``is_first_microbatch``), its e4m3 copy held through the step, one byte an element of the parameter as stored
(``parameter_memory``). An all_reduce of one fp32 amax over each mesh dim an operand (forward) or the output's
gradient (backward) is split on, redone every microbatch (``Cost.repeated_comm_s``), the weight's once a step.
A weight moved on its way to the linear (gathered by FSDP, sliced) is cast as it arrives, every microbatch, and
again in backward, with its amax all_reduces, where the runtime holds no copy of it: the solver adds that
(``recast_root_delta``) where the parameter's placement and the linear's are chosen together (constraint
(9)); the copy stays charged to the parameter (an overcount of one byte an element of its shard). What a
float8 linear keeps for backward, its input's e4m3 copy instead of the input, is charged to the input's
producer, one byte a value (``ir/saved_tensors.py``'s ``float8_copies``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, NamedTuple, Sequence, TypeVar

import torch
from torch import fx
from torch.distributed.tensor import Placement, Replicate
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from autopar.cost_models import (Cluster, adamw_state_bytes, backward_kind, collective_time,
                          compute_time, matmul_kind)
from autopar.cost_models.memory import master_dtype_of
from autopar.core.placement import Placements, grows_locally, optimizer_shard_dim
from autopar.core.plan import DTENSOR, LOWERED
from autopar.ir.capture import ATTENTION_QUERY_DIM as QUERY_DIM
from autopar.ir.capture import FUSED_ATTENTION, WEIGHT_KINDS
from autopar.planning.strategies import Strategy, rings
from autopar.ir.layers import output_vals, tensor_inputs

_SDPA = torch.ops.aten.scaled_dot_product_attention
_SDPA_IS_CAUSAL_ARG = 5  # query, key, value, attn_mask, dropout_p, is_causal
_MATMUL_PACKETS = set(flop_registry) | {_SDPA}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
AMAX_BYTES = 4
"""A float8 scale's absolute maximum, reduced across the ranks a tensor is split over: one fp32 number."""
MATMUL_BACKWARD_RATIO = 2.0
"""Backward FLOPs over forward FLOPs of a matmul: the input's and the weight's gradient, one product each."""
_MATMUL_OPERANDS = {torch.ops.aten.mm: (0, 1), torch.ops.aten.bmm: (0, 1), torch.ops.aten.addmm: (1, 2),
                    torch.ops.aten.baddbmm: (1, 2)}
"""The input slots of the two operands of a matmul, each of whose gradients is one product in backward."""
_GRADED_KINDS = ("param", "activation")
"""The gradient kinds (``CapturedGraph.gradient_kinds``) of values that get a gradient."""
_R = TypeVar("_R")


class Float8Work(NamedTuple):
    """What a float8 linear scales on one rank (elements, the whole batch): its activation operand and
    output shrink with microbatches, its weight does not."""

    activation: float
    weight: float
    output: float
    casts_activation: bool = True  # False where an earlier float8 linear cast the same tensor
    # (``ir/float8.reused_casts``)
    weight_slot: int = 1  # the tensor input that is the weight


class Kernel(NamedTuple):
    """One op's forward kernel on the whole batch, and how much more work its backward does."""

    flops: float
    moved: float  # HBM bytes
    kind: str  # ``cost_models.compute`` op kind
    backward_ratio: float = MATMUL_BACKWARD_RATIO  # backward FLOPs / forward FLOPs
    float8: Float8Work | None = None  # a float8 linear's scaled operands: its products run at the FP8 rate
    remade: bool = False  # backward runs the forward once more, to make the output it did not keep
    # (``SavedTensors.recomputed``)


@dataclass
class Cost:
    """Seconds of one decision, split so that plans can explain themselves."""

    compute_s: float = 0.0
    comm_s: dict[str, float] = field(default_factory=dict)  # critical-path collectives by kind
    grad_sync_s: float = 0.0  # gradient all_reduce that can hide behind backward
    grad_sync_per_microbatch_s: float = 0.0  # the part of grad_sync_s redone every microbatch (ZeRO-2)
    memory_bytes: float = 0.0  # per device
    transient_bytes: float = 0.0  # the part of memory_bytes live only while the op runs on one microbatch
    # (the largest op's working set, ``problem._charge_working_set``): held once, not per microbatch in flight
    output_bytes: float = 0.0  # per device, all of an op's outputs (what selective checkpointing keeps)
    backward_compute_s: float = 0.0  # part of compute_s that runs in one microbatch's backward (overlap budget)
    forward_compute_s: float = 0.0  # part of compute_s that runs in one microbatch's forward (overlap budget)
    prefetched_s: float = 0.0  # a parameter's forward all_gathers the lowered runtime issues a unit ahead
    # (``Pricer.prefetched``): hidden behind forward compute, not in comm_s
    split_regather_s: float = 0.0  # the part of grad_sync_s and grad_sync_per_microbatch_s that is an
    # activation's regather the lowered runtime launches ahead (``Pricer.prefetched``), priced for the whole batch:
    # under m microbatches each backward moves 1/m of it (``Pricer.for_microbatches``)
    kernel: Kernel | None = None  # forward kernel on the whole batch
    batch_memory: bool = False  # memory_bytes holds activations of the whole batch (shrinks with microbatches)
    repeats_per_microbatch: bool = False  # communication redone for every microbatch (parameter gathers)
    forward_comm_s: dict[str, float] = field(default_factory=dict)  # the part of comm_s run in forward
    accumulate_s: float = 0.0  # host seconds repeated by each further microbatch (gradient accumulation)
    repeated_comm_s: float = 0.0  # all_reduce seconds (in comm_s) of one size whatever the microbatch, rerun by
    # each (float8's amax all_reduces)
    repeated_forward_comm_s: float = 0.0  # the part of repeated_comm_s run in forward

    def add_comm(self, kind: str, seconds: float) -> None:
        """Add ``seconds`` of critical-path collective ``kind``."""
        if seconds > 0:
            self.comm_s[kind] = self.comm_s.get(kind, 0.0) + seconds

    @property
    def exposed_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())


@dataclass(frozen=True)
class OverlapSlack:
    """Communication that runs beside compute, less the compute that hides it (``beta`` of it), in
    seconds, split by the pass it runs in:

    * ``last``: gradient sync in the last microbatch's backward (the reductions run once a step, DDP's
      buckets and ZeRO-1's reduce_scatters, and that microbatch's share of the others);
    * ``each``: gradient sync in one earlier microbatch's backward (what is redone in every microbatch's
      backward: ZeRO-2's reduce_scatters, and on the lowered runtime FSDP's reduce_scatters and backward
      regathers, each issued and waited on inside its own microbatch's backward, ``passes/lower_buckets.py``);
    * ``forward``: in one microbatch's forward, the parameter all_gathers the lowered runtime issues a
      unit ahead (``Pricer.prefetched``).

    Negative: hidden with time to spare. The solver's constraint (3) holds one exposure variable per part.
    ``overlapped``: the step's seconds of all that communication; the compute beside the part of it that
    hides runs slower (``DeviceSpec.overlap_slowdown``), which ``exposed_s`` adds."""

    last: float = 0.0
    each: float = 0.0
    forward: float = 0.0
    overlapped: float = 0.0

    @classmethod
    def of(cls, cost: "Cost", beta: float, microbatches: int, occurrences: float = 1.0) -> "OverlapSlack":
        """``occurrences`` times ``cost``'s slack under gradient accumulation over ``microbatches`` (its
        price already for them: ``grad_sync_s`` and ``prefetched_s`` the whole step's,
        ``backward_compute_s`` and ``forward_compute_s`` one microbatch's)."""
        m, each = microbatches, cost.grad_sync_per_microbatch_s
        hide, hide_forward = beta * cost.backward_compute_s, beta * cost.forward_compute_s
        return cls(occurrences * (cost.grad_sync_s - (m - 1) * each - hide), occurrences * (each - hide),
                   occurrences * (cost.prefetched_s / m - hide_forward),
                   occurrences * (cost.grad_sync_s + cost.prefetched_s))

    def plus(self, other: "OverlapSlack", weight: float = 1.0) -> "OverlapSlack":
        return OverlapSlack(self.last + weight * other.last, self.each + weight * other.each,
                            self.forward + weight * other.forward, self.overlapped + weight * other.overlapped)

    def exposed_s(self, microbatches: int, slowdown: float = 0.0) -> float:
        """Seconds it adds to the step: what the step waits for (each part's excess over the compute beside
        it) and, for the rest, which hides, the compute it slows (``contention_share``)."""
        m = microbatches
        waited = max(0.0, self.last) + (m - 1) * max(0.0, self.each) + m * max(0.0, self.forward)
        return waited + contention_share(slowdown) * (self.overlapped - waited)


def contention_share(slowdown: float) -> float:
    """Seconds a step gains per second of communication hidden behind compute that runs ``slowdown``
    longer beside it: the compute such a second overlaps does ``1 / (1 + slowdown)`` of a second's work."""
    return slowdown / (1.0 + slowdown)


def with_fields(record: _R, **changes: Any) -> _R:
    """A shallow copy of the dataclass instance ``record`` with ``changes`` set: what
    ``dataclasses.replace`` does, without re-running ``__init__``, for the planner's records (``Cost``,
    and ``problem.py``'s and ``stages.py``'s), which have no ``__post_init__`` a change would have to
    re-run (``Decision``'s fills ``occurrences`` once, when it is missing). Re-pricing a problem for each
    microbatch count and checkpointing mode copies hundreds of thousands of them; ``replace`` was a
    sixth of the planning time of a 70B model on 1,024 GPUs."""
    if not changes.keys() <= _field_names(type(record)):
        unknown = sorted(changes.keys() - _field_names(type(record)))
        raise TypeError(f"{type(record).__name__} has no field {', '.join(unknown)}")
    copy = object.__new__(type(record))
    object.__setattr__(copy, "__dict__", record.__dict__ | changes)  # frozen records too
    return copy


@functools.cache
def _field_names(kind: type) -> frozenset[str]:
    """The field names of dataclass ``kind`` (``with_fields`` checks every change against them)."""
    return frozenset(kind.__dataclass_fields__)


def _varies_with_microbatches(cost: Cost) -> bool:
    """Whether ``Pricer.for_microbatches`` changes ``cost``: a kernel (run per microbatch), activations of
    the whole batch, or work repeated per microbatch. A resharding of an activation moves the same bytes
    in ``m`` pieces: its price stays."""
    return (cost.kernel is not None or cost.batch_memory or cost.repeats_per_microbatch
            or bool(cost.accumulate_s) or bool(cost.grad_sync_per_microbatch_s) or bool(cost.repeated_comm_s))


def weighted_cost(weighted: Sequence[tuple[float, Cost]]) -> Cost:
    """``sum_i w_i c_i`` field by field (flags and the kernel come from the first)."""
    out = with_fields(weighted[0][1], comm_s={}, forward_comm_s={})
    for f in fields(Cost):
        first = getattr(weighted[0][1], f.name)
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            setattr(out, f.name, sum(w * getattr(c, f.name) for w, c in weighted))
        elif isinstance(first, dict):
            total: dict[str, float] = {}
            for w, c in weighted:
                for kind, seconds in getattr(c, f.name).items():
                    total[kind] = total.get(kind, 0.0) + w * seconds
            setattr(out, f.name, total)
    return out


class Pricer:
    """Prices for one (cluster, mesh shape, compute dtype), for the whole batch in one piece.

    ``for_microbatches`` re-prices a cost for gradient accumulation over m microbatches: kernels run
    m times on 1/m of the batch, activations shrink m-fold, parameter gathers repeat m times, and the
    gradient all_reduce (issued after the last microbatch) can hide only behind that microbatch's
    backward.

    ``stages``: the mesh is one pipeline stage's submesh; the cluster's devices are ``stages`` such
    submeshes, the pipeline dimension outermost (slowest varying), so a stage's dims keep the node
    layout they have in the full ``(stages, *mesh_shape)`` mesh.
    """

    def __init__(self, cluster: Cluster, mesh_shape: Sequence[int], dtype: str, stages: int = 1,
                 zero_stage: int = 0, zero_dims: Sequence[int] = (), reduce_dtype: str = "fp32",
                 runtime: str = DTENSOR, master_dtype: str = "fp32", fp8: str | None = None,
                 float8: frozenset[str] = frozenset(), float8_reused: Mapping[str, int] | None = None,
                 float8_weights: frozenset[str] = frozenset()):
        self.cluster = dispatched_by(cluster, runtime)
        self.fp8 = fp8  # the float8 recipe (core.plan.Precision.fp8), None without
        self.float8 = float8  # under it, the float8 linears' node names (``ir/float8.float8_linears``)
        self.float8_reused = float8_reused or {}  # those reading an earlier one's cast, by the activation's slot
        # (``ir/float8.reused_casts``)
        self.float8_weights = float8_weights  # the placeholders of the parameters they read, each with an e4m3 copy
        # (``ir/float8.float8_weight_placeholders``)
        self.runtime = runtime  # the runtime the prices assume (core.plan.RUNTIMES)
        self.mesh_shape = tuple(mesh_shape)
        self.dtype = dtype
        self.reduce_dtype = reduce_dtype  # of the gradient reductions outside the program (core.plan.Precision)
        self.master_dtype = master_dtype  # of the parameters the optimizer steps (core.plan.Precision)
        self.stages = stages
        self.zero_stage = zero_stage
        self.zero_dims = tuple(zero_dims)  # the mesh dims ZeRO-1/2 may shard state over (core.axes.ZERO_AXES)
        full = (stages, *self.mesh_shape)
        self.groups = [cluster.group(full, d + 1) for d in range(len(self.mesh_shape))]
        self.stage_group = cluster.group(full, 0)
        self._edge_cache: dict[tuple, Cost] = {}
        self._per_microbatches: dict[tuple[int, int], tuple[Cost, Cost]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """What pickling keeps (a candidate a planning worker sends back): all but ``_per_microbatches``,
        whose keys are ids of the worker's cost objects; in the process that unpickles them those ids name
        other objects, or none, and a lookup would hand one cost another's price."""
        return {**self.__dict__, "_per_microbatches": {}}

    def for_microbatches(self, cost: Cost, m: int) -> Cost:
        """``cost`` re-priced for ``m`` microbatches, once per (cost object, m): a mesh's search re-prices
        the same options for its memory bisection and for its solves. The cost is kept with its price, so
        its ``id`` stays its own."""
        if m == 1:
            return cost
        key = (id(cost), m)
        if key not in self._per_microbatches:
            self._per_microbatches[key] = (cost, self._repriced_for_microbatches(cost, m))
        return self._per_microbatches[key][1]

    def _repriced_for_microbatches(self, cost: Cost, m: int) -> Cost:
        if not _varies_with_microbatches(cost):
            return cost
        out = with_fields(cost, comm_s=dict(cost.comm_s), forward_comm_s=dict(cost.forward_comm_s))
        if cost.kernel is not None:
            out.compute_s, last_backward = self._kernel_times(cost.kernel, m)
            out.backward_compute_s = last_backward / m
            out.forward_compute_s = (out.compute_s - last_backward) / m
        out.compute_s += (m - 1) * cost.accumulate_s
        if cost.batch_memory:
            out.memory_bytes = cost.memory_bytes / m
            out.transient_bytes = cost.transient_bytes / m
            out.output_bytes = cost.output_bytes / m
        split = cost.split_regather_s  # the whole step's, in m pieces: each microbatch's backward runs one
        out.grad_sync_s = cost.grad_sync_s + (m - 1) * (cost.grad_sync_per_microbatch_s - split)
        out.grad_sync_per_microbatch_s = cost.grad_sync_per_microbatch_s - split + split / m
        if cost.repeats_per_microbatch:
            out.comm_s = {k: v * m for k, v in cost.comm_s.items()}
            out.prefetched_s = cost.prefetched_s * m
            out.forward_comm_s = {k: v * m for k, v in cost.forward_comm_s.items()}
        elif cost.repeated_comm_s:
            out.add_comm("all_reduce", (m - 1) * cost.repeated_comm_s)
            if cost.repeated_forward_comm_s:
                out.forward_comm_s["all_reduce"] = (out.forward_comm_s.get("all_reduce", 0.0)
                                                    + (m - 1) * cost.repeated_forward_comm_s)
        return out

    def _time_kernel(self, cost: Cost) -> None:
        """``cost``'s compute seconds, and its forward's and backward's, from its kernel run once."""
        cost.compute_s, cost.backward_compute_s = self._kernel_times(cost.kernel, 1)
        cost.forward_compute_s = cost.compute_s - cost.backward_compute_s

    def _kernel_times(self, kernel: Kernel, m: int) -> tuple[float, float]:
        """(forward + backward, backward) seconds of a kernel run once per microbatch."""
        forward, backward = self.forward_time(kernel, m), self.backward_time(kernel, m)
        return forward + backward, backward

    def forward_time(self, kernel: Kernel, m: int = 1) -> float:
        """Forward seconds of a kernel (priced on the whole batch) run once per microbatch, m times; a float8
        linear's with its scaling kernels (``_scaling_time``)."""
        return self._runs_time(kernel, m, kernel.kind) + self._scaling_time(kernel, m, forward=True)

    def backward_time(self, kernel: Kernel, m: int = 1) -> float:
        """Backward seconds of a kernel run once per microbatch, m times: ``backward_ratio`` (2 for a
        matmul) times its forward kernel, priced as its backward runs (``cost_models.backward_kind``:
        fused attention's backward kernel at its own efficiency), and the forward again where backward makes
        the output it did not keep (``Kernel.remade``)."""
        return (kernel.backward_ratio * self._runs_time(kernel, m, backward_kind(kernel.kind))
                + (self._runs_time(kernel, m, kernel.kind) if kernel.remade else 0.0)
                + self._scaling_time(kernel, m, forward=False))

    def _runs_time(self, kernel: Kernel, m: int, kind: str) -> float:
        dtype = "fp8" if kernel.float8 is not None else self.dtype
        return m * compute_time(kernel.flops / m, kernel.moved / m, self.cluster.device, dtype, kind)

    def _scaling_time(self, kernel: Kernel, m: int, forward: bool) -> float:
        """Seconds of a float8 linear's scaling kernels (the module doc) over ``m`` microbatches; 0 for
        other kernels and for a backward that computes no gradient."""
        work = kernel.float8
        if work is None or (not forward and not kernel.backward_ratio):
            return 0.0
        wide = _DTYPE_BYTES[self.dtype]
        activation, output = work.activation / m, work.output / m
        if not forward:  # an amax and a cast of the output's gradient
            return m * self._passes_time([(output, wide), (output, wide + 1)])
        # an amax and a cast of the activation (once for the linears reading it), of the weight once a step
        each = [(activation, wide), (activation, wide + 1)] if work.casts_activation else []
        return m * self._passes_time(each) + self._weight_cast_time(work)[0]

    def _weight_cast_time(self, work: Float8Work) -> tuple[float, float]:
        """(forward, backward) seconds of casting a float8 linear's weight where it arrives: an amax and a cast
        forward, a cast with that scale in backward."""
        wide = _DTYPE_BYTES[self.dtype]
        return (self._passes_time([(work.weight, wide), (work.weight, wide + 1)]),
                self._passes_time([(work.weight, wide + 1)]))

    def _passes_time(self, passes: Sequence[tuple[float, float]]) -> float:
        """Seconds of bandwidth-bound kernels, each (elements, bytes moved an element)."""
        device = self.cluster.device
        return sum(compute_time(0.0, n * nbytes, device, self.dtype, "elementwise") for n, nbytes in passes)

    # ---- sizes -------------------------------------------------------------------------------
    def element_bytes(self, val: torch.Tensor) -> int:
        if val.dtype.is_floating_point:
            return _DTYPE_BYTES[self.dtype]
        return val.element_size()

    def local_numel(self, val: torch.Tensor, placements: Placements | None) -> float:
        n = float(val.numel())
        for p, size in zip(placements or (), self.mesh_shape):
            if p.is_shard():
                n /= size
        return n

    def local_shape(self, val: torch.Tensor, placements: Placements | None) -> list[int]:
        """One rank's shape of ``val``: each sharded dim split over its mesh dims (rounded up, as
        DTensor gives the first ranks the larger pieces of an uneven split)."""
        shape = list(val.shape)
        for p, size in zip(placements or (), self.mesh_shape):
            if p.is_shard():
                shape[p.dim] = -(-shape[p.dim] // size)
        return shape

    def local_bytes(self, val: torch.Tensor, placements: Placements | None) -> float:
        return self.local_numel(val, placements) * self.element_bytes(val)

    # ---- nodes -------------------------------------------------------------------------------
    def node(self, node: fx.Node, strategy: Strategy, grad_kinds: Sequence[str], saved: Sequence[float],
             views: Sequence[float | None] = (), float8_copies: Sequence[float] = (), recomputed: bool = False) -> Cost:
        """``grad_kinds``: per tensor input, ``param``/``activation``/``none`` (``CapturedGraph.gradient_kinds``);
        ``saved``: per output, the share of its bytes autograd keeps for backward (``SavedTensors.of``),
        which is the activation memory the op holds until its backward runs; ``views``: per tensor
        input, for an activation read through a view, its share of the partial-gradient reduction
        (``gradient_collectives``), else None; ``float8_copies``: per output, the one-byte copies of it float8
        linears keep (``SavedTensors.copies_of``), held as long; ``recomputed``: backward runs its forward kernel
        again, once, to make its output rather than keep it (``SavedTensors.recomputed``)."""
        cost = Cost()
        if getattr(node.target, "is_view", False):
            # a view moves no data and its memory is its base's, but the runtime dispatches it
            cost.kernel = Kernel(0.0, 0.0, "elementwise")
            self._time_kernel(cost)
            return cost
        split = self._work_divisor(strategy)
        flops = kernel_flops(node) / split
        float8 = self._float8_work(node, strategy, grad_kinds)
        moved = self._bytes_moved(node, strategy, float8)
        cost.kernel = Kernel(flops, moved, self._kernel_kind(node, strategy, float8 is not None),
                             backward_ratio(node, grad_kinds), float8, recomputed)
        self._time_kernel(cost)
        outputs = [(self.local_bytes(v, p), share) for v, p, share in zip(output_vals(node), strategy.outputs, saved)
                   if isinstance(v, torch.Tensor) and p is not None]
        cost.memory_bytes = sum(nbytes * share for nbytes, share in outputs)
        if any(float8_copies):  # one byte a value each
            cost.memory_bytes += sum(self.local_numel(v, p) * copies for v, p, copies in
                                     zip(output_vals(node), strategy.outputs, float8_copies)
                                     if isinstance(v, torch.Tensor) and p is not None)
        cost.output_bytes = sum(nbytes for nbytes, _ in outputs)
        cost.batch_memory = True
        self._charge_gradient_collectives(self.gradient_collectives(node, strategy, grad_kinds, views=views), cost)
        if node.target is FUSED_ATTENTION:
            self._charge_ring_attention(node, strategy, cost)
        if float8 is not None:
            self._charge_amax_reductions(node, strategy, cost)
        return cost

    # ---- float8 linears ---------------------------------------------------------------------------------
    def _float8_work(self, node: fx.Node, strategy: Strategy, grad_kinds: Sequence[str]) -> Float8Work | None:
        """What ``node`` scales per rank, if it is a float8 linear (``float8``), else None."""
        if node.name not in self.float8:
            return None
        slots = _MATMUL_OPERANDS[node.target.overloadpacket]
        inputs = tensor_inputs(node)
        numel = {grad_kinds[i] in WEIGHT_KINDS: self.local_numel(inputs[i].meta["val"], strategy.inputs[i])
                 for i in slots}
        weight = next(i for i in slots if grad_kinds[i] in WEIGHT_KINDS)
        return Float8Work(numel[False], numel[True], self.local_numel(node.meta["val"], strategy.outputs[0]),
                          node.name not in self.float8_reused, weight)

    def _charge_amax_reductions(self, node: fx.Node, strategy: Strategy, cost: Cost) -> None:
        """A float8 linear's amax all_reduces (``amax_collectives``) on the critical path: the weight's once a
        step, the others rerun every microbatch (``Cost.repeated_comm_s``: their bytes do not shrink with it)."""
        weight = cost.kernel.float8.weight_slot
        priced = [(c.phase, self.collective_seconds(c), weight_amax(c, weight))
                  for c in self.amax_collectives(node, strategy)]
        cost.repeated_comm_s = sum(seconds for _, seconds, once in priced if not once)
        cost.repeated_forward_comm_s = sum(seconds for phase, seconds, once in priced
                                           if phase == "forward" and not once)
        forward = sum(seconds for phase, seconds, _ in priced if phase == "forward")
        cost.add_comm("all_reduce", sum(seconds for _, seconds, _ in priced))
        if forward:
            cost.forward_comm_s["all_reduce"] = cost.forward_comm_s.get("all_reduce", 0.0) + forward

    def recast_root_delta(self, node: fx.Node, strategy: Strategy, grad_kinds: Sequence[str], slot: int,
                          root: Placements) -> Cost | None:
        """What a float8 linear's weight (input ``slot``) costs beyond ``Pricer.node``'s once-a-step cast where the
        parameter it reads through views is placed ``root`` and moved on its way here (``moved``: FSDP's gather,
        a slice): cast as it arrives in every microbatch's forward and again in its backward, its forward amax
        all_reduces rerun every microbatch. ``None`` for another input or op, or a weight read as stored. The
        solver adds it where both decisions are taken (``solver.py``, constraint (9))."""
        work = self._float8_work(node, strategy, grad_kinds)
        if work is None or slot != work.weight_slot or not moved(root, strategy.inputs[slot]):
            return None
        forward, backward = self._weight_cast_time(work)
        amax = sum(self.collective_seconds(c) for c in self.amax_collectives(node, strategy) if weight_amax(c, slot))
        # m microbatches: backward's cast m times, forward's m - 1 more (accumulate_s: each further one)
        return Cost(compute_s=backward, backward_compute_s=backward, accumulate_s=forward + backward,
                    repeated_comm_s=amax, repeated_forward_comm_s=amax)

    def amax_collectives(self, node: fx.Node, strategy: Strategy) -> list["Collective"]:
        """A float8 linear's all_reduces of one fp32 amax (``passes/float8.tensorwise_scale``): in forward one
        per operand and mesh dim it is split on, in backward one per mesh dim the output, so its gradient, is
        split on (the weight is cast again with its forward scale); none for another op."""
        if node.name not in self.float8:
            return []
        slots, whole = _MATMUL_OPERANDS[node.target.overloadpacket], tuple(Replicate() for _ in self.mesh_shape)
        scaled = [i for i in slots if i != self.float8_reused.get(node.name)]  # an activation cast before: not again
        forward = [Collective("all_reduce", "forward", AMAX_BYTES, dim, whole, slot=i)
                   for i in scaled for dim, p in enumerate(strategy.inputs[i]) if p.is_shard()]
        backward = [Collective("all_reduce", "backward", AMAX_BYTES, dim, whole)
                    for dim, p in enumerate(strategy.outputs[0] or ()) if p.is_shard()]
        return forward + backward

    # ---- context-parallel attention: the keys and values all-gathered, or passed around a ring -----------
    def _charge_ring_attention(self, node: fx.Node, strategy: Strategy, cost: Cost) -> None:
        """Fused attention over a sequence split on a cp dim as ring attention (``strategies.rings``): the
        part of its exchanges that its blocks' compute does not hide (``ring_exposed_s``). (All-gathered keys
        and values cost their edges' collectives, and a regather in backward, ``moved_again``.)"""
        for dim, size in enumerate(self.mesh_shape):
            if size == 1 or not strategy.inputs[0][dim].is_shard(QUERY_DIM) or not rings(node, strategy, dim):
                continue
            forward, backward = self.ring_exposed_s(node, strategy, dim, cost.kernel)
            cost.add_comm("p2p", forward + backward)
            if forward > 0:
                cost.forward_comm_s["p2p"] = cost.forward_comm_s.get("p2p", 0.0) + forward

    def ring_block_bytes(self, node: fx.Node, strategy: Strategy) -> float:
        """Bytes of one rank's block of keys and values: one ring exchange's message."""
        return sum(self.local_bytes(a.meta["val"], p) for a, p in zip(tensor_inputs(node)[1:3], strategy.inputs[1:3]))

    def ring_collectives(self, node: fx.Node, strategy: Strategy) -> list["Collective"]:
        """The exchanges of ring attention (``strategies.rings``) on each mesh dim it rings over, ``p``
        ranks: forward ``p - 1`` sends of the rank's key-value block, backward ``p - 1`` of them again
        and ``p`` of the blocks' dK and dV (the last one home to the block's owner), as
        ``passes/ring_attention.py`` runs them (each a ``batch_isend_irecv`` pair: one send_recv)."""
        if node.target is not FUSED_ATTENTION:
            return []
        found, nbytes = [], self.ring_block_bytes(node, strategy)
        for dim, size in enumerate(self.mesh_shape):
            if size > 1 and rings(node, strategy, dim):
                k_placements = strategy.inputs[1]
                found += [Collective("send_recv", "forward", nbytes, dim, k_placements)] * (size - 1)
                found += [Collective("send_recv", "backward", nbytes, dim, k_placements)] * (2 * size - 1)
        return found

    def ring_exposed_s(self, node: fx.Node, strategy: Strategy, dim: int,
                       kernel: Kernel) -> tuple[float, float]:
        """(forward, backward) seconds of ring attention's exchanges over mesh dim ``dim`` not hidden
        behind compute. Of ``p`` blocks, each exchange runs behind one block's attention (a ``1/p`` share
        of the op's ``kernel``, forward and backward): forward ``p - 1`` exchanges of the key-value block,
        exposed ``max(0, send - block)`` each; backward ``p - 1`` steps that each exchange a key-value
        block and a dK-dV block of the same size behind one block's backward, ``max(0, 2 send -
        backward block)``, and the last dK-dV block sent home after the last block's
        compute, behind nothing. A send is the link's ``send_recv`` (``cost_models``) of the block's bytes."""
        size, group = self.mesh_shape[dim], self.groups[dim]
        block_s, backward_block_s = self.forward_time(kernel) / size, self.backward_time(kernel) / size
        send = collective_time("send_recv", self.ring_block_bytes(node, strategy), group)
        forward = (size - 1) * max(0.0, send - block_s)
        backward = (size - 1) * max(0.0, 2 * send - backward_block_s) + send
        return forward, backward

    def _kernel_kind(self, node: fx.Node, strategy: Strategy, float8: bool = False) -> str:
        """``elementwise``; ``attention`` for fused attention (flash attention's own efficiency); or a GEMM's
        kind by the matrix dimensions of its local operands (the last two of each input of two or more), in
        fp8 for a float8 linear."""
        if not is_matmul(node):
            return "elementwise"
        if getattr(node.target, "overloadpacket", None) is _SDPA:
            return "attention"
        dims = [d for arg, p in zip(tensor_inputs(node), strategy.inputs) if arg.meta["val"].ndim >= 2
                for d in self.local_shape(arg.meta["val"], p)[-2:]]
        return matmul_kind(dims, self.cluster.device, "fp8" if float8 else self.dtype)

    def _work_divisor(self, strategy: Strategy) -> int:
        """How many ways the op's work is split: by each mesh dim on which some input or output is
        sharded. A partial placement alone splits nothing: each rank holds a full-size tensor (its
        addend of the sum), so an op on partials does the whole op's work on every rank."""
        divisor = 1
        for dim, size in enumerate(self.mesh_shape):
            placed = [p[dim] for p in (*strategy.inputs, *strategy.outputs) if p is not None]
            if any(p.is_shard() for p in placed):
                divisor *= size
        return divisor

    def _bytes_moved(self, node: fx.Node, strategy: Strategy, float8: Float8Work | None = None) -> float:
        """Bytes the kernel reads and writes on one rank; a float8 linear reads its operands in one byte each."""
        if float8 is not None:
            return float8.activation + float8.weight + float8.output * _DTYPE_BYTES[self.dtype]
        ins = sum(self.local_bytes(a.meta["val"], p) for a, p in zip(tensor_inputs(node), strategy.inputs))
        outs = sum(
            self.local_bytes(v, p) for v, p in zip(output_vals(node), strategy.outputs)
            if isinstance(v, torch.Tensor) and p is not None
        )
        return ins + outs

    def _charge_gradient_collectives(self, collectives: Sequence["Collective"], cost: Cost) -> None:
        """Critical-path collectives into ``comm_s``; a gradient sync into ``grad_sync_s``, which hides
        behind the last microbatch's backward, except ZeRO's parameter all_gather: ``passes/zero.py``
        runs it before the next step's first forward, with nothing to hide behind (no prefetch)."""
        for c in collectives:
            seconds = self.collective_seconds(c)
            if not c.grad_sync or c.kind == "all_gather":
                cost.add_comm(c.kind, seconds)
                continue
            cost.grad_sync_s += seconds
            if c.per_microbatch:
                cost.grad_sync_per_microbatch_s += seconds

    def gathered_root_delta(self, node: fx.Node, strategy: Strategy, grad_kinds: Sequence[str], slot: int,
                            root: Placements, views: Sequence[float | None] = ()) -> Cost | None:
        """What the gradient of input ``slot`` (a parameter, or an activation read through a view) costs
        beyond ``Pricer.node``'s price when the value it reads through views is placed ``root`` and
        gathered on its way here; ``None`` when that changes nothing. ``Pricer.node`` prices the
        reduction of an ungathered value (``gradient_collectives`` without roots): the solver adds
        this difference where the root's decision and this option are both taken (``solver.py``,
        constraint (9))."""
        roots = [None] * len(strategy.inputs)
        roots[slot] = root
        gathered = [c for c in self.gradient_collectives(node, strategy, grad_kinds, roots, views) if c.slot == slot]
        synced = [c for c in self.gradient_collectives(node, strategy, grad_kinds, views=views) if c.slot == slot]
        if gathered == synced:
            return None
        # a parameter's reduce_scatter runs in every microbatch's backward; an activation's collectives
        # are priced on the whole batch already, like every other activation collective
        reduced, undone = Cost(repeats_per_microbatch=grad_kinds[slot] == "param"), Cost()
        self._charge_gradient_collectives(gathered, reduced)
        self._charge_gradient_collectives(synced, undone)
        return weighted_cost([(1.0, reduced), (-1.0, undone)])

    def collective_seconds(self, c: "Collective") -> float:
        """Seconds pricing charges for ``c``: a data-parallel gradient all_reduce is bucketed (its
        bandwidth term only); everything else pays the whole formula and, run by DTensor inside the
        step, the device's ``redistribute_s`` (zero on the presets)."""
        group = self.groups[c.mesh_dim]
        if c.grad_sync and c.kind == "all_reduce":
            return bucketed_all_reduce_time(c.nbytes, group)
        return c.share * in_step_collective_time(c.kind, c.nbytes, group, self.cluster.device.redistribute_s)

    def gradient_collectives(self, node: fx.Node, strategy: Strategy, grad_kinds: Sequence[str],
                             roots: Sequence[Placements | None] | None = None,
                             views: Sequence[float | None] = ()) -> list["Collective"]:
        """A parameter's gradient sync: a parameter read ``R`` on a dim where the op's output is not is
        used differently by each rank, so its gradient is a partial sum, reduced by the data-parallel
        gradient sync. An activation's partial gradient is priced on its edge, where the edge's
        placements tell how it is reduced, except for an activation read through a view (``views``:
        its share of the reduction, ``partial_reduction``): whether it was gathered on its way here
        depends on the placement of the value the view is of, which ``roots`` gives when known.

        Under ZeRO-1/2 a parameter whose state is sharded over dp (and cp: ``_zero_dims``,
        ``optimizer_shard_dim``) syncs as ``passes/zero.py`` runs it: its gradient is
        reduce-scattered onto the shards as backward finishes it (ZeRO-2: every microbatch, so full
        gradients never accumulate; ZeRO-1: in the last microbatch's backward), which hides behind
        backward like DDP's all_reduce, and, after the optimizer updates the shards, the parameter is
        all-gathered before the next forward, on the critical path: the same bytes as DDP's all_reduce
        (Rajbhandari et al., SC20, §7), per parameter rather than bucketed, one pair per ZeRO dim, each
        moving ``zero_share`` of the bytes. A parameter whose gradient this op leaves whole on a ZeRO
        dim (an op that every cp rank computes on the whole sequence) is still gathered there
        (``_zero_sync``).

        ``roots``, per tensor input: the placement of the parameter it reads (through views), where
        known. A parameter gathered on its way here (sharded at its root on a dim this op reads it
        ``R``: FSDP) has its gradient reduced by the backward of that redistribute, inside autograd
        and on the critical path, on every dim the op leaves it partial: reduce-scattered onto the
        shard where the root is sharded, all-reduced where it is replicated (DTensor's
        ``Redistribute`` backward; HSDP's replica dim); nothing is left for the gradient sync."""
        out = strategy.outputs[0] if strategy.outputs else None
        if out is None or getattr(node.target, "is_view", False):
            return []
        found = []
        for slot, (arg, placements, kind) in enumerate(zip(tensor_inputs(node), strategy.inputs, grad_kinds)):
            val = arg.meta["val"]
            root = roots[slot] if roots else None
            gathered = root is not None and gathers(root, placements)
            if kind == "activation" and views and views[slot] is not None:
                found += self.partial_reduction(val, placements, self._partial_dims(val, placements, out),
                                                views[slot], root if gathered else None, slot)
            if kind != "param":
                continue  # any other activation's partial gradient is priced on its edge (``edge_collectives``)
            partial = self._partial_dims(val, placements, out)
            if gathered:  # reduced by the gather's backward, in the reduction dtype (reshard.gather_parameter)
                found += self._overlapped_where_lowered(self.partial_reduction(
                    val, placements, partial, 1.0, root, slot, nbytes=self.reduced_gradient_bytes(val, placements)))
                continue
            reduced, zero_dims = self.reduced_gradient_bytes(val, placements), self._zero_dims(val, placements)
            found += [Collective("all_reduce", "backward", reduced, dim, placements, grad_sync=True, slot=slot)
                      for dim in partial if dim not in zero_dims]
            found += self._zero_sync(reduced, self.local_bytes(val, placements), partial, zero_dims, placements, slot)
        return found

    def _overlapped_where_lowered(self, reductions: list["Collective"]) -> list["Collective"]:
        """An FSDP parameter's gradient reductions as the runtime runs them. On DTensor they stay on the
        critical path. The lowered program (``passes/lower_buckets.bucket_gradient_scatters``) launches a
        layer's gradient reduce_scatter as soon as its last gradient exists and waits on it when backward
        ends, so it hides behind the rest of backward as data parallelism's buckets do: a gradient sync,
        redone in every microbatch's backward (priced, conservatively, behind the last one's compute).
        HSDP's replica-dim all_reduce stays inside backward's critical path on either runtime."""
        if self.runtime != LOWERED:
            return reductions
        return [replace(c, grad_sync=True, per_microbatch=True) if c.kind == "reduce_scatter" else c
                for c in reductions]

    def grad_partial_dims(self, node: fx.Node, strategy: Strategy, grad_kinds: Sequence[str],
                          views: Sequence[float | None] = ()) -> tuple[tuple[int, ...], ...]:
        """Per tensor input: the mesh dims on which ``strategy`` leaves that activation's gradient a
        partial sum (the input is ``R`` there and the output is not). Which collective reduces it
        depends on how the input arrived (``edge_collectives``), so the ILP's edges carry it; an
        activation read through a view (``views``) is priced with the op (``gradient_collectives``)."""
        out = strategy.outputs[0] if strategy.outputs else None
        if out is None or getattr(node.target, "is_view", False):
            return tuple(() for _ in strategy.inputs)
        return tuple(self._partial_dims(arg.meta["val"], placements, out)
                     if kind == "activation" and not (views and views[slot] is not None) else ()
                     for slot, (arg, placements, kind) in enumerate(zip(tensor_inputs(node), strategy.inputs, grad_kinds)))

    def partial_reduction(self, val: torch.Tensor, placements: Placements, dims: Sequence[int], share: float,
                          redistributed_from: Placements | None, slot: int | None = None,
                          nbytes: float | None = None) -> list["Collective"]:
        """How a gradient left partial on ``dims`` (at ``placements``) is reduced. Where the value was
        redistributed on its way (``redistributed_from``: the placement it came from), the
        redistribute's backward reduces it, on each dim: reduce-scattered onto the shard where it was
        sharded, all-reduced elsewhere (DTensor's ``Redistribute`` backward), once per redistribute,
        which the readers needing the value in one placement share (``passes/insert_redistributes.py``).
        Otherwise the partial gradients of the value's readers are summed (autograd) and reduced once
        with an all_reduce where an op needs them whole. Either way each reader pays ``share`` of it.
        ``nbytes``: the gradient's bytes when not the value's in the compute dtype (a parameter's, in the
        reduction dtype)."""
        nbytes = self.local_bytes(val, placements) if nbytes is None else nbytes
        if redistributed_from is None:
            return [Collective("all_reduce", "backward", nbytes, d, placements, slot=slot, share=share) for d in dims]
        return [Collective("reduce_scatter" if redistributed_from[d].is_shard() else "all_reduce", "backward",
                           nbytes * self._regathered_first(redistributed_from, placements, d), d, placements,
                           slot=slot, share=share) for d in dims]

    def _regathered_first(self, source: Placements, read: Placements, dim: int) -> int:
        """How many times more than the gradient read at ``read`` the reduce_scatter onto ``source``'s shard
        on ``dim`` moves. DTensor's redistribute backward moves the gradient back one mesh dim at a time,
        inner dims first (``redistribute_steps``): an inner dim that shards the same tensor dim as ``dim`` in
        ``source`` holds its shard nested inside ``dim``'s, which the gradient, partial on ``dim``, does not
        have, so where the reader holds that inner dim sharded it is all-gathered first (that all_gather is
        the dual of the forward's re-slice, ``edge_collectives``) and the reduce_scatter moves its size times
        more. Asked of ``source``'s tensor dims and of ``read``'s mesh dims only: a view between them may
        renumber the tensor's dims."""
        if not source[dim].is_shard():
            return 1
        return self._ranks([j for j in range(dim + 1, len(source))
                            if source[j].is_shard(source[dim].dim) and read[j].is_shard()])

    def _partial_dims(self, val: torch.Tensor, placements: Placements, out: Placements) -> tuple[int, ...]:
        if not val.dtype.is_floating_point:
            return ()  # no gradient flows back into this input
        return tuple(d for d, group in enumerate(self.groups)
                     if placements[d].is_replicate() and not out[d].is_replicate() and group.size > 1)

    def _zero_dims(self, val: torch.Tensor, placements: Placements) -> tuple[int, ...]:
        """The dims (dp, and cp where the mesh has it: ``core.axes.ZERO_AXES``), in mesh order, on which
        ZeRO-1/2 shards this parameter's state, as ``passes/zero.py`` does (none without ZeRO)."""
        if self.zero_stage not in (1, 2):
            return ()
        dims = tuple(d for d in self.zero_dims if placements[d].is_replicate() and self.mesh_shape[d] > 1)
        return dims if optimizer_shard_dim(tuple(val.shape), placements, self._ranks(dims)) is not None else ()

    def _ranks(self, dims: Sequence[int]) -> int:
        """The number of ranks the mesh ``dims`` span together."""
        ranks = 1
        for d in dims:
            ranks *= self.mesh_shape[d]
        return ranks

    def optimizer_shards(self, val: torch.Tensor, placements: Placements) -> int:
        """Into how many pieces ZeRO-1/2 cuts this parameter shard's optimizer state (1 without)."""
        return self._ranks(self._zero_dims(val, placements))

    def zero_share(self, dim: int, zero_dims: Sequence[int]) -> float:
        """The share of a parameter's whole gradient (and of its whole value) that ZeRO-1/2's collective
        on ``dim`` moves, where the state is sharded over ``zero_dims`` (dp x cp). DTensor redistributes a
        gradient partial on both to ``Shard(d)`` on both one mesh dim at a time, outermost first, each on
        what the one before left (torch ``distributed/tensor/_redistribute.py``: dp's reduce_scatter of
        the whole, then cp's of dp's 1/dp), and gathers the parameter back innermost first (cp's
        all_gather to 1/dp, dp's to the whole): the collective on ``dim`` moves 1 / (the ranks of the
        ZeRO dims outside it). Under uniform bandwidth the two sum to one collective over dp x cp."""
        return 1.0 / self._ranks([d for d in zero_dims if d < dim])

    def _zero_sync(self, reduced: float, gathered: float, partial: Sequence[int], zero_dims: Sequence[int],
                   placements: Placements, slot: int) -> list["Collective"]:
        """ZeRO-1/2's sync of a parameter whose state is sharded over ``zero_dims``: on each, the
        reduce_scatter of its gradient (of ``reduced`` bytes whole, in the reduction dtype) where the
        gradient is ``partial`` (elsewhere every rank holds it whole and keeps its slice, as DTensor's
        ``Replicate -> Shard`` does, moving nothing), and the all_gather of the updated parameter (of
        ``gathered`` bytes whole, in the compute dtype), each moving ``zero_share`` of them."""
        every_microbatch = self.zero_stage == 2
        found = []
        for dim in zero_dims:
            share = self.zero_share(dim, zero_dims)
            if dim in partial:
                found.append(Collective("reduce_scatter", "backward", reduced * share, dim, placements,
                                        grad_sync=True, slot=slot, per_microbatch=every_microbatch))
            found.append(Collective("all_gather", "backward", gathered * share, dim, placements, grad_sync=True,
                                    slot=slot))
        return found

    def gathered_bytes(self, val: torch.Tensor, placements: Placements) -> float:
        """Bytes of a parameter stored sharded over data parallelism (FSDP, ZeRO-3: ``Shard`` on a dp or cp
        dim, ``zero_dims``) once gathered whole on those dims to be read, in the compute dtype; 0 for a
        parameter not sharded there (``problem.gathered_units`` holds them while their unit runs)."""
        whole = tuple(Replicate() if d in self.zero_dims and p.is_shard() and self.mesh_shape[d] > 1 else p
                      for d, p in enumerate(placements))
        return 0.0 if whole == tuple(placements) else self.local_bytes(val, whole)

    def reduced_gradient_bytes(self, val: torch.Tensor, placements: Placements) -> float:
        """Bytes of a parameter shard's gradient as the reductions outside the program move it: in
        ``reduce_dtype`` (``passes/gradient_sync.py`` and ``passes/zero.py`` cast to it)."""
        return self.local_numel(val, placements) * _DTYPE_BYTES[self.reduce_dtype]

    # ---- pipeline ----------------------------------------------------------------------------
    def stage_transfer(self, nbytes: float, copies_dim: int | None) -> float:
        """Seconds to hand a tensor of ``nbytes`` per device to the next pipeline stage. A tensor that
        every rank of mesh dim ``copies_dim`` holds whole is sent as slices, one per rank, and
        all-gathered on arrival (Megatron's scatter/gather optimization, Narayanan et al., SC21 §4.1)."""
        if self.stages == 1:
            return 0.0
        group = self.groups[copies_dim] if copies_dim is not None else None
        seconds = collective_time("send_recv", nbytes / (group.size if group else 1), self._stage_pair())
        if group is not None:
            seconds += collective_time("all_gather", nbytes, group)
        return seconds

    def tied_gradient_sum(self, nbytes: float) -> float:
        """Seconds to sum the gradient (``nbytes`` per device) of a weight tied across the first and the
        last stage (``passes/tied_parameters.py``): an all_reduce between the two copies' ranks after
        the schedule, on the critical path (Megatron-LM's embedding all_reduce)."""
        return collective_time("all_reduce", nbytes, self._stage_pair()) if self.stages > 1 else 0.0

    def _stage_pair(self):
        """The group of two ranks at the same place of two stages' meshes (across nodes when stages span
        nodes)."""
        crosses_nodes = self.stage_group.nodes > 1
        return replace(self.stage_group, size=2, per_node=1 if crosses_nodes else 2, nodes=2 if crosses_nodes else 1)

    # ---- placeholders ------------------------------------------------------------------------
    def gradient_accumulation(self) -> Cost:
        """A parameter's gradient accumulation into ``.grad``: one host dispatch in backward, per microbatch."""
        dispatch = compute_time(0.0, 0.0, self.cluster.device, self.dtype, "elementwise")
        return Cost(compute_s=dispatch, backward_compute_s=dispatch, accumulate_s=dispatch)

    def parameter_memory(self, val: torch.Tensor, placements: Placements, frozen: bool = False,
                         float8: bool = False) -> dict[str, float]:
        """Bytes of a parameter's local shard: the parameter, its gradient and its AdamW state, as
        ``passes/mixed_precision.py`` and ``passes/zero.py`` keep them; with ``float8`` (a weight float8 linears
        read: ``float8_weights``), in ``params`` its e4m3 copy too, one byte an element, made once a step
        (``passes/float8.StepCasts``). A ``frozen`` parameter
        (``CapturedGraph.frozen_parameters``) has neither gradient nor state, and ZeRO leaves it whole: it is
        kept in the compute dtype (``mixed_precision.as_master``), the copy the program reads.

        The optimizer steps parameters in ``master_dtype`` (``precision.master``): AdamW's moments, and
        the master weights where they are not the program's parameters (mixed precision: a compute dtype
        narrower than the masters'; ZeRO-1/2's shards), are ``optimizer`` (``adamw_state_bytes``);
        ``params`` is what the program computes with, in the compute dtype. A parameter's gradient
        accumulates on its master (through the compute copy's backward, or on the master itself when the
        program computes in the masters' dtype), except under ZeRO-1/2 (Rajbhandari et al., SC20),
        where a parameter whose state is split over dp (and cp: ``_zero_dims``) keeps only its share of
        that state, computes with a whole parameter in the compute dtype and accumulates its gradient
        there (ZeRO-1), or reduce-scatters it every microbatch onto its master shard (ZeRO-2: only the
        shard's gradient is kept). ZeRO-3 is a parameter sharded on those dims, which ``local_numel``
        already divides. Per parameter without ZeRO: 18 bytes with fp32 masters under bf16 (2 + 4 + 12,
        Megatron-LM's count for bf16 parameters with fp32 gradients), 8 with bf16 masters (2 + 2 + 4, and
        4 more for fp32 reductions: ``_widened_gradient_bytes``);
        under ZeRO-1 over dp ranks, 2 + 2 + 12/dp and 2 + 2 + (2 + 4)/dp (Apex DistributedFusedAdam with
        ``dtype=torch.bfloat16``).
        """
        numel = int(self.local_numel(val, placements))
        compute = numel * self.element_bytes(val)
        copy = numel if float8 else 0.0
        master_bytes = _DTYPE_BYTES[master_dtype_of(self.dtype, self.master_dtype)]
        master = numel * master_bytes
        if frozen:
            return {"params": compute + copy, "grads": 0.0, "optimizer": 0.0}
        shards = self.optimizer_shards(val, placements)
        if shards == 1:
            grads = master + self._widened_gradient_bytes(numel, master_bytes, placements)
        else:
            grads = compute if self.zero_stage == 1 else master / shards
        return {
            "params": compute + copy,
            "grads": grads,
            "optimizer": adamw_state_bytes(numel, self.dtype, self.master_dtype, sharded=shards > 1) / shards,
        }

    def _widened_gradient_bytes(self, numel: int, grad_bytes: int, placements: Placements) -> float:
        """Bytes data parallelism's gradient sync (``passes/gradient_sync.py``) holds beside a gradient of
        ``grad_bytes`` an element that it all-reduces (replicated on dp or cp) in a wider ``reduce_dtype``
        (bf16 masters, fp32 reductions): the bucket's widened copy, until the reduction hands the gradient
        back in its own dtype. A gradient as wide as its reduction is handed back as a view of the
        bucket, which replaces it: none."""
        reduced = any(placements[d].is_replicate() and self.mesh_shape[d] > 1 for d in self.zero_dims)
        widened = _DTYPE_BYTES[self.reduce_dtype] > grad_bytes
        return numel * _DTYPE_BYTES[self.reduce_dtype] if reduced and widened else 0.0

    # ---- edges -------------------------------------------------------------------------------
    def edge_prices(self) -> "EdgePrices":
        """This pricer's resharding prices (``edge``), to share with another pricer of its mesh
        (``share_edge_prices``)."""
        return EdgePrices(self._edge_signature(), self._edge_cache)

    def share_edge_prices(self, prices: "EdgePrices") -> None:
        """Keep the prices of reshardings (``edge``) with ``prices``, another pricer's of the same mesh, dtype
        and runtime, which may differ in its ZeRO stage (and so in its parameters' state and gradient sync),
        on which no resharding's price depends (``edge_collectives``)."""
        if prices.signature != self._edge_signature():
            raise ValueError("edge prices are shared only between pricers of one mesh, dtype and runtime")
        self._edge_cache = prices.cache

    def _edge_signature(self) -> tuple:
        return (self.cluster, self.mesh_shape, self.stages, self.dtype, self.runtime, self.fp8)

    def edge(self, val: torch.Tensor, src: Placements, dst: Placements, per_microbatch: bool = False,
             grad_partial: tuple[int, ...] = (), regathered: bool = False, partial_share: float = 1.0,
             shared: bool = False, gradient: bool = True) -> Cost:
        """Resharding ``val`` from ``src`` to ``dst``, and reducing its gradient where the consumer
        leaves it partial (``grad_partial``: mesh dims; this edge's ``partial_share`` of that
        reduction); ``per_microbatch``: the tensor is the same for every microbatch (a parameter), so
        under gradient accumulation its collectives repeat; ``regathered``: a value the consumer saves
        for backward, moved again in backward (``moved_again``); ``shared``: the move itself (its forward
        collectives and their duals) is charged once to the readers that share it
        (``problem.SharedResharding``), not here; ``gradient``: whether ``val`` gets one (else the moves
        have no backward)."""
        key = (tuple(val.shape), val.dtype, src, dst, per_microbatch, grad_partial, regathered, partial_share, shared,
               gradient)
        cost = self._edge_cache.get(key)  # one lookup: hashing DTensor placements is not cheap
        if cost is None:
            cost = self._edge_cache[key] = self._edge(val, src, dst, per_microbatch, grad_partial, regathered,
                                                      partial_share, shared, gradient)
        return cost

    def _edge(self, val: torch.Tensor, src: Placements, dst: Placements, per_microbatch: bool,
              grad_partial: tuple[int, ...], regathered: bool, partial_share: float, shared: bool,
              gradient: bool) -> Cost:
        cost = Cost(repeats_per_microbatch=per_microbatch)
        for c in self.edge_collectives(val, src, dst, grad_partial, regathered, partial_share, shared, gradient):
            seconds = self.collective_seconds(c)
            prefetched = self.prefetched(c, per_microbatch)
            if prefetched and c.regather:  # in backward, beside backward's compute and gradient sync
                cost.grad_sync_s += seconds
                cost.grad_sync_per_microbatch_s += seconds
                if not per_microbatch:
                    cost.split_regather_s += seconds
                continue
            if prefetched:  # in forward, beside forward's compute
                cost.prefetched_s += seconds
            else:
                cost.add_comm(c.kind, seconds)
            if c.phase == "forward" and seconds > 0 and not regathered:  # else already run again in backward
                cost.forward_comm_s[c.kind] = cost.forward_comm_s.get(c.kind, 0.0) + seconds
        return cost

    def prefetched(self, c: "Collective", parameter: bool) -> bool:
        """Whether ``c``, a move of a parameter (``parameter``) or of an activation, overlaps compute where the
        runtime runs it. The lowered program's gathers of an FSDP unit
        (``passes/lower_buckets.bucket_parameter_gathers``) are one all_gather a unit, issued a unit ahead: in
        forward they hide behind forward's compute (``Cost.prefetched_s``). In backward, a parameter's
        regathers, and an activation's (``lower_buckets.launch_regathers_ahead``: launched before the matmul
        ahead of its readers, as Megatron-LM's sequence-parallel linear layers do), share the gradient sync's
        budget (they run on the same links while backward computes). Both are constraint (3)'s
        (``OverlapSlack``)."""
        return self.runtime == LOWERED and c.kind == "all_gather" and (c.regather or parameter and c.phase == "forward")

    def edge_collectives(self, val: torch.Tensor, src: Placements, dst: Placements,
                         grad_partial: tuple[int, ...] = (), regathered: bool = False,
                         partial_share: float = 1.0, shared: bool = False, gradient: bool = True
                         ) -> list["Collective"]:
        """Collectives that move ``val`` from placement ``src`` to ``dst``, per mesh dim, forward and
        (the dual) backward; sizes are of the tensor as the group sees it (gathered on that dim).

        On each dim of ``grad_partial`` the consumer leaves the gradient a partial sum, reduced as
        ``partial_reduction`` says: by this edge's redistribute when it has one (arrived by an
        all_gather, ``S -> R``, it goes back as a reduce_scatter onto the shard), else all-reduced
        once for all readers (Megatron's "f" on the critical path). With ``regathered`` every forward
        collective is listed again, in backward (``regather``), after the others. ``shared``: the
        move is charged elsewhere (``Pricer.edge``), so only the reduction and the regathers are
        listed. A ``val`` without ``gradient`` (inputs, buffers and what is made of them alone: a rotary
        table's slice) has no backward: its moves list no dual."""
        found = self.partial_reduction(val, dst, grad_partial, partial_share, src if src != dst else None)
        moves = []
        for dim, a, b, after in redistribute_steps(src, dst, self.mesh_shape):
            if self.groups[dim].size == 1:
                continue
            seen = _seen_by_group(a, b, after, dim)
            for phase, kinds in zip(("forward", "backward")[:1 + gradient], _transition(a, b)):
                moves += [Collective(kind, phase, self.local_bytes(val, seen), dim, seen) for kind in kinds]
        if not shared:
            found += moves
        if regathered:
            found += [replace(c, phase="backward", regather=True) for c in moves if c.phase == "forward"]
        return found


@dataclass(frozen=True)
class EdgePrices:
    """A pricer's resharding prices by (value, placements, flags) (``Pricer.edge``), and what they depend on."""

    signature: tuple
    cache: dict[tuple, Cost]


@dataclass(frozen=True)
class Collective:
    """One collective a strategy or a resharding implies: what the cost formulas and views need."""

    kind: str
    phase: str  # forward | backward
    nbytes: float  # full-tensor bytes as the group sees it (collective_time's convention)
    mesh_dim: int
    placements: Placements  # of the tensor as the group sees it (nbytes are its local bytes)
    grad_sync: bool = False  # a parameter's gradient sync (overlapped with backward)
    slot: int | None = None  # for an input gradient: which tensor input of the node
    per_microbatch: bool = False  # a gradient sync redone after every microbatch (ZeRO-2's reduce_scatter)
    regather: bool = False  # a forward collective run again in backward (``moved_again``)
    share: float = 1.0  # the part of it charged here (a gradient several readers leave partial is reduced once)


def dispatched_by(cluster: Cluster, runtime: str) -> Cluster:
    """``cluster`` with the host dispatch per op of ``runtime``: the lowered runtime's
    (``DeviceSpec.lowered_host_op_s``) where the device states one, else DTensor's ``host_op_s``."""
    device = cluster.device
    if runtime != LOWERED or device.lowered_host_op_s is None:
        return cluster
    return replace(cluster, device=replace(device, host_op_s=device.lowered_host_op_s))


def bucketed_all_reduce_time(nbytes: float, group) -> float:
    """A gradient's share of a bucketed all_reduce: its bandwidth term only.

    Gradients are reduced in buckets of ~25 MB (PyTorch DDP's default), so a parameter pays for its
    bytes while the per-collective latency is paid once per bucket, not once per parameter; we charge
    the marginal time of the formula (t(n) - t(1 byte)), which is that bandwidth term.
    """
    return max(0.0, collective_time("all_reduce", nbytes, group) - collective_time("all_reduce", 1.0, group))


def in_step_collective_time(kind: str, nbytes: float, group, redistribute_s: float) -> float:
    """Seconds a collective run by DTensor inside a step adds to it: the link's formula plus the
    device's per-collective ``redistribute_s`` (measured by ``autopar calibrate``); nothing for a
    collective that moves nothing (a group of one)."""
    seconds = collective_time(kind, nbytes, group)
    return seconds + redistribute_s if seconds > 0 else 0.0


def moved_again(kept: bool, parameter: bool, src: Placements, dst: Placements, mesh_shape: Sequence[int]) -> bool:
    """Whether the runtime moves a value from ``src`` to ``dst`` again in backward, rather than hold the moved
    copy its reader keeps for backward (``kept``): every move of a parameter (``passes/reshard.py``, FSDP's
    reshard after forward), a move of an activation that makes it larger on each rank (sequence
    parallelism's gather of a norm's output for the projections that keep it, context parallelism's of keys
    and values: ``passes/rematerialize.py``, Megatron-LM's sequence-parallel linear layers). The memory
    model charges what is kept in its producer's placement, which these runtimes then hold."""
    return kept and (parameter or grows_locally(src, dst, mesh_shape))


def weight_amax(c: "Collective", weight_slot: int) -> bool:
    """Whether ``c``, one of a float8 linear's ``amax_collectives``, reduces its weight's amax (in forward): once a
    step where the weight is read as stored (``passes/float8.StepCasts``), every microbatch where it is ``moved``."""
    return c.phase == "forward" and c.slot == weight_slot


def moved(root: Placements, placements: Placements) -> bool:
    """Whether a tensor placed ``root`` is redistributed on its way to be read at ``placements``: split on a mesh
    dim in one and not in the other (gathered, or sliced), or partial in one of them (a view may move the
    split tensor dim, not split or join the tensor)."""
    return any(r.is_shard() != p.is_shard() or r.is_partial() != p.is_partial() for r, p in zip(root, placements))


def gathers(root: Placements, placements: Placements) -> bool:
    """Whether a tensor placed ``root`` is gathered on some mesh dim to be read at ``placements``
    (sharded there, replicated here; a view may move the sharded tensor dim, not unshard it)."""
    return any(r.is_shard() and p.is_replicate() for r, p in zip(root, placements))


def redistribute_steps(src: Placements, dst: Placements, mesh_shape: Sequence[int]
                       ) -> list[tuple[int, Placement, Placement, Placements]]:
    """The one-mesh-dim moves DTensor makes to redistribute ``src`` to ``dst``, in order: (mesh dim, from,
    to, the placements after the move). This is DTensor's default (greedy) planner, torch
    ``distributed/tensor/_redistribute.py``'s ``generate_greedy_transform_infos``, restated so that
    pricing needs no device mesh: where the source has shards, the mesh dims are visited inner to
    outer, and a dim whose target shards a tensor dim that outer dims shard differently now and in the
    target (a nested shard out of order: FSDP's ``S(1)`` outside TP's ``S(1)``, read as ``(R, S(1))``) is
    first made ``Replicate``, all-gathered; then every dim still off its target is moved, outer to
    inner. So ``(S(1), S(1)) -> (R, S(1))`` is an all_gather on the inner dim, one of the whole tensor on
    the outer, and a local slice, not one all_gather of the inner shard (``tests/test_reshard.py`` holds
    this against DTensor's own plan)."""
    current = list(src)
    steps: list[tuple[int, Placement, Placement, Placements]] = []

    def move(dim: int, to: Placement) -> None:
        was, current[dim] = current[dim], to
        steps.append((dim, was, to, tuple(current)))

    if any(p.is_shard() and size > 1 for p, size in zip(src, mesh_shape)):
        for dim in reversed(range(len(current))):
            target = dst[dim]
            if target.is_shard() and ([i for i in range(dim) if current[i].is_shard(target.dim)]
                                      != [i for i in range(dim) if dst[i].is_shard(target.dim)]):
                target = Replicate()
            if current[dim] != target:
                move(dim, target)
    for dim, target in enumerate(dst):
        if current[dim] != target:
            move(dim, target)
    return steps


def _unsharded_on(placements: Placements, dim: int) -> Placements:
    return tuple(Replicate() if i == dim else p for i, p in enumerate(placements))


def _seen_by_group(src: Placement, dst: Placement, placements: Placements, dim: int) -> Placements:
    """The tensor as the collective moving ``src`` to ``dst`` on mesh dim ``dim`` counts it
    (``collective_time``'s convention): an all_to_all (``S(i) -> S(j)``) its per-rank buffer, split on
    that dim; the others the tensor gathered on it."""
    if src.is_shard() and dst.is_shard():
        return placements
    return _unsharded_on(placements, dim) if src.is_shard() or dst.is_shard() else placements


def _transition(src: Placement, dst: Placement) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(forward, backward) collectives that turn placement ``src`` into ``dst`` on one mesh dim."""
    s_shard, d_shard = src.is_shard(), dst.is_shard()
    s_part, d_part = src.is_partial(), dst.is_partial()
    s_whole, d_whole = src.is_replicate(), dst.is_replicate()
    if s_shard and d_whole:
        return ("all_gather",), ()
    if s_part and d_whole:
        return ("all_reduce",), ()
    if s_part and d_shard:
        return ("reduce_scatter",), ("all_gather",)
    if s_whole and d_shard:  # a local slice; its gradient is gathered back
        return (), ("all_gather",)
    if s_shard and d_shard:
        return ("all_to_all",), ("all_to_all",)
    if s_part and d_part:  # P(sum) <-> P(avg): reduce, then re-split for free
        return ("all_reduce",), ()
    if d_part and s_whole:
        return (), ()
    if s_shard and d_part:
        return ("all_gather",), ()
    raise AssertionError(f"no transition rule for {src} -> {dst}")


def is_matmul(node: fx.Node) -> bool:
    return getattr(node.target, "overloadpacket", None) in _MATMUL_PACKETS


def global_flops(node: fx.Node) -> float:
    packet = getattr(node.target, "overloadpacket", None)
    if packet is _SDPA:  # torch counts the fused kernels; the composite op has q, k, v first
        return float(sdpa_flop_count(*_sdpa_shapes(node)))
    if packet in flop_registry:
        args = _vals(node.args)
        kwargs = _vals(node.kwargs)
        return float(flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val")))
    vals = [v for v in output_vals(node) if isinstance(v, torch.Tensor)]
    return float(sum(v.numel() for v in vals))


def kernel_flops(node: fx.Node) -> float:
    """FLOPs the node's forward kernel runs: ``global_flops``, but for causal fused attention only the
    share of query-key pairs its mask keeps (``causal_share``). Flash attention skips the key blocks
    above the diagonal (Dao, "FlashAttention-2", 2023, section 3.1.1: "for causal masking ... we skip
    the computation of blocks" where all column indices exceed the row indices), so a causal kernel does
    about half of the products ``torch.utils.flop_counter`` counts; ``global_flops`` keeps the full count,
    the convention of model FLOPs (MFU) that ``assemble.model_flops`` reports."""
    flops = global_flops(node)
    if getattr(node.target, "overloadpacket", None) is _SDPA and _is_causal(node):
        q, k = (a.meta["val"] for a in node.args[:2])
        flops *= causal_share(q.shape[-2], k.shape[-2])
    return flops


def causal_share(queries: int, keys: int) -> float:
    """Share of the ``queries x keys`` score matrix a causal mask keeps: torch's ``is_causal`` is the
    top-left lower triangle (``torch.ones(L, S).tril()``), so query ``i`` sees ``min(i + 1, S)`` keys.
    ``(L + 1) / 2L`` for a square one: 0.5001 at 4,096 tokens."""
    if queries <= keys:
        kept = queries * (queries + 1) / 2
    else:
        kept = keys * (keys + 1) / 2 + (queries - keys) * keys
    return kept / (queries * keys)


def backward_ratio(node: fx.Node, grad_kinds: Sequence[str]) -> float:
    """Backward FLOPs over forward FLOPs of the node's kernel: ``MATMUL_BACKWARD_RATIO`` but for fused
    attention, whose backward recomputes the scores before its four gradient products (torch's
    ``sdpa_backward_flop_count``: five products against the forward's two, 2.5x with equal head dims).
    By the gradient kinds of its tensor inputs (``grad_kinds``): none where no input gets a gradient (an op
    on the inputs, buffers or frozen weights alone, which autograd leaves out of backward), half where a
    matmul's one operand gets none (a frozen weight's: only the input's gradient is computed)."""
    graded = [kind in _GRADED_KINDS for kind in grad_kinds]
    if not any(graded):
        return 0.0
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not _SDPA:
        operands = _MATMUL_OPERANDS.get(packet)
        if operands is not None and not all(graded[i] for i in operands if i < len(graded)):
            return MATMUL_BACKWARD_RATIO / 2
        return MATMUL_BACKWARD_RATIO
    q, k, v = _sdpa_shapes(node)
    out = (*q[:-1], v[-1])
    return sdpa_backward_flop_count(out, q, k, v) / sdpa_flop_count(q, k, v)


def _sdpa_shapes(node: fx.Node) -> tuple[tuple[int, ...], ...]:
    """Shapes of fused attention's q, k and v, ``[b, heads, s, d]``, with grouped-query attention's key
    and value heads broadcast to the query's as the kernel broadcasts them: the FLOPs are those of the
    broadcast products. torch's flop counter takes GQA shapes itself only from 2.13 on; earlier ones
    (``torch>=2.6`` is supported) raise on them."""
    q, k, v = (tuple(a.meta["val"].shape) for a in node.args[:3])
    heads = q[-3]
    return q, (*k[:-3], heads, *k[-2:]), (*v[:-3], heads, *v[-2:])


def _is_causal(node: fx.Node) -> bool:
    if len(node.args) > _SDPA_IS_CAUSAL_ARG:
        return bool(node.args[_SDPA_IS_CAUSAL_ARG])
    return bool(node.kwargs.get("is_causal", False))


def _vals(obj):
    if isinstance(obj, fx.Node):
        return obj.meta.get("val")
    if isinstance(obj, (list, tuple)):
        return type(obj)(_vals(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _vals(v) for k, v in obj.items()}
    return obj


