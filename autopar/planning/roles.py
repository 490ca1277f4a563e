"""Mesh-dim roles: how each mesh dim of a candidate constrains the ILP built for it.

Each mesh dimension has a role that the placeholders' candidate placements and the ``allow`` rules
encode (by the axis names plans spell; ``core/axes.py`` names them in code, ``dp`` as ``MeshAxis.DP_SHARD``):

* ``dp``: example inputs are split on their batch dimension (``S(0)``), buffers are replicated, and
  every op downstream of the inputs keeps its output split on this dim along the dimension that
  carries the batch (traced through DTensor's strategies, ``batch_dims``), or partial where it
  reduces the batch away: each rank works on its own share of the batch, never on a gathered copy. Parameters are replicated (DDP; ZeRO-1/2
  with ``fsdp`` 1/2, which shard the optimizer state and gradients in ``pricing.py``), sharded
  (``fsdp=3``, FSDP) or left to the solver. The gradient all_reduce follows from the strategies.
* ``dp_replicate`` (HSDP): a second data-parallel dim across nodes over which parameters stay
  replicated while ``dp`` shards them inside a node; ops place tensors alike on both dims.
* ``tp``: example inputs are replicated and every weight matrix (parameter of 2+ dims) is split on
  this dim; the ILP picks which dim (column/row, heads, vocabulary) and how activations flow
  between them (sharded, partial, or split on the sequence) from DTensor's strategies. Constraint
  ``sp`` pins sequence parallelism: 1 keeps the norms and the residual stream split on the sequence
  over tp, 0 keeps the norms off it (``sequence_parallel.py``).
* ``ep`` (expert parallelism): a data-parallel dim (inputs split on the batch, buffers and dense
  parameters replicated, their gradients all-reduced) over which every *expert weight* is split on its
  expert dim (``expert_weights``: a stack of matrices a batched matmul applies one per slice of the
  data). Data may be split over it on its batch dimension or on its expert dimension
  (``expert_dims``: traced from the expert weights, forward to the combine and back to the dispatch),
  so the ILP itself places the all_to_alls that move the dispatched tokens from the batch split to the
  expert split and back (``_tokens_split_on_batch_or_expert``). Beside a ``cp`` dim (``cp x ep``), a
  rank's tokens are a sequence shard, routed in groups within its chunks (``check_groups_within_a_chunk``).
"""

from __future__ import annotations
import math
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar
from autopar.core.axes import DATA_PARALLEL_AXES, ZERO_AXES, MeshAxis
from autopar.core.constraints import Constraints
from autopar.cost_models import Cluster
from autopar.core.errors import BadInputError
from autopar.ir.capture import (ATTENTION_QUERY_DIM, FUSED_ATTENTION, VIEWS, WEIGHT_KINDS, CapturedGraph,
                                 view_root)
from autopar.ir.layers import is_getitem, output_vals, tensor_inputs
from autopar.planning.meshes import MeshChoice, batch_inputs, global_batch, microbatch_counts
from autopar.ir.float8 import float8_linears, float8_weight_placeholders, reused_casts
from autopar.planning.pricing import Pricer
from autopar.planning.problem import (ALLOW_ANY, PricedAlike, Problem, Roles, Rule, build_problem,
                                      placeholder_candidates, source_of)
from autopar.planning.sequence_parallel import sequence_parallel_rule
from autopar.core.plan import ALLGATHER, DTENSOR, LOWERED, RING
from autopar.planning.strategies import (KEY_VALUE_SLOTS, StrategyFinder, merged_dim, ring_refusal, rings,
                                         sequence_view)
from torch import fx
from torch.distributed.tensor import Placement, Replicate, Shard
import torch

_R = TypeVar("_R")



OVERLAP_FRACTION = 0.8
"""Share of backward compute behind which bucketed gradient all_reduce can hide (the last bucket and
the first layers' gradients cannot overlap; PyTorch DDP, Li et al., VLDB 2020)."""


def pricer_for(cluster: Cluster, mesh: MeshChoice, dtype: str, constraints: Constraints,
               captured: CapturedGraph | None = None) -> Pricer:
    """The pricer of one stage of ``mesh`` for the runtime that runs it (``priced_runtime``); ``fsdp`` 1 or 2
    pins ZeRO-1/2 optimizer (and gradient) sharding; ``fp8`` prices ``captured``'s float8 linears so (it
    needs ``captured``)."""
    if constraints.fp8 is not None and captured is None:
        raise ValueError("a float8 pricer needs the captured step whose float8 linears it prices")
    zero = constraints.zero_stage if constraints.zero_stage in (1, 2) else 0
    runtime = priced_runtime(mesh, constraints)
    return Pricer(cluster, mesh.shape, dtype, stages=mesh.stages, zero_stage=zero,
                  zero_dims=mesh.dims_of(*ZERO_AXES), reduce_dtype=constraints.reduce_dtype or "fp32",
                  runtime=runtime, master_dtype=constraints.master_dtype or "fp32", fp8=constraints.fp8,
                  float8=float8_linears(captured) if constraints.fp8 else frozenset(),
                  float8_reused=reused_casts(captured) if constraints.fp8 else {},
                  float8_weights=float8_weight_placeholders(captured) if constraints.fp8 else frozenset())


def priced_runtime(mesh: MeshChoice, constraints: Constraints) -> str:
    """The runtime a plan on ``mesh`` is priced for: the one ``autoparallelize`` runs it on by default
    (``api.lowered_by_default``), as far as the mesh decides it. Pinned ``runtime=dtensor``: DTensor.
    Otherwise the lowered program wherever it runs every plan the mesh's problem offers: one stage, and
    keys and values gathered if a cp dim splits the sequence (pinned ``runtime=lowered`` offers only
    that). Elsewhere DTensor, whose prices are the lowered program's or above: a pipeline stage (its
    FSDP reductions, per microbatch, are not priced as overlapped), and a cp dim whose attention may be
    the ring, which runs on DTensor (a plan gathering keys and values there runs lowered all the same)."""
    if constraints.runtime == DTENSOR or mesh.stages > 1:
        return DTENSOR
    if constraints.runtime == LOWERED or mesh.size(MeshAxis.CP) == 1 or constraints.cp_attention == ALLGATHER:
        return LOWERED
    return DTENSOR


