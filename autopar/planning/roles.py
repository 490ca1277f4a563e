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
"""

from __future__ import annotations
from autopar.core.axes import DATA_PARALLEL_AXES, MeshAxis
from autopar.core.constraints import Constraints
from autopar.cost_models import Cluster
from autopar.ir.capture import CapturedGraph
from autopar.ir.layers import is_getitem, output_vals, tensor_inputs
from autopar.planning.meshes import MeshChoice
from autopar.planning.pricing import Pricer
from autopar.planning.problem import Problem, Roles, build_problem, placeholder_candidates, source_of
from autopar.planning.sequence_parallel import sequence_parallel_rule
from autopar.planning.strategies import StrategyFinder
from torch import fx
from torch.distributed.tensor import Replicate, Shard
import torch



OVERLAP_FRACTION = 0.8
"""Share of backward compute behind which bucketed gradient all_reduce can hide (the last bucket and
the first layers' gradients cannot overlap; PyTorch DDP, Li et al., VLDB 2020)."""


def pricer_for(cluster: Cluster, mesh: MeshChoice, dtype: str, constraints: Constraints) -> Pricer:
    """The pricer of one stage of ``mesh``; ``fsdp`` 1 or 2 pins ZeRO-1/2 optimizer (and gradient) sharding."""
    zero = constraints.zero_stage if constraints.zero_stage in (1, 2) else 0
    return Pricer(cluster, mesh.shape, dtype, stages=mesh.stages, zero_stage=zero,
                  dp_dims=mesh.dims_of(*DATA_PARALLEL_AXES))


def problem_for(captured: CapturedGraph, mesh: MeshChoice, pricer: Pricer, capacity: float,
                 constraints: Constraints) -> Problem:
    """The ILP of one stage under the dims' roles. ``dp`` and ``dp_replicate`` split the batch;
    parameters are replicated on ``dp_replicate`` (HSDP's replica groups) and, on ``dp``, replicated
    (fsdp 0-2), sharded (fsdp 3, and always under HSDP) or free for the solver to choose."""
    shape = mesh.shape
    dp_dims = mesh.dims_of(*DATA_PARALLEL_AXES)
    shard_dims = mesh.dims_of(MeshAxis.DP_SHARD)
    replica_dims = mesh.dims_of(MeshAxis.DP_REPLICATE)
    tp_dims = [i for i, n in enumerate(mesh.names) if n == MeshAxis.TP]
    pins_buffers = {i: Replicate() for i in dp_dims}
    zero_stage = 3 if replica_dims else constraints.zero_stage
    pins_params = {i: Replicate() for i in (dp_dims if zero_stage in (0, 1, 2) else replica_dims)}
    sharded_on_dp = shard_dims if zero_stage == 3 else []
    pins_inputs = {i: (Shard(0) if n in DATA_PARALLEL_AXES else Replicate()) for i, n in enumerate(mesh.names)}
    param_candidates = placeholder_candidates(shape, pins_params)
    copies = {r: shard_dims[0] for r in replica_dims} if shard_dims else {}
    finder = StrategyFinder(shape, copies)
    roles = Roles(
        param=lambda val: _split_matrices(param_candidates(val), val, tp_dims + sharded_on_dp),
        user_input=placeholder_candidates(shape, pins_inputs),
        buffer=placeholder_candidates(shape, pins_buffers),
        allow=_all_of(_batch_stays_split(captured, dp_dims, finder), _weights_stay_split(captured, tp_dims),
                      _replicas_act_as_shards(replica_dims, shard_dims),
                      sequence_parallel_rule(captured, tp_dims, constraints.sp)),
    )
    return build_problem(captured, finder, pricer, roles, capacity, OVERLAP_FRACTION)


def _split_matrices(cands: list, val: torch.Tensor, dims: list[int]) -> list:
    """A weight matrix is split on each of ``dims`` (tp dims; dp dims under fsdp=3) when it can be."""
    if val.ndim < 2 or not dims:
        return cands
    split = [c for c in cands if all(not c[d].is_replicate() for d in dims)]
    return split or cands


def _batch_stays_split(captured: CapturedGraph, dp_dims: list[int], finder: StrategyFinder):
    """Data-parallel role: ops that depend on the inputs read the data split on dp along its batch
    dimension and keep their output split there (``batch_dims``), or partial where the op reduces the
    batch away (the loss): each rank works on its own share of the batch. Gathering the data on dp, or
    splitting another dimension over it (heads, sequence), would be tensor or context parallelism on
    the dp dim under the wrong name, which the role forbids. Where no strategy of an op keeps the
    batch dimension traceable, its output only has to stay split (any dimension) or partial on dp."""
    on_data = _downstream_of(captured.graph, set(captured.user_inputs))
    batch = batch_dims(captured, on_data, dp_dims[0], finder) if dp_dims else {}

    def allow(node: fx.Node, strategy) -> bool:
        if node.name not in on_data or not dp_dims:
            return True
        out, val = strategy.outputs[0], node.meta.get("val")
        val = val[0] if isinstance(val, (tuple, list)) and val else val  # a multi-output op's main output
        if out is None or not isinstance(val, torch.Tensor) or val.ndim == 0:
            return True
        args = tensor_inputs(node)
        if not all(_keeps_batch(placements, batch.get(_value_of(a)), a.meta["val"].ndim, dp_dims)
                   for a, placements in zip(args, strategy.inputs) if a.name in on_data):
            return False
        want = batch.get((node.name, 0))
        if want is not None:
            return all(out[d] == Shard(want) for d in dp_dims)
        reduces = val.numel() < max((a.meta["val"].numel() for a in args if a.name in on_data), default=0)
        return all(out[d].is_shard() or (reduces and out[d].is_partial()) for d in dp_dims)

    return allow


def batch_dims(captured: CapturedGraph, on_data: set[str], dp_dim: int, finder: StrategyFinder
               ) -> dict[tuple[str, int], int | None]:
    """(node, output index) -> the dimension of that output that carries the batch, traced from the
    user inputs' dim 0 through the strategies DTensor gives each op: the dim an output is split on
    when every data input is split on its own batch dim (None: the op reduces the batch away, or the
    strategies leave it ambiguous)."""
    batch: dict[tuple[str, int], int | None] = {(name, 0): 0 for name in captured.user_inputs}
    for node in captured.graph.nodes:
        if node.op != "call_function" or node.name not in on_data or is_getitem(node):
            continue
        args = [(slot, batch.get(_value_of(a))) for slot, a in enumerate(tensor_inputs(node))
                if a.name in on_data and a.meta["val"].ndim > 0]
        kept = [s for s in finder.for_node(node)
                if all(bd is not None and s.inputs[slot][dp_dim] == Shard(bd) for slot, bd in args)]
        for i in range(len(output_vals(node))):
            dims = {s.outputs[i][dp_dim].dim for s in kept
                    if s.outputs[i] is not None and s.outputs[i][dp_dim].is_shard()}
            batch[node.name, i] = dims.pop() if len(dims) == 1 else None
    return batch


def _keeps_batch(placements, batch_dim: int | None, ndim: int, dp_dims: list[int]) -> bool:
    """Whether a data input read in ``placements`` stays split on dp along its batch dim (any split,
    or partial, when that dim is unknown)."""
    if ndim == 0:
        return True
    if batch_dim is not None:
        return all(placements[d] == Shard(batch_dim) for d in dp_dims)
    return not any(placements[d].is_replicate() for d in dp_dims)


def _value_of(arg: fx.Node) -> tuple[str, int]:
    """(producer name, output index) of the value ``arg`` is (``problem.source_of``)."""
    producer, out = source_of(arg)
    return producer.name, out


def _weights_stay_split(captured: CapturedGraph, tp_dims: list[int]):
    """Tensor-parallel role: an op reading a weight matrix reads it split on every tp dim, never
    gathered (gathering weights is what the dp dims with fsdp are for; on a tp dim it would turn
    tensor parallelism into sharded data parallelism under the wrong name)."""
    kinds = captured.gradient_kinds()  # "param": a parameter or a view of one (the permute before a mm)

    def allow(node: fx.Node, strategy) -> bool:
        for arg, placements in zip(tensor_inputs(node), strategy.inputs):
            if (kinds[arg.name] == "param" and arg.meta["val"].ndim >= 2
                    and any(placements[d].is_replicate() for d in tp_dims)):
                return False
        return True

    return allow


def _replicas_act_as_shards(replica_dims: list[int], shard_dims: list[int]):
    """HSDP: its two data-parallel dims split the work as one; every op places its tensors alike on
    both (only parameters differ: replicated across replica groups, sharded within one)."""
    pairs = [(r, s) for r in replica_dims for s in shard_dims]

    def allow(node: fx.Node, strategy) -> bool:
        placed = [p for p in (*strategy.inputs, *strategy.outputs) if p is not None]
        return all(p[r] == p[s] for p in placed for r, s in pairs)

    return allow


def _all_of(*rules):
    return lambda node, strategy: all(rule(node, strategy) for rule in rules)


def _downstream_of(graph: fx.Graph, sources: set[str]) -> set[str]:
    seen = set(sources)
    for node in graph.nodes:
        if any(a.name in seen for a in node.all_input_nodes):
            seen.add(node.name)
    return seen
