"""Context parallelism's load-balanced sequence layout (``Plan.cp_layout == "load_balanced"``).

Causal attention's work grows with a query's position, so contiguous chunks of the sequence leave the
last cp rank the most work (``(2 cp - 1) / cp`` times the even share). Cut into ``2 cp`` chunks instead,
rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (the head-tail layout of Llama 3 and torchtitan's
context parallelism): every rank then gets the same causal work.

A value split on the sequence over cp is held in that layout; a whole value is in true order. So every
move on the cp dim between split and whole reorders the sequence: whole -> split takes the rank's rows
(``reorder`` into layout order, then DTensor's contiguous chunk), split -> whole puts the gathered rows
back in true order. The user inputs are split the same way (``in_layout``, in the runtime), fused
attention masks its queries by their true positions against whole keys in true order
(``run_locally.attend_locally``), and what is gathered for the loss is in true order (a mean over
tokens would not care). Reordering is local, and its backward reorders the gradient back with the
gradient's own placements (a partial gradient stays partial for the gather's reduce_scatter).

Parameters sharded over cp (FSDP over dp x cp) are not sequences: their gathers are left alone.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.distributed.tensor import DTensor

from autopar.core.axes import MeshAxis
from autopar.core.placement import placements_to_strs, str_to_placement
from autopar.core.plan import LOAD_BALANCED, Plan

from .insert_redistributes import redistribute, value_name
from .layout import memory_order, wrap_with_layout


@functools.lru_cache(maxsize=64)
def layout_order(length: int, cp: int) -> tuple[int, ...]:
    """The true positions of a sequence of ``length`` in layout order: chunk 0, chunk 2cp-1, chunk 1,
    chunk 2cp-2, ... of ``2 cp`` chunks, so that the r-th of cp contiguous pieces is rank r's rows."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} does not split into 2 x cp={cp} chunks")
    size = length // (2 * cp)
    chunks = [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]
    return tuple(p for c in chunks for p in range(c * size, (c + 1) * size))


def rank_ranges(length: int, cp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """The [start, end) ranges of true positions cp rank ``rank`` holds, in its rows' order."""
    size = length // (2 * cp)
    return tuple((c * size, (c + 1) * size) for c in (rank, 2 * cp - 1 - rank))


def _index(length: int, cp: int, into_layout: bool, device: torch.device) -> torch.Tensor:
    """``index_select``'s index that puts a sequence of ``length`` into layout order, or back: made once
    per shape, or, while a lowering traces the program (``passes/lower.py``), made in the trace, where a
    tensor made outside it cannot be read."""
    if detect_fake_mode() is not None:
        return _made_index(length, cp, into_layout, device)
    return _kept_index(length, cp, into_layout, device)


def _made_index(length: int, cp: int, into_layout: bool, device: torch.device) -> torch.Tensor:
    order = torch.tensor(layout_order(length, cp), device=device)
    return order if into_layout else torch.argsort(order)


_kept_index = functools.lru_cache(maxsize=64)(_made_index)


def in_layout(x: torch.Tensor, plan: Plan, placements: Sequence[str]) -> torch.Tensor:
    """A whole user input (or targets) to be split with ``placements``, its sequence in the plan's
    layout order where ``placements`` split it over cp: what the runtime shards the inputs from."""
    if plan.cp_layout != LOAD_BALANCED or MeshAxis.CP not in plan.mesh.dim_names:
        return x
    split = str_to_placement(placements[plan.mesh.dim_names.index(MeshAxis.CP)])
    if not split.is_shard():
        return x
    return x.index_select(split.dim, _index(x.shape[split.dim], plan.mesh.size(MeshAxis.CP), True, x.device))


def reorder(x: DTensor, dim: int, cp: int, into_layout: bool) -> DTensor:
    """``x``, whole on the sequence dim ``dim`` (replicated or partial there on every mesh dim), with
    that dim reordered into layout order (``into_layout``) or back to true order."""
    return _Reorder.apply(x, dim, cp, into_layout)


class _Reorder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, dim: int, cp: int, into_layout: bool) -> DTensor:  # type: ignore[override]
        ctx.dim, ctx.cp, ctx.into_layout = dim, cp, into_layout
        return _reordered(x, dim, cp, into_layout)

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple[DTensor, None, None, None]:  # type: ignore[override]
        return _reordered(grad, ctx.dim, ctx.cp, not ctx.into_layout), None, None, None