@dataclass(frozen=True)
class MeshTrace:
    """What every problem of one mesh reads the same way whatever its ZeRO stage (``problem_for``): the
    strategies (``finder``, which keeps those it has enumerated), the context-parallel rows, the ops
    downstream of the data, and where the batch and the sequence run through the graph; and what its first
    problem priced that the ZeRO stage does not change (``priced``, filled by ``build_problem`` and
    ``with_edges``)."""

    finder: StrategyFinder
    rows: tuple[int, int]
    on_data: set[str]
    constants: set[str]  # ops computed from neither the data nor the parameters (``_constants_stay_whole``)
    batch: dict[tuple[str, int], int | None]
    seq: dict[tuple[str, int], int | None]
    priced: PricedAlike = field(default_factory=PricedAlike)


def mesh_trace(captured: CapturedGraph, mesh: MeshChoice, cp_attention: str | None) -> MeshTrace:
    """``MeshTrace`` of ``mesh`` (``cp_attention``: the variant of fused attention its cp dim offers, None:
    both), its context parallelism checked (``check_context_parallel``, ``check_groups_within_a_chunk``)."""
    dp_dims, tp_dims = mesh.dims_of(*DATA_PARALLEL_AXES), mesh.dims_of(MeshAxis.TP)
    shard_dims, replica_dims = mesh.dims_of(MeshAxis.DP_SHARD), mesh.dims_of(MeshAxis.DP_REPLICATE)
    cp_dims, ep_dims = mesh.dims_of(MeshAxis.CP), mesh.dims_of(MeshAxis.EP)
    rows = check_context_parallel(captured, mesh.size(MeshAxis.CP), cp_attention) if cp_dims else (0, 0)
    copies = {r: shard_dims[0] for r in replica_dims} if shard_dims else {}
    finder = StrategyFinder(mesh.shape, copies, sequence_dims=cp_dims, rows=rows, cp_attention=cp_attention)
    on_data = _downstream_of(captured.graph, set(captured.user_inputs))
    constants = {node.name for node in captured.graph.nodes if node.op == "call_function"} \
        - on_data - _downstream_of(captured.graph, set(captured.params))
    traced_on = (dp_dims + ep_dims + tp_dims)[:1]  # any split mesh dim traces the batch dim alike
    batch = batch_dims(captured, on_data, traced_on[0], finder) if traced_on else {}
    seq = sequence_dims(captured, on_data, cp_dims[0], finder) if cp_dims else {}
    if cp_dims:
        check_groups_within_a_chunk(captured, mesh.size(MeshAxis.CP), on_data, seq, rows)
    return MeshTrace(finder, rows, on_data, constants, batch, seq)


def mesh_cp_attention(pricer: Pricer, constraints: Constraints) -> str | None:
    """The fused attention a cp dim offers: as pinned; under the lowered runtime, which runs no ring attention
    (eager only), keys and values gathered; else both."""
    return constraints.cp_attention or (ALLGATHER if pricer.runtime == LOWERED else None)


def problem_for(captured: CapturedGraph, mesh: MeshChoice, pricer: Pricer, capacity: float,
                constraints: Constraints, trace: MeshTrace | None = None, edges: bool = True) -> Problem:
    """The ILP of one stage under the dims' roles. ``dp`` and ``dp_replicate`` split the batch;
    parameters are replicated on ``dp_replicate`` (HSDP's replica groups) and, on ``dp`` and ``cp``,
    replicated (fsdp 0-2), sharded (fsdp 3, and always under HSDP) or free for the solver to choose.
    ``trace``: the mesh's ``MeshTrace`` from an earlier problem of it (the search's ZeRO-1 try of a mesh
    reuses its first problem's, with what that problem priced: ``MeshTrace.priced``), made here when not given.
    ``edges``: as ``build_problem``'s."""
    shape = mesh.shape
    dp_dims = mesh.dims_of(*DATA_PARALLEL_AXES)
    shard_dims = mesh.dims_of(MeshAxis.DP_SHARD)
    replica_dims = mesh.dims_of(MeshAxis.DP_REPLICATE)
    tp_dims = [i for i, n in enumerate(mesh.names) if n == MeshAxis.TP]
    pins_buffers = {i: Replicate() for i in dp_dims}
    zero_stage = 3 if replica_dims else constraints.zero_stage
    pins_params = {i: Replicate() for i in (dp_dims if zero_stage in (0, 1, 2) else replica_dims)}
    cp_dims = mesh.dims_of(MeshAxis.CP)
    sharded_on_dp = shard_dims + cp_dims if zero_stage == 3 else []  # FSDP shards over dp x cp (torchtitan)
    ep_dims = mesh.dims_of(MeshAxis.EP)
    pins_buffers.update({i: Replicate() for i in ep_dims})
    trace = trace or mesh_trace(captured, mesh, mesh_cp_attention(pricer, constraints))
    on_data, batch = trace.on_data, trace.batch
    pins_buffers.update({i: Replicate() for i in cp_dims})
    pins_params.update({i: Replicate() for i in cp_dims if zero_stage in (0, 1, 2)})
    pins_inputs = {i: (Shard(0) if n in (*DATA_PARALLEL_AXES, MeshAxis.EP) else
                       Shard(SEQUENCE_DIM) if n == MeshAxis.CP else Replicate()) for i, n in enumerate(mesh.names)}
    param_candidates = _expert_split(captured, shape, pins_params, ep_dims)
    roles = Roles(
        param=lambda val: _split_matrices(param_candidates(val), val, tp_dims + sharded_on_dp),
        user_input=_inputs_split_on_batch(captured, shape, pins_inputs, dp_dims + ep_dims),
        buffer=placeholder_candidates(shape, pins_buffers),
        rule=_all_of(_batch_stays_split(dp_dims, on_data, batch),
                     _batch_only_on_data_parallel(captured, shape, tp_dims, on_data, batch,
                                                  smallest_microbatch(captured, mesh, constraints)),
                     _constants_stay_whole(dp_dims + ep_dims, trace.constants),
                     _no_average_partials_on(tp_dims),
                     _sequence_stays_split(cp_dims, on_data, trace.seq, trace.rows[1]),
                     _tokens_split_on_batch_or_expert(captured, ep_dims, on_data, batch, trace.finder),
                     _weights_stay_split(captured, tp_dims),
                     _replicas_act_as_shards(replica_dims, shard_dims),
                     sequence_parallel_rule(captured, tp_dims, constraints.sp)),
    )
    return build_problem(captured, trace.finder, pricer, roles, capacity, OVERLAP_FRACTION,
                         gathered_by_parameter=constraints.runtime == DTENSOR, edges=edges, priced=trace.priced)


