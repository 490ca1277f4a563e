"""Closed-form cost formulas (sympy): the one place the collective, pipeline and matmul formulas live.

This module is for *stating* formulas: ``comm.py`` evaluates the collective ones (compiled once
with ``lambdify``), ``pipeline.py`` the pipeline ones, and ``render_collective`` prints them for
users with a tensor's size substituted (``autopar explain``). It is not for deciding which
collectives a plan needs (``autopar.planning.pricing``) nor for checking inputs (``comm.py`` does).

Symbols
-------
``p`` ranks in a group (for a pipeline: stages), ``q`` of them on each node, ``N`` nodes spanned;
``n`` bytes of the full tensor (``comm.py`` states per collective which buffer that is); ``alpha``
and ``B`` the per-step latency (s) and per-rank bandwidth (bytes/s) of the group's link, NVLink for
a group inside one node or when it spans several nodes with several ranks on each, the network for
one rank per node; ``alpha_net``, ``B_net`` the network's, for groups that use both; ``alpha_0``
the latency paid once per collective; ``m`` microbatches, ``v`` model chunks per device.

Collectives (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations
in MPICH", IJHPCA 2005; Patarasuk and Yuan 2009 for the bandwidth-optimal ring)
-------------------------------------------------------------------------------------------
A flat ring of ``p`` ranks moves, per rank, ``2(p-1)/p n`` bytes in ``2(p-1)`` steps for
all_reduce (reduce_scatter then all_gather); ``(p-1)/p n`` in ``p-1`` steps for all_gather,
reduce_scatter and all_to_all; ``n`` in ``p-1`` pipelined steps for broadcast; ``n`` in one step
for send_recv. Its time is ``alpha * steps + volume / B``. NCCL's (double binary) tree all_reduce
costs ``2 n / B + 2 ceil(log2 p) alpha``: the whole buffer up and down a tree of depth
``ceil(log2 p)``. Groups spanning nodes run hierarchically, as NCCL does (see ``ALGORITHMS``).
A collective takes the fastest algorithm its layout offers, plus ``alpha_0``.

Pipeline (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC21, §2.2; Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, §4.2.3)
---------------------------------------------------------------------------------------------
Bubble (idle share of the ideal time): ``(p-1)/m`` for GPipe and 1F1B, ``(p-1)/(v m)``
interleaved. Microbatches whose activations the first stage holds at once: ``m`` (GPipe),
``min(p, m)`` (1F1B), ``min(m, ((v - 1) r + 2 (p - 1) + 1) / v)`` (interleaved, ``r`` microbatches a round).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import sympy
from sympy import Expr, Integer, Max, Min, Symbol

from .cluster import GroupTopology

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")

# --------------------------------------------------------------------------------------------
# Symbols
# --------------------------------------------------------------------------------------------

p = Symbol("p", positive=True, integer=True)
q = Symbol("q", positive=True, integer=True)
N = Symbol("N", positive=True, integer=True)
n = Symbol("n", positive=True)
alpha = Symbol("alpha", nonnegative=True)
B = Symbol("B", positive=True)
alpha_net = Symbol("alpha_net", nonnegative=True)
B_net = Symbol("B_net", positive=True)
alpha_0 = Symbol("alpha_0", nonnegative=True)
m = Symbol("m", positive=True, integer=True)
v = Symbol("v", positive=True, integer=True)

TIME_ARGUMENTS = (p, q, N, n, alpha, B, alpha_net, B_net, alpha_0)
"""Argument order of the compiled collective times (``compile_time``, ``time_arguments``)."""


class ceil_log2(sympy.Function):
    """Depth of a binary tree over ``p`` leaves, ``ceil(log2 p)``, exact for integers."""

    @classmethod
    def eval(cls, x: Expr) -> Expr | None:
        if x.is_Integer and x > 0:
            return Integer(_int_ceil_log2(int(x)))
        return None

    def _sympystr(self, printer) -> str:
        return f"⌈log2 {printer._print(self.args[0])}⌉"


def _int_ceil_log2(x: int) -> int:
    return (int(x) - 1).bit_length()


# --------------------------------------------------------------------------------------------
# Flat ring and tree: volumes, steps, times
# --------------------------------------------------------------------------------------------

RING_VOLUME: Mapping[str, Expr] = {
    "all_reduce": 2 * (p - 1) / p * n,
    "all_gather": (p - 1) / p * n,
    "reduce_scatter": (p - 1) / p * n,
    "all_to_all": (p - 1) / p * n,
    "broadcast": n,
    "send_recv": n,
}
"""Bytes each rank sends in a flat ring of ``p`` ranks (p >= 2)."""

RING_STEPS: Mapping[str, Expr] = {
    "all_reduce": 2 * (p - 1),
    "all_gather": p - 1,
    "reduce_scatter": p - 1,
    "all_to_all": p - 1,
    "broadcast": p - 1,
    "send_recv": Integer(1),
}
"""Sequential latency-bearing steps of a flat ring of ``p`` ranks (p >= 2)."""


def ring_time(kind: str, nbytes: Expr = n, ranks: Expr = p, latency: Expr = alpha,
              bandwidth: Expr = B) -> Expr:
    """``steps * latency + volume / bandwidth`` of a flat ring (defaults: the symbols p, n, alpha, B)."""
    values = {p: ranks, n: nbytes}
    return RING_STEPS[kind].subs(p, ranks) * latency + RING_VOLUME[kind].subs(values, simultaneous=True) / bandwidth


def tree_all_reduce_time(nbytes: Expr = n, ranks: Expr = p, latency: Expr = alpha,
                         bandwidth: Expr = B) -> Expr:
    """NCCL's tree all_reduce: ``2 n / B + 2 ceil(log2 p) alpha`` (reduce up, broadcast down)."""
    return 2 * nbytes / bandwidth + 2 * ceil_log2(ranks) * latency