def _reordered(x: DTensor, dim: int, cp: int, into_layout: bool) -> DTensor:
    if any(p.is_shard(dim) for p in x.placements):
        raise NotImplementedError(f"reordering the sequence (dim {dim}) of a value split on it over another "
                                  f"mesh dim ({x.placements}): the load-balanced layout cannot run this plan")
    local = x.to_local()
    moved = local.index_select(dim, _index(local.shape[dim], cp, into_layout, local.device))
    return wrap_with_layout(moved, x.device_mesh, placements_to_strs(x.placements), memory_order(local))


def balance_sequence(gm: fx.GraphModule, plan: Plan, produced: Mapping[str, Sequence[str]],
                     parameters: set[str]) -> int:
    """Put a ``reorder`` before every move of the plan's program that splits a value on the sequence
    over the cp dim, and after every move that makes one whole there; returns how many. Only under the
    load-balanced layout; the moves of ``parameters`` (values that are parameters or views of one) are
    FSDP's gathers, left alone."""
    if plan.cp_layout != LOAD_BALANCED or MeshAxis.CP not in plan.mesh.dim_names:
        return 0
    cp_dim, cp = plan.mesh.dim_names.index(MeshAxis.CP), plan.mesh.size(MeshAxis.CP)
    length = sequence_length(plan, cp_dim)
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not redistribute:
            continue
        arg = node.args[0]
        if arg.name in parameters or value_name(arg) not in produced:
            continue
        have = str_to_placement(produced[value_name(arg)][cp_dim])
        want = str_to_placement(node.args[1][cp_dim])
        count += _reorder_move(graph, node, arg, have, want, cp, length)
    graph.lint()
    gm.recompile()
    return count


def sequence_length(plan: Plan, cp_dim: int) -> int:
    """The length of the sequence the plan splits over mesh dim ``cp_dim``: of its user inputs' split dim."""
    for spec in plan.inputs.values():
        split = str_to_placement(spec["placements"][cp_dim])
        if split.is_shard():
            return spec["shape"][split.dim]
    raise ValueError("a context-parallel plan whose inputs are not split over cp")


def _reorder_move(graph: fx.Graph, node: fx.Node, arg: fx.Node, have: Any, want: Any, cp: int, length: int) -> int:
    """Reorders around the move ``node`` of ``arg`` from ``have`` to ``want`` on the cp dim: none where it
    neither splits nor gathers, or moves a dim other than a sequence of ``length`` (rows flattened from
    ``[batch, seq]``, only ever read row by row or summed: ``planning/roles.py``)."""
    if have == want or not (have.is_shard() or want.is_shard()):
        return 0
    if have.is_shard() and want.is_shard():
        raise NotImplementedError(f"a move from {have} to {want} on the cp dim ({node.name}): the load-balanced "
                                  "layout keeps each value split on its sequence dim")
    if arg.meta["val"].shape[(want if want.is_shard() else have).dim] != length:
        return 0
    if want.is_shard():  # whole -> split: into layout order, then the rank's contiguous piece
        with graph.inserting_before(node):
            into = graph.call_function(reorder, (arg, want.dim, cp, True))
        node.replace_input_with(arg, into)
        return 1
    with graph.inserting_after(node):  # split -> whole: gathered in layout order, back to true order
        back = graph.call_function(reorder, (node, have.dim, cp, False))
    node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    return 1