def _split_matrices(cands: list, val: torch.Tensor, dims: list[int]) -> list:
    """A weight matrix is split on each of ``dims`` (tp dims; dp dims under fsdp=3) when it can be."""
    if val.ndim < 2 or not dims:
        return cands
    split = [c for c in cands if all(not c[d].is_replicate() for d in dims)]
    return split or cands


def _batch_stays_split(dp_dims: list[int], on_data: set[str], batch: dict[tuple[str, int], int | None]):
    """Data-parallel role: ops that depend on the inputs read the data split on dp along its batch
    dimension and keep their output split there (``batch_dims``), or partial where the op reduces the
    batch away (the loss): each rank works on its own share of the batch. Gathering the data on dp, or
    splitting another dimension over it (heads, sequence), would be tensor or context parallelism on
    the dp dim under the wrong name, which the role forbids. Where no strategy of an op keeps the
    batch dimension traceable, its output only has to stay split (any dimension) or partial on dp.
    What each op requires is worked out once per op (``_DataSplits``, ``_once_per_op``)."""
    if not dp_dims:
        return ALLOW_ANY
    required = _once_per_op(lambda node: _DataSplits.of(node, on_data, batch))

    def allow(node: fx.Node, strategy) -> bool:
        if node.name not in on_data:
            return True
        splits = required(node)
        return splits is None or splits.allow(strategy, dp_dims)

    return Rule(allow, lambda node: node.name in on_data and required(node))


def _constants_stay_whole(dims: list[int], constants: set[str]):
    """Data-parallel roles (``dp``, ``dp_replicate``, ``ep``): an op computed from neither the data nor the
    parameters (positions, masks, rotary tables: made from ``arange`` and buffers, which are replicated
    there) keeps its outputs whole on these dims. Every rank reads all of such a value beside its own share
    of the batch, so splitting it (or leaving it partial) there only adds a gather; and a split over a
    data-parallel dim would be tensor or context parallelism under the wrong name, which
    ``_batch_stays_split`` forbids the data. (A cp dim is not among them: it splits a sequence's positions
    and tables with the sequence.) Without this rule such an op had every placement on each of these dims:
    DeepSeek-V3's causal mask had 144 options on a ``dp x ep x tp`` mesh, 4 (tp's) with it."""
    if not dims:
        return ALLOW_ANY

    def allow(node: fx.Node, strategy) -> bool:
        if node.name not in constants:
            return True
        return all(p is None or all(p[d].is_replicate() for d in dims) for p in strategy.outputs)

    return Rule(allow, lambda node: node.name in constants)


@dataclass(frozen=True)
class _DataSplits:
    """What a data op's strategy must do on the data-parallel dims (``_batch_stays_split``): read each data
    input split on its traced batch dim (``inputs``: slot and that ``Shard``, or None where the trace lost
    the dim: any split or partial), and keep its output split on its own (``output``), or, where the trace
    lost that, split on any dim or partial when the op reduces the data (``reduces``)."""

    inputs: tuple[tuple[int, Placement | None], ...]
    output: Placement | None
    reduces: bool

    @staticmethod
    def of(node: fx.Node, on_data: set[str], split: dict[tuple[str, int], int | None]) -> "_DataSplits | None":
        """``node``'s requirements; None where it has none (its main output is not a tensor, or a scalar)."""
        val = _main_output(node)
        if not isinstance(val, torch.Tensor) or val.ndim == 0:
            return None
        args = tensor_inputs(node)
        inputs = []
        for slot, arg in enumerate(args):
            if arg.name in on_data and arg.meta["val"].ndim > 0:
                dim = split.get(_value_of(arg))
                inputs.append((slot, Shard(dim) if dim is not None else None))
        want = split.get((node.name, 0))
        reduces = val.numel() < max((a.meta["val"].numel() for a in args if a.name in on_data), default=0)
        return _DataSplits(tuple(inputs), Shard(want) if want is not None else None, reduces)

    def allow(self, strategy, dims: list[int]) -> bool:
        out = strategy.outputs[0]
        if out is None:
            return True
        for slot, want in self.inputs:
            if slot >= len(strategy.inputs):
                break
            if not _stays_split(strategy.inputs[slot], want, dims):
                return False
        if self.output is not None:
            return all(out[d] == self.output for d in dims)
        return all(out[d].is_shard() or (self.reduces and out[d].is_partial()) for d in dims)