# --------------------------------------------------------------------------------------------
# Layouts and algorithms
# --------------------------------------------------------------------------------------------

ONE_NODE = "one node"
ONE_PER_NODE = "one rank per node"
HIERARCHICAL = "hierarchical"
LAYOUTS = (ONE_NODE, ONE_PER_NODE, HIERARCHICAL)


def layout_of(group: GroupTopology) -> str:
    """Which formulas price ``group``: inside one node, one rank per node, or both levels."""
    if group.is_intra_node:
        return ONE_NODE
    return ONE_PER_NODE if group.per_node == 1 else HIERARCHICAL


def _flat(kind: str) -> dict[str, Expr]:
    return {"ring": ring_time(kind)}


def _hierarchical_all_reduce() -> dict[str, Expr]:
    """reduce_scatter of n inside the node, all_reduce of n/q across nodes (each local rank drives
    its own NIC), all_gather of n inside the node."""
    local = ring_time("reduce_scatter", n, q) + ring_time("all_gather", n, q)
    return {"ring across nodes": local + ring_time("all_reduce", n / q, N, alpha_net, B_net),
            "tree across nodes": local + tree_all_reduce_time(n / q, N, alpha_net, B_net)}


def _two_level(kind: str) -> dict[str, Expr]:
    """all_gather / reduce_scatter: n/q across nodes plus n inside the node."""
    return {"two-level ring": ring_time(kind, n / q, N, alpha_net, B_net) + ring_time(kind, n, q)}


def _hierarchical_all_to_all() -> dict[str, Expr]:
    """Of each rank's (p-1)/p n bytes, (p-q)/p n leave through its NIC while (q-1)/p n cross
    NVLink, concurrently: the slower share wins."""
    latency = (q - 1) * alpha + (p - q) * alpha_net
    return {"pairwise": latency + Max((q - 1) / p * n / B, (p - q) / p * n / B_net)}


def _hierarchical_broadcast() -> dict[str, Expr]:
    """One pipelined chain through all ranks: (p - N) NVLink hops and (N - 1) network hops, at the
    network's bandwidth."""
    return {"chain": (p - N) * alpha + (N - 1) * alpha_net + n / B_net}


def _hierarchical_send_recv() -> dict[str, Expr]:
    """Priced on the network: a pipeline boundary that crosses nodes is the bottleneck."""
    return {"ring": ring_time("send_recv", n, p, alpha_net, B_net)}


_WITHOUT_BASE_LATENCY: Mapping[str, Mapping[str, dict[str, Expr]]] = {
    "all_reduce": {ONE_NODE: _flat("all_reduce"),
                   ONE_PER_NODE: {**_flat("all_reduce"), "tree": tree_all_reduce_time()},
                   HIERARCHICAL: _hierarchical_all_reduce()},
    "all_gather": {ONE_NODE: _flat("all_gather"), ONE_PER_NODE: _flat("all_gather"),
                   HIERARCHICAL: _two_level("all_gather")},
    "reduce_scatter": {ONE_NODE: _flat("reduce_scatter"), ONE_PER_NODE: _flat("reduce_scatter"),
                       HIERARCHICAL: _two_level("reduce_scatter")},
    "all_to_all": {ONE_NODE: _flat("all_to_all"), ONE_PER_NODE: _flat("all_to_all"),
                   HIERARCHICAL: _hierarchical_all_to_all()},
    "broadcast": {ONE_NODE: _flat("broadcast"), ONE_PER_NODE: _flat("broadcast"),
                  HIERARCHICAL: _hierarchical_broadcast()},
    "send_recv": {ONE_NODE: _flat("send_recv"), ONE_PER_NODE: _flat("send_recv"),
                  HIERARCHICAL: _hierarchical_send_recv()},
}
ALGORITHMS: Mapping[str, Mapping[str, Mapping[str, Expr]]] = {
    kind: {layout: {name: alpha_0 + expr for name, expr in algorithms.items()}
           for layout, algorithms in by_layout.items()}
    for kind, by_layout in _WITHOUT_BASE_LATENCY.items()
}
"""Seconds of each algorithm of each collective on each layout, base latency included."""
assert tuple(ALGORITHMS) == COLLECTIVES == tuple(RING_VOLUME) == tuple(RING_STEPS)


