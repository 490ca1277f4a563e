"""Ways to run each graph node on a device mesh, taken from DTensor's registered op strategies.

For every call_function node we ask DTensor what placements of its inputs and outputs are valid on a
mesh (``Shard(d)``/``Replicate``/``Partial`` per mesh dimension). DTensor keeps two registries in torch
2.13: full-mesh strategy functions (matrix ops, embedding, norms...) that we feed every candidate input
placement, and single-mesh-dim strategies that DTensor expands to the whole mesh, dim by dim. Using both
means the sharding rules live in one place (PyTorch) and our planner sees the same choices the DTensor
runtime will accept. Where we diverge in how, not what: on a mesh of several dims we combine a single-dim
rule's one-dim strategies ourselves, as DTensor's expansion does (``_expanded``: the same list in the same
order, tested op by op), because its per-combination Python is most of enumerating a 3-D mesh.

Where we diverge: ops in ``LOCAL_RULES`` (fused attention, which DTensor only knows as backend kernels
such as the CUDA flash variant) get our own rule: the dims listed are independent, so the op can be
split on any of them on all inputs at once and run on local shards; so does advanced indexing
(``aten.index.Tensor``, ``index_strategies``: a rule of the node, ``NODE_RULES``, since which arguments are
indices matters), which DTensor propagates on DTensors but offers no strategies for. On a context-parallel mesh dim
(``StrategyFinder(sequence_dims=...)``) ops also get sequence-split variants (``_sequence_splits``):
fused attention with its queries split and its keys and values whole (all-gathered before it), or all
of them split (ring attention, without a mask tensor or dropout), and the views between
``[batch, seq, ...]`` and its flattened rows keeping the split. Any other op DTensor knows nothing
about runs replicated, with one warning naming the op;
strategies that shard a dimension unevenly are dropped (plans keep every shard the same size, so local
shapes and collective volumes are exact), and so are those that split or make partial a tensor over a
mesh dim of one device (``fits_mesh``: pure relabelling, which the runtime pays for); and
``_StridedShard`` placements are not offered.

Placeholders get candidate placements by role: parameters and buffers any ``R``/``S(d)``, example inputs
whatever the caller allows (the planner pins the batch dimension to the data-parallel mesh dim).

A placement here is DTensor's own value (``Shard(d)``, ``Replicate()``, ``Partial(op)``), as DTensor's
strategies give it; plan strings (``autopar.core.placement``) appear only where a plan is written or read.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops import utils as _dtensor_op_utils

from autopar.core.placement import Placements, placement_to_str
from autopar.core.plan import ALLGATHER, RING
from autopar.ir.buffer_writes import WRITE_BUFFER
from autopar.ir.capture import ATTENTION_QUERY_DIM as QUERY_DIM
from autopar.ir.capture import FUSED_ATTENTION, VIEWS
from autopar.ir.layers import (ATTENTION_DROPOUT_ARG, ATTENTION_MASK_ARG, attention_argument, output_vals,
                                tensor_inputs)

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Strategy:
    """One valid way to run a node: the placement each tensor input must have, and what it produces."""

    inputs: tuple[Placements, ...]  # per tensor-input slot, in argument order
    outputs: tuple[Placements | None, ...]  # per output (one for single-tensor ops); None: not a tensor

    def describe(self) -> str:
        fmt = lambda ps: "(" + ",".join(map(placement_to_str, ps)) + ")" if ps is not None else "-"  # noqa: E731
        outs = ", ".join(fmt(p) for p in self.outputs)
        return f"{', '.join(fmt(p) for p in self.inputs)} -> {outs}" if self.inputs else outs


def planning_mesh(shape: Sequence[int]) -> DeviceMesh:
    """A DeviceMesh of ``shape`` with no process group: enough for DTensor's strategy functions."""
    world = 1
    for s in shape:
        world *= s
    return DeviceMesh("cpu", torch.arange(world).view(*shape), _init_backend=False, _rank=0)


def candidate_placements(
    val: torch.Tensor, mesh_shape: Sequence[int], *, partial: bool, shard: bool = True
) -> list[Placements]:
    """Every ``R``/``S(d)`` (and optionally ``P``) assignment of ``val`` that ``fits_mesh``."""
    shape, mesh = tuple(val.shape), tuple(mesh_shape)
    return [c for c in _assignments(val, len(mesh), partial, shard) if fits_mesh(c, shape, mesh)]


def _assignments(val: torch.Tensor, mesh_ndim: int, partial: bool, shard: bool = True) -> list[Placements]:
    """Every ``R``/``S(d)`` (and optionally ``P``) assignment of ``val`` over ``mesh_ndim`` dims of any size."""
    one = [Replicate()] + ([Partial()] if partial else []) + ([Shard(d) for d in range(val.ndim)] if shard else [])
    return list(itertools.product(one, repeat=mesh_ndim))