def batch_dims(captured: CapturedGraph, on_data: set[str], dp_dim: int, finder: StrategyFinder
               ) -> dict[tuple[str, int], int | None]:
    """(node, output index) -> the dimension of that output that carries the batch, traced from the
    user inputs' dim 0 through the strategies DTensor gives each op: the dim an output is split on
    when every data input is split on its own batch dim (None: the op reduces the batch away, or the
    strategies leave it ambiguous)."""
    carriers = batch_inputs(captured)  # a 0-dim input, or positions every sample reads, hold no batch
    batch: dict[tuple[str, int], int | None] = {(name, 0): 0 if name in carriers else None
                                                for name in captured.user_inputs}
    for node in captured.graph.nodes:
        if node.op != "call_function" or node.name not in on_data or is_getitem(node):
            continue
        args = [(slot, batch.get(_value_of(a))) for slot, a in enumerate(tensor_inputs(node))
                if a.name in on_data and a.meta["val"].ndim > 0]
        for i, dims in enumerate(_traced_splits(finder, node, dp_dim, args)):
            batch[node.name, i] = next(iter(dims)) if len(dims) == 1 else None
    return batch


def _traced_splits(finder: StrategyFinder, node: fx.Node, mesh_dim: int, args: list[tuple[int, int | None]]
                   ) -> tuple[frozenset[int], ...]:
    """Per output of ``node``, the dims its strategies split it on over ``mesh_dim`` when each input slot of
    ``args`` is split on its traced dim there (``batch_dims``, ``sequence_dims``); none where an input's
    dim was lost (None)."""
    if any(dim is None for _, dim in args):
        return (frozenset(),) * len(output_vals(node))
    return finder.output_splits(node, mesh_dim, tuple((slot, Shard(dim)) for slot, dim in args))


def _batch_only_on_data_parallel(captured: CapturedGraph, shape: tuple[int, ...], tp_dims: list[int],
                                 on_data: set[str], batch: dict[tuple[str, int], int | None], samples: int):
    """The batch is split over a tp dim only where every microbatch divides: no op splits a value's batch
    dimension (``batch_dims``) over mesh dims including a tp dim unless that dimension, at ``samples``
    samples (the fewest a microbatch of this search can hold, ``smallest_microbatch``), divides by the
    product of those dims. A plan runs ``m`` microbatches of ``B / m`` samples, which ``dp`` divides
    (``meshes.microbatch_counts``) where ``dp x tp`` need not: with one sample per dp rank a tp split of a
    plain batch dim leaves one rank all the work and the others none, where the whole-batch price divides
    it by tp. What one sample brings to the dimension counts (the sequence, in a ``[batch * seq, ...]``
    flattening), so a flattened value may split its rows over tp."""
    if not tp_dims:
        return ALLOW_ANY
    whole_batch = global_batch(captured) or 1

    def batch_split(value: tuple[str, int]) -> tuple[Placement, int | None] | None:
        """The split of ``value``'s batch dim and the size of that dim in the smallest microbatch (None
        where it is no whole multiple of the samples); None where the trace lost the dim."""
        dim = batch.get(value)
        if dim is None:
            return None
        per_sample, rest = divmod(int(output_vals(captured.node(value[0]))[value[1]].shape[dim]), whole_batch)
        return Shard(dim), samples * per_sample if rest == 0 else None

    splits = _once_per_op(lambda node: (  # per data op: its inputs' and outputs' ``batch_split``s
        tuple((slot, batch_split(_value_of(a))) for slot, a in enumerate(tensor_inputs(node)) if a.name in on_data),
        tuple((i, batch_split((node.name, i))) for i in range(len(output_vals(node))))))

    def even_for_every_microbatch(placements, shard: Placement, rows: int | None) -> bool:
        if not any(placements[d] == shard for d in tp_dims):
            return True
        split = math.prod(size for size, p in zip(shape, placements) if p == shard)
        return rows is not None and rows % split == 0

    def allow(node: fx.Node, strategy) -> bool:
        if node.name not in on_data:
            return True
        inputs, outputs = splits(node)
        for placed, wanted in ((strategy.inputs, inputs), (strategy.outputs, outputs)):
            for slot, split in wanted:
                if (split is not None and slot < len(placed) and placed[slot] is not None
                        and not even_for_every_microbatch(placed[slot], *split)):
                    return False
        return True

    return Rule(allow, lambda node: node.name in on_data and splits(node))