def collective_time_expr(kind: str, layout: str) -> Expr:
    """Seconds of collective ``kind`` on ``layout``: the fastest of its algorithms."""
    return Min(*ALGORITHMS[kind][layout].values())


def time_arguments(group: GroupTopology, nbytes: float) -> tuple[float, ...]:
    """Values of ``TIME_ARGUMENTS`` for ``group``: (alpha, B) is the network for one rank per node."""
    flat_on_network = group.per_node == 1 and group.nodes > 1
    latency, bandwidth = (group.inter_latency_s, group.inter_bw) if flat_on_network \
        else (group.intra_latency_s, group.intra_bw)
    return (group.size, group.per_node, group.nodes, nbytes, latency, bandwidth,
            group.inter_latency_s, group.inter_bw, group.base_latency_s)


def compile_expr(args: tuple[Symbol, ...], expr: Expr) -> Callable[..., float]:
    """A plain-Python function of ``args`` computing ``expr`` (math module; exact ceil_log2)."""
    return sympy.lambdify(args, expr, modules=[{"ceil_log2": _int_ceil_log2}, "math"])


# --------------------------------------------------------------------------------------------
# Pipeline and matmul
# --------------------------------------------------------------------------------------------

BUBBLE_FRACTION: Mapping[str, Expr] = {
    "gpipe": (p - 1) / m,
    "1f1b": (p - 1) / m,
    "interleaved": (p - 1) / (v * m),
}
"""Idle share of the ideal step time of ``p`` stages over ``m`` microbatches (``v`` chunks)."""

INTERLEAVED_ROUND: Expr = m / Max(1, sympy.floor(m / p))
"""Microbatches in each round of torch's interleaved 1F1B: it cuts ``m`` into ``max(1, m // p)`` rounds of
equal size (``p`` where ``m`` is a multiple of ``p``)."""

MICROBATCHES_IN_FLIGHT: Mapping[str, Expr] = {
    "gpipe": m,
    "1f1b": Min(p, m),
    "interleaved": Min(m, ((v - 1) * INTERLEAVED_ROUND + 2 * (p - 1) + 1) / v),
}
"""Microbatches whose saved activations the first stage holds at once (p >= 2). Interleaved: the first
device's warmup forwards plus one, ``(v - 1) r + 2 (p - 1) + 1`` chunk-microbatches over ``r`` microbatches a
round (Megatron-LM's count, Narayanan et al., SC21, where ``r = p``: ``p (1 + (p - 1) / (p v))``), at most all
``m``; equal to what ``simulate`` of torch's table holds, where ``m`` is not a multiple of ``p`` too."""

LAST_STAGE_IN_FLIGHT: Mapping[str, Expr] = {
    "gpipe": m,
    "1f1b": Integer(1),
    "interleaved": ((v - 1) * INTERLEAVED_ROUND + 1) / v,
}
"""Microbatches whose saved activations the last stage (device ``p - 1``) holds at once, in stages' worth
(p >= 2): every one under GPipe; one under 1F1B (stage ``s`` holds ``min(p - s, m)``, Narayanan et al., SOSP
2019); interleaved: the last device's warmup forwards plus one, ``(v - 1) r + 1`` chunk-microbatches
(Megatron-LM's warmup count of rank ``p - 1``, Narayanan et al., SC21), equal to what ``simulate`` of torch's
table holds there."""

LAST_CHUNK_IN_FLIGHT: Mapping[str, Expr] = {
    "gpipe": m,
    "1f1b": Integer(1),
    "interleaved": Integer(1),
}
"""Microbatches whose saved activations the model's last chunk (final norm, head, loss) holds at once
(p >= 2): every one under GPipe; one under 1F1B and interleaved 1F1B, whose last chunk runs each
microbatch's backward right after its forward."""

MATMUL_FLOPS: Expr = 2 * Symbol("m") * Symbol("k") * Symbol("n")
"""FLOPs of an (m x k) @ (k x n) matmul: one multiply and one add per output element per k."""


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------

_BANDWIDTHS = (B, B_net)
_LATENCIES = (alpha, alpha_net, alpha_0)


