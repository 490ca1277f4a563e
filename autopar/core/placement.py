"""Placements as plans write them: ``S(d)``, ``R``, ``P`` and ``P(avg)`` strings, and the one conversion.

A placement says how one tensor lies along one mesh dimension. Inside the planner and at run time it is
DTensor's own value (``Shard(d)``, ``Replicate()``, ``Partial(reduce_op)``: frozen, hashable, with
``is_shard()``/``is_replicate()``/``is_partial()``), one per mesh dimension. Plans keep the short human
form, one string per mesh dimension, so plan files stay readable and never pickle torch objects: the
functions here convert between the two where a plan is written or read, and nowhere else.
"""

from __future__ import annotations

import re
from typing import Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autopar.core.errors import PlanFormatError

Placements = tuple[Placement, ...]  # one placement per mesh dim

_SHARD = re.compile(r"^S\((-?\d+)\)$")
_PARTIAL = re.compile(r"^P(?:\((\w+)\))?$")


def placement_to_str(p: Placement) -> str:
    """DTensor placement -> ``S(0)`` / ``R`` / ``P`` (sum) / ``P(avg)``."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    raise ValueError(f"placement {p!r} has no plan form (only Shard, Replicate, Partial)")


def str_to_placement(text: str) -> Placement:
    """Inverse of ``placement_to_str``; raises PlanFormatError naming the bad string."""
    text = text.strip()
    if text == "R":
        return Replicate()
    m = _SHARD.match(text)
    if m:
        return Shard(int(m.group(1)))
    m = _PARTIAL.match(text)
    if m:
        return Partial(m.group(1) or "sum")
    raise PlanFormatError(f"bad placement {text!r}: expected 'R', 'S(<dim>)', 'P' or 'P(<op>)'")


def placements_to_strs(ps: Sequence[Placement]) -> list[str]:
    return [placement_to_str(p) for p in ps]


def strs_to_placements(ss: Sequence[str]) -> Placements:
    return tuple(str_to_placement(s) for s in ss)


def optimizer_shard_dim(shape: Sequence[int], placements: Sequence[Placement], ways: int) -> int | None:
    """The tensor dim on which ZeRO-1/2 splits a parameter's optimizer state and gradient ``ways``
    ways: the first dim that no mesh dim already shards and that has at least ``ways`` elements.
    None when there is none (a tensor-parallel bias, a scalar): that parameter keeps whole state.

    One rule for both sides: ``Pricer.parameter_memory`` divides state by ``ways`` exactly when this
    finds a dim, and ``passes/zero.py`` shards the optimizer's parameters on it.
    """
    taken = {p.dim % max(1, len(shape)) for p in placements if p.is_shard()}
    for dim, size in enumerate(shape):
        if dim not in taken and size >= ways:
            return dim
    return None


def grows_locally(src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """Whether moving a tensor from ``src`` to ``dst`` (one placement per dim of a mesh of ``mesh_shape``)
    leaves each rank a larger local tensor: it is gathered on more ranks than any new split divides it
    again. A runtime that saves such a move's result for backward holds more than its source; autopar's
    makes it again in backward instead (``passes/rematerialize.py``), which ``planning/pricing.py`` charges."""
    return _split_ways(src, mesh_shape) > _split_ways(dst, mesh_shape)


def _split_ways(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> int:
    ways = 1
    for placement, size in zip(placements, mesh_shape):
        ways *= size if placement.is_shard() else 1
    return ways