def smallest_microbatch(captured: CapturedGraph, mesh: MeshChoice, constraints: Constraints) -> int:
    """The samples every microbatch of a search on ``mesh`` is a multiple of: the greatest common divisor of
    ``B / m`` over the microbatch counts ``m`` it may try (``meshes.microbatch_counts``)."""
    whole_batch = global_batch(captured) or 1
    counts = microbatch_counts(whole_batch, mesh.data_parallel_size, constraints)
    return math.gcd(*(whole_batch // m for m in counts)) if counts else whole_batch


def _no_average_partials_on(tp_dims: list[int]):
    """No op leaves a tensor (other than a scalar: the loss) partial by average on a tp dim, as a mean over
    a tp-split dim does (an RMSNorm's mean of squares over hidden-split activations). DTensor cannot run
    the backward of moving such a value: its gradient arrives partial by sum, and DTensor refuses to turn
    ``P(sum)`` into ``P(avg)``, so the plan would fail at its first backward. The op reads its input whole,
    or split on another dim, instead."""
    if not tp_dims:
        return ALLOW_ANY

    def allow(node: fx.Node, strategy) -> bool:
        for out, val in zip(strategy.outputs, output_vals(node)):
            if out is not None and getattr(val, "ndim", 0) > 0 and any(
                    out[d].is_partial() and getattr(out[d], "reduce_op", "sum") == "avg" for d in tp_dims):
                return False
        return True

    return Rule(allow, lambda node: tuple(getattr(val, "ndim", 0) > 0 for val in output_vals(node)))


def _keeps_batch(placements, batch_dim: int | None, ndim: int, dp_dims: list[int]) -> bool:
    """Whether a data input read in ``placements`` stays split on dp along its batch dim (any split,
    or partial, when that dim is unknown)."""
    return ndim == 0 or _stays_split(placements, Shard(batch_dim) if batch_dim is not None else None, dp_dims)


def _stays_split(placements, want: Placement | None, dims: list[int]) -> bool:
    """Whether ``placements`` are ``want`` on every one of ``dims`` (where ``want`` is None: not replicated
    on any of them, any split or partial)."""
    if want is not None:
        return all(placements[d] == want for d in dims)
    return not any(placements[d].is_replicate() for d in dims)


def _once_per_op(work_out: Callable[[fx.Node], _R]) -> Callable[[fx.Node], _R]:
    """``work_out`` remembered per op (by node name): what a rule requires of an op, worked out at its first
    strategy and asked of each of the others (on a 4-D mesh an op has hundreds)."""
    known: dict[str, _R] = {}

    def of(node: fx.Node) -> _R:
        if node.name not in known:
            known[node.name] = work_out(node)
        return known[node.name]

    return of


def _main_output(node: fx.Node) -> Any:
    """``node``'s value, or a multi-output op's first (its main output)."""
    val = node.meta.get("val")
    return val[0] if isinstance(val, (tuple, list)) and val else val


def _value_of(arg: fx.Node) -> tuple[str, int]:
    """(producer name, output index) of the value ``arg`` is (``problem.source_of``)."""
    producer, out = source_of(arg)
    return producer.name, out


def _weights_stay_split(captured: CapturedGraph, tp_dims: list[int]):
    """Tensor-parallel role: an op reading a weight matrix reads it split on every tp dim, never
    gathered (gathering weights is what the dp dims with fsdp are for; on a tp dim it would turn
    tensor parallelism into sharded data parallelism under the wrong name)."""
    if not tp_dims:
        return ALLOW_ANY
    kinds = captured.gradient_kinds()  # a parameter or a view of one (the permute before a mm): WEIGHT_KINDS

    def allow(node: fx.Node, strategy) -> bool:
        for arg, placements in zip(tensor_inputs(node), strategy.inputs):
            if (kinds[arg.name] in WEIGHT_KINDS and arg.meta["val"].ndim >= 2
                    and any(placements[d].is_replicate() for d in tp_dims)):
                return False
        return True

    def key(node: fx.Node) -> tuple[bool, ...]:
        return tuple(kinds[arg.name] in WEIGHT_KINDS and arg.meta["val"].ndim >= 2 for arg in tensor_inputs(node))

    return Rule(allow, key)


# ---- context parallelism -----------------------------------------------------------------------------

SEQUENCE_DIM = 1
"""The dim of every user input (tokens and targets, ``[batch, seq]``) that a cp dim splits."""


def check_context_parallel(captured: CapturedGraph, cp: int, cp_attention: str | None = None) -> tuple[int, int]:
    """(batch, seq) of the user inputs, after refusing a model ``cp`` cannot split: one without fused
    attention (the only op whose sequence split autopar knows), or inputs without a sequence dim that
    ``2 cp`` divides (the load-balanced layout's chunks, ``passes/sequence_layout.py``), alike in all inputs;
    ``cp_attention=ring`` pinned where some fused attention cannot ring (``strategies.ring_refusal``); and a
    prefix sum along the sequence (``_refuse_prefix_sums_along``)."""
    attention = [node for node in captured.graph.nodes if node.target is FUSED_ATTENTION]
    if not attention:
        raise BadInputError(f"constraint cp={cp} splits attention on the sequence, and this model has no fused "
                            "attention (F.scaled_dot_product_attention) op")
    refused = [(node, ring_refusal(node)) for node in attention if ring_refusal(node)]
    if cp_attention == RING and refused:
        node, why = refused[0]
        raise BadInputError(f"constraint cp_attention=ring: fused attention {node.name} cannot run as ring attention "
                            f"because of {why}; pin cp_attention=allgather or leave it free")
    shapes = {tuple(captured.node(name).meta["val"].shape[:2]) for name in captured.user_inputs}
    if len(shapes) != 1 or len(next(iter(shapes))) < 2:
        raise BadInputError(f"constraint cp={cp} splits the inputs on their sequence dim (dim 1): every input "
                            f"(and the targets) must be [batch, seq, ...] alike, got {sorted(shapes)}")
    batch, seq = next(iter(shapes))
    if seq % (2 * cp):
        raise BadInputError(f"constraint cp={cp} cuts the sequence into 2 x cp = {2 * cp} chunks (two per rank, "
                            f"for even causal work), which does not divide the sequence length {seq}")
    _refuse_prefix_sums_along(captured, seq, cp)
    return batch, seq


PREFIX_SUMS = (torch.ops.aten.cumsum.default,)
"""Ops whose every output depends on all of the dim they run along."""


def _refuse_prefix_sums_along(captured: CapturedGraph, seq: int, cp: int) -> None:
    """Refuse a model summing its data along the sequence (a prefix sum over a dim of ``seq``): a
    mixture-of-experts layer routing a whole sequence as one group (``models/moe.py``, ``group_size`` 0),
    which a rank holding chunks of the sequence cannot run."""
    on_data = _downstream_of(captured.graph, set(captured.user_inputs))
    for node in captured.graph.nodes:
        if node.target in PREFIX_SUMS and node.name in on_data and \
                node.args[0].meta["val"].shape[node.args[1]] == seq:
            raise BadInputError(f"constraint cp={cp} splits the sequence, and {node.name} sums along all of it "
                                "(a mixture-of-experts layer routing a whole sequence as one group): set a "
                                "group_size dividing seq / (2 x cp)")


def sequence_dims(captured: CapturedGraph, on_data: set[str], cp_dim: int, finder: StrategyFinder
                  ) -> dict[tuple[str, int], int | None]:
    """(node, output index) -> the dimension of that output that carries the sequence, traced from the
    user inputs' dim 1 through the strategies each op has on the cp dim (as ``batch_dims`` traces the
    batch): fused attention's output carries its queries'; where a flattening view also offers its
    sequence-split variant (``strategies._sequence_split``), the trace takes it."""
    seq: dict[tuple[str, int], int | None] = {(name, 0): SEQUENCE_DIM for name in captured.user_inputs}
    for node in captured.graph.nodes:
        if node.op != "call_function" or node.name not in on_data or is_getitem(node):
            continue
        if node.target is FUSED_ATTENTION:
            seq[node.name, 0] = ATTENTION_QUERY_DIM
            continue
        args = [(slot, seq.get(_value_of(a))) for slot, a in enumerate(tensor_inputs(node))
                if a.name in on_data and a.meta["val"].ndim > 0]
        moved = sequence_view(node, finder.rows)
        for i, dims in enumerate(_traced_splits(finder, node, cp_dim, args)):
            if moved is not None and args and args[0][1] == moved[0]:
                dims = frozenset({moved[1]})
            seq[node.name, i] = next(iter(dims)) if len(dims) == 1 else None
    return seq


def _sequence_stays_split(cp_dims: list[int], on_data: set[str], seq: dict[tuple[str, int], int | None],
                          length: int):
    """Context-parallel role: data stays split on its sequence dimension over cp (``sequence_dims``), as
    on dp it stays split on the batch, or whole where that dimension is the sequence itself (of
    ``length``): fused attention reads its keys and values so, and the ILP places their all_gather
    where it is cheapest (before grouped-query attention repeats them, say; its backward
    reduce-scatters the gradient), unless it runs as ring attention (``strategies.rings``), which reads
    them split. Rows flattened from ``[batch, seq]`` (a dimension of
    ``batch * length``) are never whole on cp, so they are only read row by row or reduced, which keeps
    the sequence-split views exact (``strategies._sequence_split``). Parameters, buffers and what is made
    of them alone are whole on cp, and reach data ops as a local slice."""

    def placed(placements, value: tuple[str, int], val: torch.Tensor) -> bool:
        """Split on its sequence dim (any split, or partial, where the trace lost it), or whole where
        that dim is the sequence."""
        dim = seq.get(value)
        whole = all(placements[d].is_replicate() for d in cp_dims)
        return _keeps_batch(placements, dim, val.ndim, cp_dims) or (whole and dim is not None
                                                                    and val.shape[dim] == length)

    def facts(value: tuple[str, int], val: torch.Tensor) -> tuple[int | None, bool, bool]:
        """All that ``placed`` reads of ``value``."""
        dim = seq.get(value)
        return dim, val.ndim == 0, dim is not None and val.shape[dim] == length

    if not cp_dims:
        return ALLOW_ANY

    def allow(node: fx.Node, strategy) -> bool:
        if node.name not in on_data:
            return all(p is None or all(p[d].is_replicate() for d in cp_dims) for p in strategy.outputs)
        gathered = KEY_VALUE_SLOTS if node.target is FUSED_ATTENTION and not any(
            rings(node, strategy, d) for d in cp_dims) else ()
        for slot, (arg, placements) in enumerate(zip(tensor_inputs(node), strategy.inputs)):
            if arg.name not in on_data:
                continue
            whole = all(placements[d].is_replicate() for d in cp_dims)
            if not (placed(placements, _value_of(arg), arg.meta["val"]) and (whole or slot not in gathered)):
                return False
        out, val = strategy.outputs[0], _main_output(node)
        return out is None or not isinstance(val, torch.Tensor) or val.ndim == 0 or placed(out, (node.name, 0), val)

    def key(node: fx.Node) -> Any:
        if node.name not in on_data:
            return False
        if node.target is FUSED_ATTENTION:  # which slots it gathers depends on the op's own arguments
            return node.name
        val = _main_output(node)
        output = facts((node.name, 0), val) if isinstance(val, torch.Tensor) and val.ndim > 0 else None
        return tuple(facts(_value_of(a), a.meta["val"]) if a.name in on_data else None
                     for a in tensor_inputs(node)), output

    return Rule(allow, key)


def check_groups_within_a_chunk(captured: CapturedGraph, cp: int, on_data: set[str],
                                seq: dict[tuple[str, int], int | None], rows: tuple[int, int]) -> None:
    """Refuse a ``cp`` under which a view cuts a sequence dim (``sequence_dims``) into groups
    (``[n] -> [n / g, g]``: a mixture-of-experts layer's routing groups, ``models/moe.py``) that do not lie
    within one of a rank's chunks of consecutive positions (``passes/sequence_layout.py``: ``seq / 2 cp``
    tokens of a sample). Within a chunk, each rank's groups are true groups and the view runs on local
    shards; a larger group would route tokens of a rank's two chunks together."""
    batch, length = rows
    chunk = length // (2 * cp)
    for node in captured.graph.nodes:
        cut = _cut_dim(node) if node.name in on_data and sequence_view(node, rows) is None else None
        if cut is None or seq.get(_value_of(node.args[0])) != cut[0]:
            continue
        size, group = cut[1:]
        if size in (length, batch * length) and chunk % group:  # a dim of tokens (a sequence, or its rows)
            raise BadInputError(f"constraint cp={cp} gives each rank chunks of seq / (2 x cp) = {chunk} consecutive "
                                f"tokens, and {node.name} groups {group} consecutive tokens (a mixture-of-experts "
                                "layer's routing group): use a group_size dividing the chunk, or a smaller cp")


def _cut_dim(node: fx.Node) -> tuple[int, int, int] | None:
    """For a view cutting an input dim into two (``[n] -> [n / g, g]``): (that dim, ``n``, ``g``)."""
    if node.target not in VIEWS or not isinstance(node.args[0], fx.Node):
        return None
    before, after = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return None
    a = merged_dim(tuple(after.shape), tuple(before.shape))
    return None if a is None else (a, int(before.shape[a]), int(after.shape[a + 1]))


# ---- expert parallelism ------------------------------------------------------------------------------

BATCHED_MATMULS = (torch.ops.aten.bmm.default,)
"""Ops whose dim 0 is a batch of independent matrix products: a parameter read there as a stack of
matrices is an expert weight."""


def expert_weights(captured: CapturedGraph) -> dict[str, int]:
    """Parameter placeholder -> its expert dim, for every parameter a batched matmul reads as a stack
    of matrices, one per slice of the data: the parameter's dim that becomes the matmul's batch dim
    (traced through the views between them with DTensor's strategies). A structural rule, not a name
    or a size: a stack of weights applied batch-wise is what an expert layer is (GShard's ``[E, d, f]``
    experts, ``models/moe.py``), whatever it is called and however many experts it has, while a dense
    layer reaches its matmul as one matrix (``mm``), even when a dim of it happens to equal the
    number of experts (a router's ``[E, d]`` weight)."""
    found: dict[str, int] = {}
    for node in captured.graph.nodes:
        if node.op != "call_function" or node.target not in BATCHED_MATMULS:
            continue
        for slot, arg in enumerate(tensor_inputs(node)):
            root = view_root(arg)
            if root.name in captured.params and root.name not in found:
                dim = _dim_reaching(root, arg, node, slot)
                if dim is not None:
                    found[root.name] = dim
    return found


def expert_count(captured: CapturedGraph) -> int:
    """Experts an expert-parallel dim may split every expert weight into whole experts: the greatest
    common divisor of their expert dims' sizes (0 for a dense model)."""
    sizes = [int(captured.node(name).meta["val"].shape[dim]) for name, dim in expert_weights(captured).items()]
    return math.gcd(*sizes) if sizes else 0


def _dim_reaching(root: fx.Node, arg: fx.Node, matmul: fx.Node, slot: int) -> int | None:
    """The dim of ``root`` that ``matmul`` reads as its batch dim 0 in input ``slot`` (``arg``, a view of
    ``root`` or ``root`` itself); None if none does."""
    chain = []
    node = arg
    while node is not root:
        chain.append(node)
        node = node.all_input_nodes[0]
    for dim in range(root.meta["val"].ndim):
        size = int(root.meta["val"].shape[dim])
        if size < 2:
            continue
        finder = StrategyFinder((size,))
        placed = _follow(finder, reversed(chain), Shard(dim))
        if placed == Shard(0) and any(s.inputs[slot][0] == Shard(0) for s in finder.for_node(matmul)):
            return dim
    return None


def _follow(finder: StrategyFinder, views, placement) -> Shard | None:
    """Where ``placement`` of a value lands after ``views`` (single-input ops), on a one-dim mesh."""
    for view in views:
        outs = {s.outputs[0][0] for s in finder.for_node(view) if s.inputs[0][0] == placement}
        if len(outs) != 1:
            return None
        placement = outs.pop()
        if not placement.is_shard():
            return None
    return placement


def _inputs_split_on_batch(captured: CapturedGraph, shape: tuple[int, ...], pins: dict, data_dims: list[int]):
    """User inputs' candidates under ``pins``: an input that carries the batch (``meshes.batch_inputs``) split
    on it over the data dims (``data_dims``), one that does not whole there (every sample reads it)."""
    carriers = {id(captured.node(name).meta["val"]) for name in batch_inputs(captured)}
    split = placeholder_candidates(shape, pins)
    whole = placeholder_candidates(shape, {**pins, **{d: Replicate() for d in data_dims}})
    return lambda val: split(val) if id(val) in carriers else whole(val)


def _expert_split(captured: CapturedGraph, shape: tuple[int, ...], pins: dict, ep_dims: list[int]):
    """Parameter candidates under ``pins``, and on each ep dim: an expert weight split on its expert dim,
    any other parameter replicated. A parameter is known by its value (``Roles.param`` is given the
    placeholder's ``meta["val"]``)."""
    dense = placeholder_candidates(shape, {**pins, **{d: Replicate() for d in ep_dims}})
    if not ep_dims:
        return dense
    experts = {id(captured.node(name).meta["val"]): dim for name, dim in expert_weights(captured).items()}
    split = {dim: placeholder_candidates(shape, {**pins, **{d: Shard(dim) for d in ep_dims}})
             for dim in set(experts.values())}
    return lambda val: split[experts[id(val)]](val) if id(val) in experts else dense(val)


def expert_dims(captured: CapturedGraph, on_data: set[str], ep_dim: int, finder: StrategyFinder
                ) -> dict[tuple[str, int], int]:
    """(node, output index) -> the dimension of that value that carries the experts: traced forward
    from the expert weights' expert dims through DTensor's strategies (the experts' activations, to
    where the combine contracts them away), and backward from the data an expert weight's matmul reads
    through the single-input ops that made it (the dispatched tokens, back to the dispatch's matmul)."""
    tags = {(name, 0): dim for name, dim in expert_weights(captured).items()}
    for node in captured.graph.nodes:
        if node.op == "call_function" and not is_getitem(node):
            _tag_forward(node, tags, ep_dim, finder)
    for node in reversed(list(captured.graph.nodes)):
        if node.op == "call_function" and not is_getitem(node):
            _tag_backward(node, tags, on_data, ep_dim, finder)
    return tags


def _tag_forward(node: fx.Node, tags: dict, ep_dim: int, finder: StrategyFinder) -> None:
    """Tag ``node``'s output with the dim its strategies split when every tagged input is split on its
    expert dim (when that is one dim)."""
    tagged = [(slot, tags[_value_of(a)]) for slot, a in enumerate(tensor_inputs(node)) if _value_of(a) in tags]
    if not tagged or (node.name, 0) in tags or len(output_vals(node)) != 1:
        return
    dims = {s.outputs[0][ep_dim].dim for s in finder.for_node(node)
            if s.outputs[0] is not None and s.outputs[0][ep_dim].is_shard()
            and all(s.inputs[slot][ep_dim] == Shard(d) for slot, d in tagged)}
    if len(dims) == 1:
        tags[node.name, 0] = dims.pop()


def _tag_backward(node: fx.Node, tags: dict, on_data: set[str], ep_dim: int, finder: StrategyFinder) -> None:
    """Tag the one data input of ``node`` with the dim it must be split on for ``node``'s tagged
    inputs and output to be split on their expert dims: the dispatched tokens an expert matmul reads,
    and the single-input ops (views, copies) that made them."""
    args = tensor_inputs(node)
    data = [(slot, a) for slot, a in enumerate(args) if a.name in on_data and _value_of(a) not in tags]
    if len(data) != 1 or (node.name, 0) not in tags:
        return
    slot, arg = data[0]
    want = {i: tags[_value_of(a)] for i, a in enumerate(args) if _value_of(a) in tags}
    dims = {s.inputs[slot][ep_dim].dim for s in finder.for_node(node)
            if s.inputs[slot][ep_dim].is_shard() and s.outputs[0] is not None
            and s.outputs[0][ep_dim] == Shard(tags[node.name, 0])
            and all(s.inputs[i][ep_dim] == Shard(d) for i, d in want.items())}
    if len(dims) == 1:
        tags[_value_of(arg)] = dims.pop()


def _tokens_split_on_batch_or_expert(captured: CapturedGraph, ep_dims: list[int], on_data: set[str],
                                     batch: dict[tuple[str, int], int | None], finder: StrategyFinder):
    """Expert-parallel role: data stays split over ep, on its batch dimension (as on dp) or, where it
    carries the experts, on its expert dimension (``expert_dims``); never gathered. An op reading an
    expert weight reads its data as its strategy requires (split like the weight's experts). Moving a
    value from one split to the other is the all_to_all the ILP places and prices on an edge."""
    if not ep_dims:
        return ALLOW_ANY
    experts = expert_dims(captured, on_data, ep_dims[0], finder)
    weights = expert_weights(captured)
    reads_experts = {node.name for node in captured.graph.nodes
                     if any(view_root(a).name in weights for a in tensor_inputs(node))}

    def splits(value: tuple[str, int]) -> tuple[Placement, ...]:
        return tuple(dict.fromkeys(Shard(d) for d in (batch.get(value), experts.get(value)) if d is not None))

    def fits(placements, allowed: tuple[Placement, ...], reduces: bool) -> bool:
        if allowed:
            return all(placements[d] in allowed for d in ep_dims)
        return all(placements[d].is_shard() or (reduces and placements[d].is_partial()) for d in ep_dims)

    def requirements(node: fx.Node) -> tuple[tuple, tuple | None]:
        """(slot, allowed splits) of each data input it must read split (none for an op reading expert
        weights), and (allowed splits, reduces) of its main output (None: not a tensor, or a scalar)."""
        args = tensor_inputs(node)
        inputs = () if node.name in reads_experts else tuple(
            (slot, splits(_value_of(a))) for slot, a in enumerate(args) if a.name in on_data and a.meta["val"].ndim > 0)
        val = _main_output(node)
        if not isinstance(val, torch.Tensor) or val.ndim == 0:
            return inputs, None
        reduces = val.numel() < max((a.meta["val"].numel() for a in args if a.name in on_data), default=0)
        return inputs, (splits((node.name, 0)), reduces)

    required = _once_per_op(requirements)

    def allow(node: fx.Node, strategy) -> bool:
        if node.name not in on_data:
            return True
        inputs, output = required(node)
        for slot, allowed in inputs:
            if slot < len(strategy.inputs) and not fits(strategy.inputs[slot], allowed, True):
                return False
        out = strategy.outputs[0]
        return out is None or output is None or fits(out, *output)

    return Rule(allow, lambda node: node.name in on_data and required(node))


def _replicas_act_as_shards(replica_dims: list[int], shard_dims: list[int]):
    """HSDP: its two data-parallel dims split the work as one; every op places its tensors alike on
    both (only parameters differ: replicated across replica groups, sharded within one)."""
    pairs = [(r, s) for r in replica_dims for s in shard_dims]
    if not pairs:
        return ALLOW_ANY

    def allow(node: fx.Node, strategy) -> bool:
        placed = [p for p in (*strategy.inputs, *strategy.outputs) if p is not None]
        return all(p[r] == p[s] for p in placed for r, s in pairs)

    return Rule(allow, lambda node: ())


def _all_of(*rules: Rule) -> Rule:
    """The rule that allows what each of ``rules`` allows, its key theirs; rules with nothing to check
    (``ALLOW_ANY``) are left out, since every strategy of every op on every mesh searched passes through it."""
    kept = tuple(rule for rule in rules if rule is not ALLOW_ANY)
    if not kept:
        return ALLOW_ANY
    if len(kept) == 1:
        return kept[0]

    def allow(node: fx.Node, strategy) -> bool:
        for rule in kept:
            if not rule.allow(node, strategy):
                return False
        return True

    return Rule(allow, lambda node: tuple(rule.key(node) for rule in kept))


def _downstream_of(graph: fx.Graph, sources: set[str]) -> set[str]:
    seen = set(sources)
    for node in graph.nodes:
        if any(a.name in seen for a in node.all_input_nodes):
            seen.add(node.name)
    return seen