@dataclass(frozen=True)
class RenderedCollective:
    """A collective's closed form as shown to users."""

    algorithm: str  # the fastest of its layout's algorithms, e.g. "ring", "tree"
    layout: str  # ONE_NODE, ONE_PER_NODE or HIERARCHICAL
    formula: str  # e.g. "2(p-1)/p · 2·b·s·h bytes / 370 GB/s + 2(p-1) · 0.6 us + 6.6 us"
    topology: dict[str, int]  # values of the group symbols the formula uses (p, q, N)


def render_collective(kind: str, group: GroupTopology, tensor_text: str, nbytes: float) -> RenderedCollective:
    """Collective ``kind`` of ``nbytes`` on ``group`` in closed form: the fastest algorithm's formula
    written with ``tensor_text`` for n (see ``tensor_bytes_text``) and the group's bandwidths and
    latencies as numbers, the group's sizes as symbols."""
    layout = layout_of(group)
    values = dict(zip(TIME_ARGUMENTS, time_arguments(group, nbytes)))
    algorithms = ALGORITHMS[kind][layout]
    name = min(algorithms, key=lambda a: float(algorithms[a].subs(values)))
    expr = algorithms[name]
    units = {s: _bandwidth_text(values[s]) for s in _BANDWIDTHS} | {s: _latency_text(values[s]) for s in _LATENCIES}
    topology = {str(s): int(values[s]) for s in (p, q, N) if s in expr.free_symbols}
    return RenderedCollective(name, layout, _render_sum(expr, tensor_text, units), topology)


def tensor_bytes_text(shape: Sequence[int], element_bytes: int, named_dims: Mapping[str, int],
                      divisors: Mapping[str, int] | None = None) -> tuple[str, dict[str, int]]:
    """(``4·b·s·h/tp``, ``{"b": 8, "s": 32, "h": 64, "tp": 2}``): the bytes of a tensor of ``shape``
    as a product, each dim named by the first entry of ``named_dims`` of its size (else written as
    the size; unnamed dims of size 1 are left out), over the degrees of the mesh dims it is split on.
    A name may be a product of names (``b·s`` for a flattened batch and sequence): its parts are
    what the values list."""
    values: dict[str, int] = {}
    factors = [str(element_bytes)] if element_bytes != 1 else []
    for size in shape:
        name = next((k for k, size_of in named_dims.items() if size_of == size), None)
        if name is not None:
            factors.append(name)
            values.update({part: named_dims.get(part, size) for part in name.split("·")})
        elif size != 1:
            factors.append(str(size))
    text = "·".join(factors) or "1"
    if divisors:
        values.update(divisors)
        over = "·".join(divisors)
        text += f"/{over}" if len(divisors) == 1 else f"/({over})"
    return text, values


def _render_sum(expr: Expr, tensor_text: str, units: Mapping[Symbol, str]) -> str:
    terms = sorted(sympy.Add.make_args(expr), key=_term_order)
    return " + ".join(_render_term(t, tensor_text, units) for t in terms)


def _term_order(term: Expr) -> int:
    """Bandwidth terms first, then per-step latencies, the per-collective latency last."""
    if term.has(*_BANDWIDTHS):
        return 0
    return 2 if term == alpha_0 else 1


def _render_term(term: Expr, tensor_text: str, units: Mapping[Symbol, str]) -> str:
    if isinstance(term, (Max, Min)):
        name = "max" if isinstance(term, Max) else "min"
        return f"{name}(" + ", ".join(_render_sum(a, tensor_text, units) for a in term.args) + ")"
    bandwidth = next((s for s in _BANDWIDTHS if term.has(s)), None)
    if bandwidth is not None:
        return _coefficient(term * bandwidth / n, f"{tensor_text} bytes") + f" / {units[bandwidth]}"
    latency = next(s for s in _LATENCIES if term.has(s))
    return _coefficient(term / latency, units[latency])


def _coefficient(expr: Expr, unit: str) -> str:
    """``coef · unit`` with the coefficient in p, q, N written compactly (``2(p-1)/p · 0.6 us``);
    the unit alone when the coefficient is 1."""
    expr = sympy.factor(expr)
    if expr == 1:
        return unit
    text = formula_text(expr)
    return f"({text}) · {unit}" if expr.is_Add else f"{text} · {unit}"


def formula_text(expr: Expr) -> str:
    """Compact text of a formula: ``2*(p - 1)/p`` prints as ``2(p-1)/p``, products with ``·``."""
    text = sympy.sstr(expr)
    text = re.sub(r"-(\w+) \+ (\w+)", r"\2 - \1", text)  # sympy sorts N before p: -N + p -> p - N
    text = re.sub(r"(\w)\*\(", r"\1(", text)
    text = re.sub(r"(\w+) - (\w+)", r"\1-\2", text)
    return text.replace("**", "^").replace("*", "·").replace("alpha_0", "α0").replace("alpha", "α")


def _bandwidth_text(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.4g} GB/s"


def _latency_text(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us"
