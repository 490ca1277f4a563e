"""Communication cost: the time of one collective on one group of ranks (alpha-beta model).

This module is the one numeric entry point for collective costs; everything that prices
communication (strategies, resharding, gradient buckets, pipeline sends) calls
``collective_time``. The formulas themselves are written once, as sympy expressions, in
``symbolic.py``; this module compiles them to plain Python on first use (``lambdify``) and
evaluates them. It is not for deciding which collectives a plan needs.

Conventions
-----------
``nbytes`` is the size of the full, unsharded tensor: all_reduce's buffer, all_gather's
OUTPUT, reduce_scatter's INPUT, all_to_all's per-rank buffer, broadcast's buffer and
send_recv's message. A group of one rank, or zero bytes, costs 0.

Model (per rank; p ranks, q of them per node, N nodes; formulas in ``symbolic.py``)
-----------------------------------------------------------------------------------
A flat ring on one kind of link (bandwidth ``B``, per-step latency ``alpha``) costs
``steps * alpha + volume / B``, with the volumes of ``collective_bytes_per_rank`` and the steps of
``ring_steps`` (all_reduce 2(p-1)/p*n in 2(p-1) steps; all_gather, reduce_scatter, all_to_all
(p-1)/p*n in p-1 steps; broadcast n in p-1 pipelined steps; send_recv n in one step).
Every collective also pays the group's ``base_latency_s`` once.

* Inside one node (N == 1): NVLink bandwidth and latency.
* One rank per node (q == 1): network bandwidth and latency. all_reduce takes the cheaper of
  the ring and NCCL's (double binary) tree, ``2*n/B + 2*ceil(log2 p)*alpha``: reduce up and
  broadcast down, each pipelined, so the tree moves twice the buffer but its latency grows
  with depth, not with p; it wins for small buffers on many nodes.
* Several ranks on each of several nodes (hierarchical, as NCCL does it):
  all_reduce = reduce_scatter of n inside the node, all_reduce of n/q across nodes (each of
  the q local ranks drives its own NIC, so that phase runs at the per-device network
  bandwidth; ring or tree, whichever is cheaper), all_gather of n inside the node.
  all_gather = all_gather of n/q across nodes, then of n inside the node; reduce_scatter
  mirrors it. all_to_all: of each rank's (p-1)/p*n bytes, the share bound for other nodes,
  (p-q)/p*n, leaves through the rank's NIC while the rest crosses NVLink; the slower wins.
  broadcast: one pipelined chain through all ranks, at the network's bandwidth.
  send_recv: priced on the network (a pipeline boundary that crosses nodes is the bottleneck).

Sources: latencies and bandwidths come from the group (see ``hardware.py`` for the NCCL
tuning.cc and nccl-tests figures they default to); formulas' sources in ``symbolic.py``.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Callable

from .cluster import GroupTopology
from .symbolic import (
    COLLECTIVES,
    RING_STEPS,
    RING_VOLUME,
    TIME_ARGUMENTS,
    collective_time_expr,
    compile_expr,
    layout_of,
    n,
    p,
    time_arguments,
)


@functools.cache
def _volume_function(kind: str) -> Callable[[int, float], float]:
    return compile_expr((p, n), RING_VOLUME[kind])


@functools.cache
def _steps_function(kind: str) -> Callable[[int], int]:
    return compile_expr((p,), RING_STEPS[kind])


@functools.cache
def _time_function(kind: str, layout: str) -> Callable[..., float]:
    """The compiled ``collective_time_expr``, built on first use and kept (a few ms each)."""
    return compile_expr(TIME_ARGUMENTS, collective_time_expr(kind, layout))


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}: expected one of {', '.join(COLLECTIVES)}")


def _check_group_size(p: int) -> None:
    if not isinstance(p, numbers.Integral) or isinstance(p, bool) or p < 1:
        raise ValueError(f"group size must be a positive int, got {p!r}")


def collective_bytes_per_rank(kind: str, nbytes: float, p: int) -> float:
    """Bytes each rank sends in a flat ring of ``p`` ranks (e.g. all_reduce: 2(p-1)/p * nbytes)."""
    _check_kind(kind)
    _check_group_size(p)
    return 0.0 if p == 1 else float(_volume_function(kind)(p, nbytes))


def ring_steps(kind: str, p: int) -> int:
    """Sequential latency-bearing steps of a flat ring of ``p`` ranks (all_reduce: 2(p-1))."""
    _check_kind(kind)
    _check_group_size(p)
    return 0 if p == 1 else int(_steps_function(kind)(p))


def collective_time(kind: str, nbytes: float, group: GroupTopology) -> float:
    """Seconds for collective ``kind`` of ``nbytes`` (full-tensor size, see module doc) on ``group``."""
    _check_kind(kind)
    nbytes = _checked_bytes(nbytes)
    if group.size == 1 or nbytes == 0:
        return 0.0
    return _time_function(kind, layout_of(group))(*time_arguments(group, nbytes))


def _checked_bytes(nbytes: float) -> float:
    try:
        value = float(nbytes)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(nbytes, bool) or not 0 <= value < math.inf:
        raise ValueError(f"nbytes must be a non-negative finite number, got {nbytes!r}")
    return value