@functools.lru_cache(maxsize=1 << 18)
def fits_mesh(placements: Placements, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` can be placed so on a mesh of ``mesh_shape``: every shard the same
    size, and whole (``R``) on a dim of one device. Split or partial over one device, it holds the whole
    tensor all the same, and only the runtime notices: each change of such a label is a DTensor
    redistribute that moves nothing yet costs the host its dispatch, forward and backward (on a
    one-device mesh a plan otherwise relabels tensors about a hundred times a step).

    Remembered per (placements, shape, mesh shape), all hashable: a mesh's strategy filter asks it about
    the same few values tens of thousands of times (36,553 on one of Mixtral's 4-D meshes, 4.4 us each
    computed, 0.9 us remembered; Mixtral's whole search on 64 GPUs: 127,192 answers, 806,515 asked again),
    at most 2**18 of them in a process that plans on and on."""
    whole_on_unit_dims = all(p.is_replicate() for p, size in zip(placements, mesh_shape) if size == 1)
    return whole_on_unit_dims and _divides_evenly(placements, shape, mesh_shape)


def _divides_evenly(placements: Placements, shape: tuple[int, ...], mesh_shape: Sequence[int]) -> bool:
    factor: dict[int, int] = {}
    for p, size in zip(placements, mesh_shape):
        if p.is_shard():
            d = p.dim % max(len(shape), 1)
            factor[d] = factor.get(d, 1) * size
    return all(d < len(shape) and shape[d] % f == 0 and shape[d] >= f for d, f in factor.items())


@dataclass(frozen=True)
class LocalRule:
    """An op that is exact on shards split on any one of ``independent_dims`` (same dim on all inputs;
    an input that broadcasts on that dim, of size 1 there or without it, stays whole)."""

    independent_dims: tuple[int, ...] | None  # None: every dim of the output (an elementwise op)
    tensor_inputs: tuple[int, ...]  # the numbers of tensor inputs it takes
    broadcast_splits: bool = False
    """Whether the output may split on a dim an input broadcasts on (that input whole there, its gradient
    then partial): only for an op whose runtime reduces that gradient (``passes/run_locally.READ_WHOLE``: fused
    attention's mask); any other's would be left unreduced."""
    grouped_inputs: tuple[int, ...] = ()
    """Inputs split exactly as the output, also on a dim where they are smaller: grouped-query
    attention's keys and values, whose ``nkv`` heads each serve ``nh / nkv`` query heads, so a rank's
    query heads find their key-value heads among its own. A split the ``nkv`` heads cannot take (more
    ranks than key-value heads; multi-query attention's one head) is dropped by ``fits_mesh``: their
    gradient would be partial over it, which a local op's inputs cannot express."""

    def strategies(self, mesh_ndim: int, shapes: Sequence[tuple[int, ...]]) -> list[Strategy]:
        """Every split of the output (``shapes[0]``'s shape) on the independent dims, per mesh dim."""
        full = shapes[0]
        dims = range(len(full)) if self.independent_dims is None else self.independent_dims
        if not self.broadcast_splits:
            dims = [d for d in dims if all(_unbroadcast(shape, full, d) for shape in shapes)]
        one = [Replicate()] + [Shard(d) for d in dims]
        return [Strategy(tuple(combo if slot in self.grouped_inputs else _broadcast(combo, shape, shapes[0])
                               for slot, shape in enumerate(shapes)), (combo,))
                for combo in itertools.product(one, repeat=mesh_ndim)]


def _unbroadcast(shape: tuple[int, ...], full: tuple[int, ...], dim: int) -> bool:
    """Whether an input of ``shape``, broadcast to ``full`` (trailing dims aligned), has all of ``full``'s
    dim ``dim``."""
    lead = len(full) - len(shape)
    return dim >= lead and shape[dim - lead] == full[dim]


def _broadcast(placements: tuple[Placement, ...], shape: tuple[int, ...], full: tuple[int, ...]) -> Placements:
    """``placements`` of a tensor of shape ``full`` for an input of ``shape`` broadcast to it (trailing
    dims aligned): whole on a dim it broadcasts on."""
    lead = len(full) - len(shape)
    return tuple(Shard(p.dim - lead) if p.is_shard() and _unbroadcast(shape, full, p.dim) else Replicate()
                 for p in placements)


LOCAL_RULES: dict[Any, LocalRule] = {
    # q, k, v: [batch, heads, seq, head_dim], and an optional attention mask [batch|1, heads|1, seq, seq]
    # broadcast to the scores: attention mixes seq and head_dim, never batch or heads. k and v may have
    # fewer heads than q (grouped-query attention, ``enable_gqa``): they split with q (``grouped_inputs``).
    FUSED_ATTENTION: LocalRule(independent_dims=(0, 1), tensor_inputs=(3, 4), broadcast_splits=True,
                               grouped_inputs=(1, 2)),
    # ``dst.copy_(src)`` captured functionally: the output is ``src`` broadcast to ``dst``'s shape, so every
    # dim is independent where ``src`` has it whole. DTensor registers only the in-place ``copy_``; run
    # replicated, the copy in a buffer written slice by slice (DeepSeek-V3's attention, ``passes/
    # dtensor_backward.py``) gathered the batch and lost its trace (``roles.batch_dims``) for everything
    # after it: its ILP on a 32 x 2 x 2 mesh had 10,520 options and 431,517 edge pairs, 4,396 and 84,490 without.
    torch.ops.aten.copy.default: LocalRule(independent_dims=None, tensor_inputs=(2,)),
    # ``torch.polar(abs, angle)``: elementwise, complex out (Llama 4's rotary frequencies); DTensor has no strategy.
    torch.ops.aten.polar.default: LocalRule(independent_dims=None, tensor_inputs=(2,)),
}
# Resampling ``[batch, channels, *spatial]`` (``F.interpolate``): each sample and channel on its own. DTensor has
# strategies for some ``.default`` overloads but none for the ``.vec`` ones the capture keeps (BEiT's
# ``upsample_bilinear2d.vec``) nor for most backwards (``upsample_bilinear2d_backward``), so all run on local shards.
LOCAL_RULES.update({getattr(getattr(torch.ops.aten, name), overload): LocalRule(independent_dims=(0, 1),
                                                                                tensor_inputs=(1,))
                    for name in ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                                 "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
                                 "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
                                 "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")
                    for overload in ("default", "vec")})

INDEX = torch.ops.aten.index.Tensor


def index_strategies(node: fx.Node, mesh_ndim: int) -> list[Strategy]:
    """``self[indices]`` (``aten.index.Tensor``: advanced indexing by integer tensors, ``None`` for a dim taken
    whole) on local shards, which DTensor has no strategy for (only a propagation rule it runs on DTensors).
    Per mesh dim, each of: all whole; ``self`` split on a dim no index reads (the output split on that dim's
    place), the indices whole; or ``self`` whole and the indices split on a dim of their broadcast shape (each
    index that has all of it; the output split on its place), as an embedding splits its ids: every rank
    gathers its own rows of the output, and ``self``'s gradient is then partial there (``run_local_op``
    reduces it). A boolean mask (its result's shape depends on its values) runs whole."""
    indices = list(node.args[1])
    shapes = [tuple(i.meta["val"].shape) if isinstance(i, fx.Node) else None for i in indices]
    read = [d for d, shape in enumerate(shapes) if shape is not None]
    if not read or any(indices[d].meta["val"].dtype == torch.bool for d in read):
        return [_replicated(node, len(tensor_inputs(node)), mesh_ndim)]
    broadcast = tuple(torch.broadcast_shapes(*(shapes[d] for d in read)))
    width = len(broadcast)
    together = read == list(range(read[0], read[-1] + 1))  # the broadcast dims then take the indexed dims' place
    first = read[0] if together else 0
    kept = [d for d in range(node.args[0].meta["val"].ndim) if d not in read]
    whole = tuple(Replicate() for _ in read)
    choices = [(Replicate(), whole, Replicate())]
    choices += [(Shard(d), whole, Shard(d if d < first else d - len(read) + width) if together
                 else Shard(width + kept.index(d))) for d in kept]
    choices += [(Replicate(), tuple(_broadcast((Shard(b),), shapes[d], broadcast)[0] for d in read), Shard(first + b))
                for b in range(width) if broadcast[b] > 1]
    return [Strategy((tuple(c[0] for c in combo), *(tuple(c[1][k] for c in combo) for k in range(len(read)))),
                     (tuple(c[2] for c in combo),))
            for combo in itertools.product(choices, repeat=mesh_ndim)]


NODE_RULES: dict[Any, Callable[[fx.Node, int], list[Strategy]]] = {INDEX: index_strategies}
"""Local rules (run as ``LOCAL_RULES``' are, on local shards) that read the node itself, not only its inputs'
shapes: which of its arguments are tensors."""

WHOLE_OPS = frozenset({WRITE_BUFFER})
"""autopar's own ops that run whole by design, on local tensors (``runs_locally``): a buffer's write
(``ir/buffer_writes.py``) copies the whole value into the rank's whole buffer."""

# ---- context parallelism: the sequence split over a cp mesh dim ---------------------------------------

KEY_VALUE_SLOTS = (1, 2)
"""Fused attention's tensor inputs read whole over a cp dim: the keys and the values."""


def _query_split(strategy: Strategy, dim: int, mask_shape: tuple[int, ...] | None,
                 full: tuple[int, ...]) -> Strategy:
    """``strategy`` with mesh dim ``dim`` changed to the context-parallel split of fused attention: the
    queries, the output and the mask's rows split on the sequence, the keys and values whole (the
    all_gather before the op is an edge's redistribute; its backward reduce-scatters dK and dV)."""
    split = lambda ps, p: ps[:dim] + (p,) + ps[dim + 1:]  # noqa: E731
    ins = [split(ps, Replicate() if slot in KEY_VALUE_SLOTS else Shard(QUERY_DIM)) for slot, ps in
           enumerate(strategy.inputs)]
    if mask_shape is not None and len(ins) > 3:
        ins[3] = split(ins[3], _broadcast((Shard(QUERY_DIM),), mask_shape, full)[0])
    return Strategy(tuple(ins), (split(strategy.outputs[0], Shard(QUERY_DIM)),))


def _ring_split(node: fx.Node, strategy: Strategy, dim: int) -> Strategy | None:
    """``strategy`` with mesh dim ``dim`` changed to ring attention (``passes/ring_attention.py``): the
    queries, keys, values and output all split on the sequence, the keys and values passed around the
    ring inside the op (``Pricer.ring_collectives``). Only without an attention mask tensor and dropout,
    which the ring does not run; None otherwise."""
    if ring_refusal(node):
        return None
    split = lambda ps: ps[:dim] + (Shard(QUERY_DIM),) + ps[dim + 1:]  # noqa: E731
    return Strategy(tuple(split(ps) for ps in strategy.inputs), (split(strategy.outputs[0]),))


def ring_refusal(node: fx.Node) -> str | None:
    """Why fused attention ``node`` cannot run as ring attention (a mask tensor, dropout), or None."""
    mask = attention_argument(node, "attn_mask", ATTENTION_MASK_ARG)
    dropout = attention_argument(node, "dropout_p", ATTENTION_DROPOUT_ARG) or 0.0
    if mask is not None:
        return "its attention mask tensor"
    return f"its dropout ({dropout})" if dropout else None


def rings(node: fx.Node, strategy: Strategy, dim: int) -> bool:
    """Whether ``strategy`` runs fused attention ``node`` as ring attention over mesh dim ``dim``: its
    keys split on the sequence there (the all-gather variant reads them whole, ``_query_split``)."""
    return (node.target is FUSED_ATTENTION and strategy.inputs[KEY_VALUE_SLOTS[0]][dim] == Shard(QUERY_DIM)
            and strategy.inputs[0][dim] == Shard(QUERY_DIM))


def merged_dim(before: Sequence[int], after: Sequence[int]) -> int | None:
    """``a`` when ``after`` is ``before`` with dims ``a`` and ``a + 1`` merged into one (a flatten)."""
    before, after = list(before), list(after)
    for a in range(len(before) - 1):
        if after == before[:a] + [before[a] * before[a + 1]] + before[a + 2:]:
            return a
    return None


def _row_move(node: fx.Node) -> tuple[int, int, tuple[int, int]] | None:
    """For a view that merges two dims into rows (or splits rows into two dims): (the inner dim's index
    in the input, its index in the output, the two dims' sizes), the inner dim being the one a split
    moves with; None for any other op."""
    if node.target not in VIEWS:
        return None
    before, after = tuple(node.args[0].meta["val"].shape), tuple(node.meta["val"].shape)
    a = merged_dim(before, after)
    if a is not None:
        return a + 1, a, (before[a], before[a + 1])
    a = merged_dim(after, before)
    return (a, a + 1, (after[a], after[a + 1])) if a is not None else None


def sequence_view(node: fx.Node, rows: tuple[int, int]) -> tuple[int, int] | None:
    """(input dim, output dim) the sequence moves between when ``node`` flattens ``[batch, seq, ...]``
    into ``[batch * seq, ...]`` or unflattens it back; ``rows`` is (batch, seq) of the user inputs."""
    move = _row_move(node)
    return move[:2] if move is not None and move[2] == rows else None


def _sequence_splits(node: fx.Node, strategy: Strategy, dim: int, rows: tuple[int, int],
                     cp_attention: str | None) -> list[Strategy]:
    """The context-parallel variants of ``strategy`` (whole on mesh dim ``dim``): fused attention's
    all-gather (``_query_split``) and ring (``_ring_split``) variants, either alone where
    ``cp_attention`` pins it; a view's sequence split (``_sequence_split``)."""
    if node.target is not FUSED_ATTENTION:
        return [v for v in (_sequence_split(node, strategy, dim, rows),) if v is not None]
    found = [] if cp_attention == RING else [_sequence_split(node, strategy, dim, rows)]
    found += [] if cp_attention == ALLGATHER else [_ring_split(node, strategy, dim)]
    whole = all(p is None or p[dim].is_replicate() for p in (*strategy.inputs, *strategy.outputs))
    return [v for v in found if v is not None] if whole else []


def _sequence_split(node: fx.Node, strategy: Strategy, dim: int, rows: tuple[int, int]) -> Strategy | None:
    """A context-parallel variant of ``strategy`` (whole on mesh dim ``dim``), or None: fused attention
    split on the queries (``_query_split``), or a view that flattens the sequence into the rows of
    ``[batch * seq, ...]`` (or back) keeping it split. The flattened rows on a rank are then its sequence
    chunk of every sample, not a contiguous range of rows (DTensor's ``_StridedShard``, which plans do not
    express): the plan calls them ``S(0)`` and the runtime runs such views on local shards
    (``passes/run_locally.py``). That is exact because on a cp dim such rows are never made whole, only
    read row by row or reduced (``roles._sequence_stays_split``). Each rank's share of the work is even,
    causal attention's too: the plan's sequence layout is load-balanced (``passes/sequence_layout.py``)."""
    if any(p is not None and not p[dim].is_replicate() for p in (*strategy.inputs, *strategy.outputs)):
        return None
    split = lambda ps, p: ps[:dim] + (p,) + ps[dim + 1:]  # noqa: E731
    if node.target is FUSED_ATTENTION:
        args = tensor_inputs(node)
        full = tuple(args[0].meta["val"].shape)
        return _query_split(strategy, dim, tuple(args[3].meta["val"].shape) if len(args) > 3 else None, full)
    moved = sequence_view(node, rows)
    if moved is None:
        return None
    return Strategy((split(strategy.inputs[0], Shard(moved[0])),), (split(strategy.outputs[0], Shard(moved[1])),))


def runs_locally(node: fx.Node, strategy: Strategy) -> bool:
    """Whether the runtime runs ``node`` under ``strategy`` on local shards, outside DTensor: an op of
    ``LOCAL_RULES`` or ``WHOLE_OPS``, or a view that moves a sequence split between ``[batch, seq, ...]`` and its
    flattened rows (``_sequence_split``), which DTensor would place as a ``_StridedShard``."""
    if node.target in LOCAL_RULES or node.target in NODE_RULES or node.target in WHOLE_OPS:
        return True
    move = _row_move(node)
    return move is not None and strategy.outputs[0] is not None and any(
        p.is_shard() and q.is_shard() and (p.dim, q.dim) == move[:2]
        for p, q in zip(strategy.inputs[0], strategy.outputs[0]))


_RAW: dict[Any, tuple[list[Strategy], bool]] = {}
"""(mesh ndim, op, argument shapes) -> (DTensor's strategies before ``fits_mesh``, whether the op
had none); with ``copies`` (HSDP), keyed by the mesh's layout of copied dims too, the copies filled in.
DTensor's rules depend on the number of mesh dims, not their sizes, so every mesh shape of the search
with the same ndim (and copies) shares one enumeration (the expensive part of building a problem)."""


@contextlib.contextmanager
def _dtensor_costs_skipped() -> Iterator[None]:
    """DTensor's strategy functions price every strategy's input redistributions with their own cost
    model (``_ops.utils.generate_redistribute_costs``), four fifths of enumerating a mesh's strategies;
    autopar prices them itself (``pricing.py``) and reads only the placements, so the enumeration runs
    with that cost at zero. (A private name of DTensor: if it moves, enumeration is only slower.)"""
    saved = getattr(_dtensor_op_utils, "redistribute_cost", None)
    if saved is None:
        yield
        return
    _dtensor_op_utils.redistribute_cost = lambda *args, **kwargs: 0.0
    try:
        yield
    finally:
        _dtensor_op_utils.redistribute_cost = saved


class StrategyFinder:
    """Enumerates node strategies on one mesh shape, caching by op and shapes (layers repeat)."""

    def __init__(self, mesh_shape: Sequence[int], copies: Mapping[int, int] | None = None,
                 sequence_dims: Sequence[int] = (), rows: tuple[int, int] = (0, 0), cp_attention: str | None = None):
        """``copies``: mesh dims whose placement always repeats another dim's (HSDP's replica dim
        repeats its shard dim): strategies are enumerated without them, then the copies are filled in,
        so such a mesh costs DTensor's enumeration no more than the mesh without them.
        ``sequence_dims``: context-parallel mesh dims, on which the ops also get their sequence-split
        variants (``_sequence_splits``); ``rows``: (batch, seq) of the user inputs there; ``cp_attention``:
        the one variant of fused attention offered there where pinned (``core/plan.CP_ATTENTIONS``), else both."""
        self.mesh_shape = tuple(mesh_shape)
        self.cp_attention = cp_attention
        self.copies = dict(copies or {})
        self.sequence_dims = tuple(sequence_dims)
        self.rows = rows
        self._free = [d for d in range(len(self.mesh_shape)) if d not in self.copies]
        self._ndim = len(self._free)  # mesh dims DTensor's rules enumerate
        self.mesh = planning_mesh(tuple(2 for _ in range(self._ndim)))  # sizes do not matter, see _RAW
        self.unsupported: set[str] = set()
        self._cache: dict[Any, list[Strategy]] = {}
        self._splits: dict[Any, tuple[frozenset[int], ...]] = {}

    def for_node(self, node: fx.Node) -> list[Strategy]:
        inputs = tensor_inputs(node)
        if not inputs:  # factory ops (scalar_tensor, arange, full...): computed replicated, for free
            return [_replicated(node, 0, len(self.mesh_shape))]
        key = (node.target, _arg_signature(node))
        if key not in self._cache:
            raw, fallback = self._raw(node, inputs, key)
            if fallback:
                self._warn_unsupported(node.target)
            for dim in self.sequence_dims:
                raw = raw + [v for st in raw for v in _sequence_splits(node, st, dim, self.rows, self.cp_attention)
                             if v not in raw]
            shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None
                      for v in [a.meta["val"] for a in inputs] + output_vals(node)]
            fitting = [st for st in raw if self._fits(shapes, st)]
            self._cache[key] = fitting or [_replicated(node, len(inputs), len(self.mesh_shape))]
        return self._cache[key]

    def output_splits(self, node: fx.Node, mesh_dim: int, split: tuple[tuple[int, Placement], ...]
                      ) -> tuple[frozenset[int], ...]:
        """Per output of ``node``, the tensor dims its strategies split it on over ``mesh_dim`` when they
        place each input slot of ``split`` as given there (``(slot, placement)`` pairs). Remembered by op,
        shapes and ``split``, as ``for_node`` remembers strategies: a stack of identical layers asks once."""
        key = (node.target, _arg_signature(node), mesh_dim, split)
        if key not in self._splits:
            kept = [s for s in self.for_node(node) if all(s.inputs[slot][mesh_dim] == want for slot, want in split)]
            self._splits[key] = tuple(frozenset(s.outputs[i][mesh_dim].dim for s in kept
                                                if s.outputs[i] is not None and s.outputs[i][mesh_dim].is_shard())
                                      for i in range(len(output_vals(node))))
        return self._splits[key]

    def _raw(self, node: fx.Node, inputs: list[fx.Node], key: Any) -> tuple[list[Strategy], bool]:
        raw_key = (self._ndim, key)
        if raw_key not in _RAW:
            _RAW[raw_key] = self._enumerate(node, inputs)
        if not self.copies:
            return _RAW[raw_key]
        copied_key = (raw_key, len(self.mesh_shape), tuple(sorted(self.copies.items())))
        if copied_key not in _RAW:
            found, fallback = _RAW[raw_key]
            _RAW[copied_key] = [self._with_copies(st) for st in found], fallback
        return _RAW[copied_key]

    def _with_copies(self, strategy: Strategy) -> Strategy:
        def full(p: Placements | None) -> Placements | None:
            if p is None:
                return None
            by_dim = dict(zip(self._free, p))
            for d, source in self.copies.items():
                by_dim[d] = by_dim[source]
            return tuple(by_dim[d] for d in range(len(self.mesh_shape)))

        return Strategy(tuple(full(p) for p in strategy.inputs), tuple(full(p) for p in strategy.outputs))

    def _enumerate(self, node: fx.Node, inputs: list[fx.Node]) -> tuple[list[Strategy], bool]:
        prop = DTensor._op_dispatcher.sharding_propagator
        op = node.target
        found: list[Strategy] = []
        if op in SHARDED_BACKWARD_FAILS:
            return [_replicated(node, len(inputs), self._ndim)], True
        if op in WHOLE_OPS:
            return [_replicated(node, len(inputs), self._ndim)], False
        if op in LOCAL_RULES and len(inputs) in LOCAL_RULES[op].tensor_inputs:
            found = LOCAL_RULES[op].strategies(self._ndim, [tuple(i.meta["val"].shape) for i in inputs])
        elif op in NODE_RULES:
            found = NODE_RULES[op](node, self._ndim)
        elif self._ndim > 1 and _expandable(node, prop):
            found = _expanded_families(
                _one_dim_strategies(node, prop), self._ndim, [tuple(i.meta["val"].shape) for i in inputs],
                prop.op_single_dim_strategy_funcs[op].allow_uneven_sharding)
        elif op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs:
            found = _first_of_each_family(self._from_dtensor(node, prop))
        if not found:
            return [_replicated(node, len(inputs), self._ndim)], True
        return found, False

    def _from_dtensor(self, node: fx.Node, prop: Any) -> list[Strategy]:
        """DTensor's strategies of ``node`` on this finder's planning mesh, in its order (each reduce op of
        a partial kept: ``_first_of_each_family`` keeps one)."""
        with _dtensor_costs_skipped():
            try:
                op_strategy = self._call_strategy(node, prop, node.args)
            except Exception as exc:  # some strategy functions reject a whole candidate set; narrow it
                log.debug("strategy of %s failed on the full candidate set: %s", node.target, exc)
                op_strategy = self._call_per_first_input(node, prop)
        return self._convert(node, op_strategy)

    def _call_strategy(self, node: fx.Node, prop: Any, args: Any, first: Placements | None = None) -> Any:
        op = node.target
        single = op in prop.op_single_dim_strategy_funcs
        counter = itertools.count()

        def wrap(a: Any) -> Any:
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                idx = next(counter)
                return self._input_strategy(a.meta["val"], single, first if idx == 0 else None)
            if isinstance(a, (list, tuple)) and a and all(isinstance(x, fx.Node) for x in a):
                return TupleStrategy(tuple(wrap(x) for x in a))
            if isinstance(a, (list, tuple)):
                return type(a)(wrap(x) for x in a)
            if isinstance(a, fx.Node):
                return a.meta.get("val")
            return a

        schema = OpSchema(op, tuple(wrap(a) for a in args), {k: wrap(v) for k, v in node.kwargs.items()})
        if single:
            from torch.distributed.tensor._ops.single_dim_strategy import (
                _expand_single_dim_strategy_to_mesh,
            )

            expand = _expand_single_dim_strategy_to_mesh(
                self.mesh, schema, prop.op_single_dim_strategy_funcs[op], _tensor_meta(node.meta["val"])
            )
            return expand(op, schema.args_meta, schema.kwargs_meta)
        return prop.op_strategy_funcs[op](schema)

    def _call_per_first_input(self, node: fx.Node, prop: Any) -> Any:
        merged: list[OpSpec] = []
        first_val = tensor_inputs(node)[0].meta["val"]
        for cand in _assignments(first_val, self._ndim, partial=True):
            try:
                result = self._call_strategy(node, prop, node.args, first=cand)
            except Exception:  # this candidate is invalid for the op: skip it
                continue
            if isinstance(result, OpStrategy):
                merged.extend(result.strategies)
        return OpStrategy(merged) if merged else None

    def _input_strategy(self, val: torch.Tensor, single: bool, only: Placements | None) -> OpStrategy:
        meta = TensorMeta(val.shape, val.stride(), val.dtype)
        if single:  # DTensor expands single-dim rules itself; one spec tells it plain Shard is in use
            pls = [_single_dim_rule_input(val.ndim, self._ndim)]
        else:
            pls = [only] if only is not None else _assignments(val, self._ndim, partial=True)
        return OpStrategy([OpSpec(DTensorSpec(self.mesh, p, meta)) for p in pls])

    def _convert(self, node: fx.Node, op_strategy: Any) -> list[Strategy]:
        if not isinstance(op_strategy, OpStrategy):
            return []
        n_inputs = len(tensor_inputs(node))
        return [s for s in (_strategy_from_spec(spec, n_inputs) for spec in op_strategy.strategies) if s is not None]

    def _fits(self, shapes: list[tuple[int, ...] | None], s: Strategy) -> bool:
        """Whether every tensor of a node (``shapes``: its inputs' and outputs', None for a non-tensor)
        can be placed as ``s`` places it (``fits_mesh``)."""
        return all(p is None or shape is None or fits_mesh(p, shape, self.mesh_shape)
                   for shape, p in zip(shapes, (*s.inputs, *s.outputs)))

    def _warn_unsupported(self, op: Any) -> None:
        name = str(op)
        if name not in self.unsupported:
            self.unsupported.add(name)
            why = SHARDED_BACKWARD_FAILS.get(op)
            found = f"DTensor's sharding strategy for {name} cannot be trained on shards ({why})" if why else \
                f"no DTensor sharding strategy for {name}"
            warnings.warn(f"autopar: {found}; it will run replicated", stacklevel=3)


SHARDED_BACKWARD_FAILS: dict[Any, str] = {
    torch.ops.aten.native_group_norm.default: "its backward, native_group_norm_backward, takes the batch size N as "
    "an argument and DTensor hands it the global N with the rank's shard of the batch",
}
"""Ops whose DTensor forward strategies split a tensor that their backward, run on the same shards, cannot
take (torch 2.13; ``tests/test_step_inputs_and_writes.py`` trains a GroupNorm model on 2 ranks): offered only
replicated, as ops without a strategy are, with a warning saying why."""


_ONE_DIM: dict[Any, list[Strategy]] = {}
"""(op, argument shapes) -> DTensor's strategies on a one-dim planning mesh, every reduce op of a partial
kept (``_expanded`` combines them)."""


def _one_dim_strategies(node: fx.Node, prop: Any) -> list[Strategy]:
    key = (node.target, _arg_signature(node))
    if key not in _ONE_DIM:
        _ONE_DIM[key] = _one_dim_finder()._from_dtensor(node, prop)
    return _ONE_DIM[key]


@functools.cache
def _one_dim_finder() -> "StrategyFinder":
    return StrategyFinder((2,))


def _expandable(node: fx.Node, prop: Any) -> bool:
    """Whether DTensor's strategies of ``node`` on a mesh of several dims are its single-mesh-dim
    strategies combined dim by dim (``_expanded``): an op registered by a single-dim rule, which DTensor
    expands so itself (``expand_to_full_mesh_op_strategy``), that neither mutates an input (DTensor
    then keeps only strategies leaving that input as it is) nor takes a list of tensors (a foreach op,
    expanded element by element)."""
    op = node.target
    if op not in prop.op_single_dim_strategy_funcs or op._schema.is_mutable:
        return False
    return not any(isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a)
                   for a in (*node.args, *node.kwargs.values()))


_EXPANDED: dict[Any, list[Strategy]] = {}


def _expanded_families(one: list[Strategy], ndim: int, input_shapes: list[tuple[int, ...]],
                       allow_uneven: bool) -> list[Strategy]:
    """``_first_of_each_family`` of ``_expanded``, remembered by all they read: the one-dim strategies, the
    mesh's dims, ``allow_uneven`` and each input's shape with its sizes capped at ``2 ** ndim`` (the most
    shards ``_shardable_on_planning_mesh`` compares a size with). Ops that differ only in their sizes,
    most of a model's, share one list (Mixtral's 54 expanded ops on a three-dim mesh make 37)."""
    cap = 2 ** ndim
    key = (tuple(one), ndim, tuple(tuple(min(size, cap) for size in shape) for shape in input_shapes), allow_uneven)
    if key not in _EXPANDED:
        _EXPANDED[key] = _first_of_each_family(_expanded(one, ndim, input_shapes, allow_uneven))
    return _EXPANDED[key]


def _expanded(one: list[Strategy], ndim: int, input_shapes: list[tuple[int, ...]],
              allow_uneven: bool) -> list[Strategy]:
    """An op's strategies on a planning mesh of ``ndim`` dims, from those on one dim (``one``, in DTensor's
    order): every combination, one per mesh dim, in ``itertools.product`` order, less those DTensor's
    expansion (``torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy``) refuses: a tensor
    partial in two kinds of reduction (other than sum with avg), or an input split into more shards than
    its dim has elements on the planning mesh (two devices a dim; where ``allow_uneven``, an input placed
    as DTensor was given it, ``_input_strategy``, passes all the same). The same list DTensor gives, in the
    same order (``tests/test_strategies.py``), without its per-combination Python, which grows with the
    cube of the strategies on a three-dim mesh (seconds for a mixture-of-experts model). ``one`` keeps
    every reduce op of a partial: a combination refused for mixing two may have a sibling that mixes
    none, so families are thinned (``_first_of_each_family``) after combining, as from DTensor's list."""
    found = []
    for parts in itertools.product(one, repeat=ndim):
        combined = Strategy(tuple(_stacked([p.inputs[i] for p in parts]) for i in range(len(parts[0].inputs))),
                            tuple(_stacked([p.outputs[i] for p in parts]) for i in range(len(parts[0].outputs))))
        if _mixes_partials(combined) or not all(
                _shardable_on_planning_mesh(placements, shape, allow_uneven)
                for placements, shape in zip(combined.inputs, input_shapes)):
            continue
        found.append(combined)
    return found


def _stacked(per_dim: list[Placements | None]) -> Placements | None:
    """One tensor's placement on each mesh dim, from its one-dim placements (None: not a tensor)."""
    return None if per_dim[0] is None else tuple(p[0] for p in per_dim)


def _mixes_partials(strategy: Strategy) -> bool:
    """Whether some tensor of ``strategy`` is partial in two kinds of reduction other than sum and avg."""
    for placements in (*strategy.inputs, *strategy.outputs):
        kinds = {p.reduce_op for p in placements or () if p.is_partial()}
        if len(kinds) > 1 and kinds != {"sum", "avg"}:
            return True
    return False


def _shardable_on_planning_mesh(placements: Placements, shape: tuple[int, ...], allow_uneven: bool) -> bool:
    """DTensor's ``is_tensor_shardable`` on the planning mesh (two devices a dim): no dim split into more
    shards than it has elements; with ``allow_uneven``, the placement ``_input_strategy`` gave DTensor
    passes regardless."""
    if allow_uneven and placements == _single_dim_rule_input(len(shape), len(placements)):
        return True
    shards: dict[int, int] = {}
    for p in placements:
        if p.is_shard():
            if p.dim >= len(shape):
                return False
            shards[p.dim] = shards.get(p.dim, 1) * 2
    return all(shape[d] >= n for d, n in shards.items())


def _single_dim_rule_input(tensor_ndim: int, mesh_ndim: int) -> Placements:
    """The one placement a tensor input is given to DTensor for an op with a single-dim rule
    (``StrategyFinder._input_strategy``): plain ``Shard(0)`` on every mesh dim (``Replicate`` for a scalar)."""
    return tuple([Shard(0) if tensor_ndim else Replicate()] * mesh_ndim)


def _first_of_each_family(strategies: list[Strategy]) -> list[Strategy]:
    """``strategies`` less those that differ from an earlier one only in the reduce op of their partials
    (``P`` vs ``P(avg)``, which linear ops accept alike, so they cost the same): the planner keeps the
    first of each such family."""
    out: dict[Any, Strategy] = {}
    for strategy in strategies:
        out.setdefault(_partial_kind_blind(strategy), strategy)
    return list(out.values())


def _partial_kind_blind(s: Strategy) -> tuple:
    """``s`` with every partial's reduce op left out: its family (``_first_of_each_family``)."""
    strip = lambda ps: None if ps is None else tuple(_ANY_PARTIAL if p.is_partial() else p for p in ps)  # noqa: E731
    return (tuple(strip(p) for p in s.inputs), tuple(strip(p) for p in s.outputs))


_ANY_PARTIAL = Partial()
"""What ``_partial_kind_blind`` puts for every partial, whatever its reduce op."""


def _strategy_from_spec(spec: OpSpec, n_inputs: int) -> Strategy | None:
    outs = spec.output_specs if isinstance(spec.output_specs, (tuple, list)) else (spec.output_specs,)
    try:
        outputs = tuple(None if o is None else _from_dtensor(o.placements) for o in outs)
        ins = spec.input_specs if spec.input_specs is not None else [outs[0]] * n_inputs
        inputs = tuple(_from_dtensor(i.placements) for i in ins[:n_inputs])
    except ValueError:  # _StridedShard and other placements plans do not express
        return None
    if len(inputs) != n_inputs:
        return None
    return Strategy(inputs, outputs)


def _from_dtensor(placements: Iterable[Any]) -> Placements:
    """DTensor's placements of one spec, as they are: plain ``Shard``/``Replicate``/``Partial`` only."""
    placements = tuple(placements)
    for p in placements:
        if type(p) not in (Shard, Replicate, Partial):
            raise ValueError(f"unsupported placement {p!r}")
    return placements


def _replicated(node: fx.Node, n_inputs: int, mesh_ndim: int) -> Strategy:
    r = tuple([Replicate()] * mesh_ndim)
    outs = output_vals(node)
    return Strategy(tuple([r] * n_inputs), tuple(r if isinstance(v, torch.Tensor) else None for v in outs))


def _tensor_meta(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return TensorMeta(val.shape, val.stride(), val.dtype)
    return [_tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in val]


def _arg_signature(node: fx.Node) -> Any:
    def sig(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v)
        if isinstance(a, (list, tuple)):
            return tuple(sig(x) for x in a)
        return repr(a)

    return (sig(node.args), sig(tuple(sorted(node.kwargs.items()))))
