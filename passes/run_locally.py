"""Run the ops DTensor cannot dispatch on local shards, outside DTensor.

Three kinds of nodes get this treatment, all marked ``"local": true`` in the plan's ops:

* ops with no DTensor strategy, planned all-``R`` (the planner warned): every rank runs the whole op;
* ops planned with one of autopar's own *local rules* (``autopar.planning.strategies.LOCAL_RULES`` and
  ``NODE_RULES``), e.g. fused attention split on batch or heads, advanced indexing split as its indices: each
  rank runs the op on its shards, which is exact because the split dims are independent (an input read whole
  there, ``READ_WHOLE``: fused attention's float mask, a learned bias; the table indexing gathers rows of,
  gets a partial gradient, which DTensor reduces);
* context parallelism (``planning/strategies.py``, ``_sequence_split``): fused attention with its
  queries split on the sequence against the gathered keys and values, whose causal mask is built for
  the true positions of the rank's queries (``attend_locally``: SDPA's ``is_causal`` aligns the mask
  top-left, which is wrong for queries that start at a global offset, or lie in the two chunks of the
  load-balanced layout, ``sequence_layout.py``); or, with its keys and values split on the sequence
  too, ring attention over the cp group (``ring_attention.py``; ``Plan.cp_attention``); and the views
  that flatten a sequence split into the rows of ``[batch * seq, ...]`` or back, run on local shards at
  their local shape.

The node's DTensor inputs become local tensors, the op runs, and its outputs are wrapped back with the
planned placements. ``to_local``/``from_local`` are differentiable, so autograd reaches every input.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._pytree import tree_map

from autopar.core.placement import strs_to_placements
from autopar.core.plan import LOAD_BALANCED
from autopar.ir.capture import ATTENTION_QUERY_DIM as QUERY_DIM
from autopar.ir.capture import FUSED_ATTENTION, VIEWS

from .dtensor_backward import DIFFERENTIABLE
from .insert_redistributes import mesh_attr
from .layout import memory_order, wrap_with_layout
from .ring_attention import ring_attention
from .sequence_layout import rank_ranges


READ_WHOLE = {FUSED_ATTENTION: 3, torch.ops.aten.index.Tensor: 0}
"""Per local op, the input slot its strategies may read whole on a mesh dim that splits its output
(``planning/strategies.py``: ``LOCAL_RULES``' broadcast mask, ``index_strategies``)."""


def run_local_op(op: Callable[..., Any], mesh: DeviceMesh, out_placements: Sequence[Sequence[str] | None],
                 layouts: Sequence[tuple[int, ...] | None], *args: Any,
                 query_ranges: tuple[tuple[int, int], ...] | None = None,
                 ring: tuple[int, tuple[tuple[tuple[int, int], ...], ...]] | None = None, **kwargs: Any) -> Any:
    """``op`` on the local shards of its arguments, its outputs wrapped with ``out_placements``.
    ``query_ranges``: fused attention whose queries are split on the sequence (context parallelism),
    this rank's holding those [start, end) ranges of positions; its whole keys and values get partial
    gradients (``attend_locally``). ``ring``: (mesh dim, the ranges each of its ranks holds) of fused
    attention whose keys and values are split there too, run as ring attention over that dim's group.
    The input of ``READ_WHOLE`` (fused attention's mask, advanced indexing's ``self``), where it is whole on a
    mesh dim that splits the output (a learned bias of batch size 1, the relative position bias of Swin, under
    a batch split; a table whose rows the split ids gather), gets a partial gradient there too: each rank's is
    the sum over its own shard of the output."""
    slot = READ_WHOLE.get(op)
    if slot is not None and len(args) > slot and isinstance(args[slot], DTensor):
        args = (*args[:slot], _partial_gradient(args[slot], out_placements[0]), *args[slot + 1:])
    if ring is not None or query_ranges is not None:
        q, k, v, *rest = args
        k, v = (_partial_gradient(t, out_placements[0]) for t in (k, v))
        if ring is not None:
            op, args = functools.partial(ring_attention, mesh.get_group(ring[0]), ring[1]), (q, k, v, *rest)
        else:
            op, args = attend_locally, (query_ranges, q, k, v, *rest)
    to_local = lambda a: a.to_local() if isinstance(a, DTensor) else a  # noqa: E731
    op = DIFFERENTIABLE.get(op, op)  # an op whose captured form has no derivative here: one that has
    out = op(*tree_map(to_local, args), **tree_map(to_local, kwargs))
    if out is None:  # an op run for its effect (``ir/buffer_writes.py``)
        return None
    if isinstance(out, torch.Tensor):
        return wrap_with_layout(out, mesh, out_placements[0], layouts[0])
    return type(out)(
        wrap_with_layout(t, mesh, p, order) if isinstance(t, torch.Tensor) and p is not None else t
        for t, p, order in zip(out, out_placements, layouts)
    )


def local_call(node: fx.Node) -> tuple[Any, tuple[Any, ...]] | None:
    """(op, its arguments) of a node ``run_locally`` rewrote, else None."""
    if node.op != "call_function" or node.target is not run_local_op:
        return None
    return node.args[0], node.args[4:]


def attend_locally(ranges: tuple[tuple[int, int], ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False, **kwargs: Any
                   ) -> torch.Tensor:
    """Fused attention of this rank's queries, the positions ``ranges`` of the sequence in order,
    against the whole keys in true order. Causal attention gets an explicit mask for the queries' true
    positions: a query at position ``p`` sees keys ``0 .. p``."""
    if is_causal:
        rows = torch.cat([torch.arange(start, end, device=q.device) for start, end in ranges])
        attn_mask = rows[:, None] >= torch.arange(k.shape[QUERY_DIM], device=q.device)[None, :]
        is_causal = False
    return FUSED_ATTENTION(q, k, v, attn_mask, dropout_p, is_causal, **kwargs)


def _partial_gradient(t: Any, out: Sequence[str]) -> Any:
    """``t``'s local tensor, whose gradient is partial on each mesh dim where ``t`` is whole and the
    output ``out`` is split (a DTensor's ``to_local`` would call it replicated: no reduction)."""
    if not isinstance(t, DTensor):
        return t
    grads = [Partial() if p.is_replicate() and o.startswith("S(") else p for p, o in zip(t.placements, out)]
    if grads == list(t.placements):
        return t.to_local()
    return _ContiguousGradient.apply(t.to_local(grad_placements=grads))


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. The partial gradient of the gathered keys
    and values is reduce-scattered by the gather's backward into a contiguous shard, which DTensor
    describes with the strides of the gradient it was given (CPU flash attention returns it permuted):
    given a contiguous one, the two agree, and the views before the gather can take it back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


def _query_ranges(node: fx.Node, placements: Sequence[str], mesh: DeviceMesh, cp_layout: str
                  ) -> tuple[tuple[int, int], ...] | None:
    """The [start, end) ranges of the sequence this rank's fused attention queries hold when
    ``placements`` split them on it (one chunk, or the load-balanced layout's two over cp); None when
    they are whole there."""
    split = [d for d, p in enumerate(placements) if p == f"S({QUERY_DIM})"]
    if not split:
        return None
    q = node.args[0].meta["val"]
    if cp_layout == LOAD_BALANCED:
        (dim,) = split
        return rank_ranges(q.shape[QUERY_DIM], mesh.size(dim), mesh.get_local_rank(dim))
    shape, offset = compute_local_shape_and_global_offset(tuple(q.shape), mesh, strs_to_placements(placements))
    return ((int(offset[QUERY_DIM]), int(offset[QUERY_DIM]) + int(shape[QUERY_DIM])),)


def _ring(node: fx.Node, placements: Sequence[Sequence[str]], mesh: DeviceMesh, cp_layout: str
          ) -> tuple[int, tuple[tuple[tuple[int, int], ...], ...]] | None:
    """(mesh dim, the [start, end) ranges of the sequence each rank of it holds) where fused attention's
    queries and keys (``placements[0]``, ``[1]``) are both split on the sequence: ring attention; None
    where the keys are whole (gathered before the op, ``attend_locally``)."""
    split = f"S({QUERY_DIM})"
    dims = [d for d, (q, k) in enumerate(zip(placements[0], placements[1])) if q == split and k == split]
    if not dims:
        return None
    (dim,) = dims
    length, size = node.args[0].meta["val"].shape[QUERY_DIM], mesh.size(dim)
    if cp_layout == LOAD_BALANCED:
        return dim, tuple(rank_ranges(length, size, r) for r in range(size))
    chunk = length // size
    return dim, tuple(((r * chunk, (r + 1) * chunk),) for r in range(size))


def _local_shape(node: fx.Node, placements: Sequence[str], mesh: DeviceMesh) -> list[int]:
    """The shape of this rank's shard of ``node``'s output under ``placements`` (plans keep shards even)."""
    shape, _ = compute_local_shape_and_global_offset(tuple(node.meta["val"].shape), mesh,
                                                      strs_to_placements(placements))
    return list(shape)


def _layouts(node: fx.Node) -> tuple[tuple[int, ...] | None, ...]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return tuple(memory_order(v) if isinstance(v, torch.Tensor) else None for v in vals)


def run_locally(gm: fx.GraphModule, ops: Mapping[str, Mapping[str, Any]], mesh: DeviceMesh, cp_layout: str) -> int:
    """Rewrite every node marked local; returns how many. ``cp_layout``: the plan's (``Plan.cp_layout``)."""
    local = {name for name, op in ops.items() if op.get("local")}
    if not local:
        return 0
    mesh_node = mesh_attr(gm, mesh)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.name in local:
            outs = tuple(tuple(p) if p is not None else None for p in ops[node.name]["outputs"])
            ranges = (_query_ranges(node, ops[node.name]["inputs"][0], mesh, cp_layout)
                      if node.target is FUSED_ATTENTION else None)
            ring = _ring(node, ops[node.name]["inputs"], mesh, cp_layout) if ranges is not None else None
            if ring is not None:
                node.kwargs = {**node.kwargs, "ring": ring}
            elif ranges is not None:
                node.kwargs = {**node.kwargs, "query_ranges": ranges}
            args = (node.args[0], _local_shape(node, outs[0], mesh)) if node.target in VIEWS else node.args
            node.args = (node.target, mesh_node, outs, _layouts(node), *args)
            node.target = run_local_op
    gm.recompile()
    return len(local)
