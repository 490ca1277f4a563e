"""Communication cost: the time of one collective on one group of ranks (alpha-beta model).

This module is the one place where collective formulas live; everything that prices
communication (strategies, resharding, gradient buckets, pipeline sends) calls
``collective_time``. It is not for deciding which collectives a plan needs.

Conventions
-----------
``nbytes`` is the size of the full, unsharded tensor: all_reduce's buffer, all_gather's
OUTPUT, reduce_scatter's INPUT, all_to_all's per-rank buffer, broadcast's buffer and
send_recv's message. A group of one rank, or zero bytes, costs 0.

Model (per rank; p ranks, q of them per node, m nodes)
------------------------------------------------------
A flat ring on one kind of link (bandwidth ``bw``, per-step latency ``lat``) costs
``steps * lat + volume / bw``, with the volumes of ``collective_bytes_per_rank`` and the steps of
``ring_steps`` (all_reduce 2(p-1)/p*n in 2(p-1) steps; all_gather, reduce_scatter, all_to_all
(p-1)/p*n in p-1 steps; broadcast n in p-1 pipelined steps; send_recv n in one step).
Every collective also pays the group's ``base_latency_s`` once.

* Inside one node (m == 1): NVLink bandwidth and latency.
* One rank per node (q == 1): network bandwidth and latency. all_reduce takes the cheaper of
  the ring and NCCL's (double binary) tree, ``2*n/bw + 2*ceil(log2 p)*lat``: reduce up and
  broadcast down, each pipelined, so the tree moves twice the buffer but its latency grows
  with depth, not with p; it wins for small buffers on many nodes.
* Several ranks on each of several nodes (hierarchical, as NCCL does it):
  all_reduce = reduce_scatter of n inside the node, all_reduce of n/q across nodes (each of
  the q local ranks drives its own NIC, so that phase runs at the per-device network
  bandwidth), all_gather of n inside the node. all_gather = all_gather of n/q across nodes,
  then of n inside the node; reduce_scatter mirrors it.
  all_to_all: of each rank's (p-1)/p*n bytes, the share bound for other nodes,
  (p-q)/p*n, leaves through the rank's NIC while the rest crosses NVLink; the slower wins.
  broadcast: one pipelined chain through all ranks, at the network's bandwidth.
  send_recv: priced on the network (a pipeline boundary that crosses nodes is the bottleneck).

Sources: latencies and bandwidths come from the group (see ``hardware.py`` for the NCCL
tuning.cc and nccl-tests figures they default to).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import partial
from typing import Callable, Mapping

from .cluster import GroupTopology

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")

# --------------------------------------------------------------------------------------------
# Volumes and steps of a flat ring: the only place these formulas are written.
# --------------------------------------------------------------------------------------------

_VOLUME_FACTOR: Mapping[str, Callable[[int], float]] = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "send_recv": lambda p: 1.0,
}

_STEPS: Mapping[str, Callable[[int], int]] = {
    "all_reduce": lambda p: 2 * (p - 1),
    "all_gather": lambda p: p - 1,
    "reduce_scatter": lambda p: p - 1,
    "all_to_all": lambda p: p - 1,
    "broadcast": lambda p: p - 1,
    "send_recv": lambda p: 1,
}


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
    return 0.0 if p == 1 else _VOLUME_FACTOR[kind](p) * nbytes


def ring_steps(kind: str, p: int) -> int:
    """Sequential latency-bearing steps of a flat ring of ``p`` ranks (all_reduce: 2(p-1))."""
    _check_kind(kind)
    _check_group_size(p)
    return 0 if p == 1 else _STEPS[kind](p)


# --------------------------------------------------------------------------------------------
# Links
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One kind of connection: bandwidth per rank (bytes/s) and latency per ring step (s)."""

    bw: float
    latency_s: float


def intra_link(group: GroupTopology) -> Link:
    return Link(group.intra_bw, group.intra_latency_s)


def inter_link(group: GroupTopology) -> Link:
    return Link(group.inter_bw, group.inter_latency_s)


def bottleneck_link(group: GroupTopology) -> Link:
    """NVLink when the group stays inside a node, otherwise the network."""
    return intra_link(group) if group.is_intra_node else inter_link(group)


def flat_ring_time(kind: str, nbytes: float, p: int, link: Link) -> float:
    """steps * latency + volume / bandwidth, for a flat ring of ``p`` ranks on ``link``."""
    return ring_steps(kind, p) * link.latency_s + collective_bytes_per_rank(kind, nbytes, p) / link.bw


def tree_all_reduce_time(nbytes: float, p: int, link: Link) -> float:
    """NCCL-style tree all_reduce: 2*n/bw + 2*ceil(log2 p)*latency (reduce up, broadcast down)."""
    return 2 * nbytes / link.bw + 2 * math.ceil(math.log2(p)) * link.latency_s if p > 1 else 0.0


# --------------------------------------------------------------------------------------------
# Per-kind times, without the base latency (added once in collective_time).
# --------------------------------------------------------------------------------------------


def _all_reduce(nbytes: float, group: GroupTopology) -> float:
    if group.is_intra_node:
        return flat_ring_time("all_reduce", nbytes, group.size, intra_link(group))
    if group.per_node == 1:
        link = inter_link(group)
        return min(flat_ring_time("all_reduce", nbytes, group.size, link),
                   tree_all_reduce_time(nbytes, group.size, link))
    q = group.per_node
    return (flat_ring_time("reduce_scatter", nbytes, q, intra_link(group))
            + _all_reduce(nbytes / q, group.across_nodes())
            + flat_ring_time("all_gather", nbytes, q, intra_link(group)))


def _two_level(kind: str, nbytes: float, group: GroupTopology) -> float:
    """all_gather / reduce_scatter: n/q across nodes plus n inside the node."""
    if group.is_intra_node:
        return flat_ring_time(kind, nbytes, group.size, intra_link(group))
    if group.per_node == 1:
        return flat_ring_time(kind, nbytes, group.size, inter_link(group))
    q = group.per_node
    return (flat_ring_time(kind, nbytes / q, group.nodes, inter_link(group))
            + flat_ring_time(kind, nbytes, q, intra_link(group)))


def _all_to_all(nbytes: float, group: GroupTopology) -> float:
    """Off-node share through the NIC, on-node share over NVLink, concurrently."""
    p, q = group.size, group.per_node
    volume = collective_bytes_per_rank("all_to_all", nbytes, p)
    off_node, on_node = volume * (p - q) / (p - 1), volume * (q - 1) / (p - 1)
    latency = (q - 1) * group.intra_latency_s + (p - q) * group.inter_latency_s
    return latency + max(on_node / group.intra_bw, off_node / group.inter_bw)


def _broadcast(nbytes: float, group: GroupTopology) -> float:
    """Pipelined chain: (p - m) NVLink hops and (m - 1) network hops, at the bottleneck bandwidth."""
    volume = collective_bytes_per_rank("broadcast", nbytes, group.size)
    latency = (group.size - group.nodes) * group.intra_latency_s + (group.nodes - 1) * group.inter_latency_s
    return latency + volume / bottleneck_link(group).bw


def _send_recv(nbytes: float, group: GroupTopology) -> float:
    return flat_ring_time("send_recv", nbytes, group.size, bottleneck_link(group))


_TIME: Mapping[str, Callable[[float, GroupTopology], float]] = {
    "all_reduce": _all_reduce,
    "all_gather": partial(_two_level, "all_gather"),
    "reduce_scatter": partial(_two_level, "reduce_scatter"),
    "all_to_all": _all_to_all,
    "broadcast": _broadcast,
    "send_recv": _send_recv,
}
assert tuple(_TIME) == COLLECTIVES == tuple(_VOLUME_FACTOR) == tuple(_STEPS)


def collective_time(kind: str, nbytes: float, group: GroupTopology) -> float:
    """Seconds for collective ``kind`` of ``nbytes`` (full-tensor size, see module doc) on ``group``."""
    _check_kind(kind)
    nbytes = _checked_bytes(nbytes)
    if group.size == 1 or nbytes == 0:
        return 0.0
    return group.base_latency_s + _TIME[kind](nbytes, group)


def _checked_bytes(nbytes: float) -> float:
    try:
        value = float(nbytes)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(nbytes, bool) or not 0 <= value < math.inf:
        raise ValueError(f"nbytes must be a non-negative finite number, got {nbytes!r}")
    return value
