"""The ``explanations`` and ``ops[name]["collectives"]`` sections of a plan: why it chose what it chose.

For one decision (an op, or a parameter's placement, shared by every repeated layer), each option it
could have taken is priced with everything else held at the solution: its own compute, communication
and memory, the resharding on every edge that touches it, and the change in exposed gradient sync.
The difference to the chosen option is what switching would cost, which is the reason it lost.
This is exact for a change of one decision; the solver weighed all of them at once.

``collective_terms`` records the collectives the chosen strategy of an op implies, with what their
closed forms need (``cost_models/symbolic.py``). Plan assembly (``planning/assemble.py``) writes
both sections; ``autopar.inspect.explain`` renders them.
"""

from __future__ import annotations

import weakref
from collections import ChainMap
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from torch import fx

from autopar.core.placement import Placements, placement_to_str
from autopar.ir.capture import WEIGHT_KINDS, CapturedGraph
from autopar.ir.layers import reader_regions, tensor_inputs
from autopar.planning.pricing import (AMAX_BYTES, Collective, Cost, Pricer, OverlapSlack, gathers, moved,
                                      moved_again, weight_amax)
from autopar.planning.problem import (Edge, Problem, RootSharding, SharedResharding, edge_pair, gradient_root,
                                      partial_gradient_share, read_through_views, source_of)
from autopar.planning.solver import overlap_slack
from autopar.planning.strategies import Strategy

TOP_K = 8


class _Solution:
    """What the alternatives of every decision read of one settled solution, worked out once for all of
    them: the exposed gradient sync of the whole solution, and which edges and shared moves touch each
    decision (asking every decision for every edge made a graph's explanations quadratic in its ops:
    1,524 decisions took 9 s)."""

    def __init__(self, problem: Problem, choice: Mapping[str, int]):
        self.problem = problem
        self.choice = choice
        self.slack = overlap_slack(problem, choice)
        self.edges_of: dict[str, list[Edge]] = {}
        for edge in problem.edges:
            for key in dict.fromkeys((edge.src, edge.dst)):
                self.edges_of.setdefault(key, []).append(edge)
        self.shared_of: dict[str, list[SharedResharding]] = {}
        for g in problem.shared:
            for key in dict.fromkeys(k for e in g.edges for k in (problem.edges[e].src, problem.edges[e].dst)):
                self.shared_of.setdefault(key, []).append(g)


def decision_alternatives(solution: _Solution, key: str, root_terms: Sequence[RootSharding] = (),
                          top: int = TOP_K) -> list[dict]:
    """Options of ``key`` with ``delta_s`` (step-time change if taken alone), best first. ``solution``'s
    problem is settled at its choice (``Problem.settled``); ``root_terms``: the problem's terms whose root
    is ``key``."""
    problem, choice = solution.problem, solution.choice
    decision = problem.decisions[key]
    chosen = choice[key]
    rows = []
    for k, option in enumerate(decision.options):
        trial = ChainMap({key: k}, choice)
        delta = decision.count * (option.cost.exposed_s - decision.options[chosen].cost.exposed_s)
        edges, edge_sync = _edge_delta(solution, trial, key)
        exposed, sync = _root_change(problem, root_terms, choice, trial)
        delta += edges + exposed + _sync_delta(problem, decision, chosen, k, solution.slack, sync.plus(edge_sync))
        rows.append({
            "strategy": option.strategy.describe(),
            "chosen": k == chosen,
            "delta_s": delta,
            "delta_memory_bytes": decision.count * (option.cost.memory_bytes - decision.options[chosen].cost.memory_bytes),
            "compute_s": option.cost.compute_s,
            "comm_s": dict(option.cost.comm_s),
        })
    rows.sort(key=lambda r: (not r["chosen"], r["delta_s"]))
    return rows[:top]


def _edge_delta(solution: _Solution, after: Mapping[str, int], key: str) -> tuple[float, OverlapSlack]:
    """(exposed seconds, gradient sync slack) the edges touching ``key`` change by from the solution to
    ``after``."""
    problem, before = solution.problem, solution.choice
    delta, sync = 0.0, OverlapSlack()
    for edge in solution.edges_of.get(key, ()):
        now, then = _edge_cost(problem, edge, after), _edge_cost(problem, edge, before)
        delta += edge.count * (now.exposed_s - then.exposed_s)
        sync = sync.plus(_slack(problem, now, edge.count)).plus(_slack(problem, then, edge.count), -1.0)
    for g in solution.shared_of.get(key, ()):  # moves several edges share (``problem.SharedResharding``)
        count, now, then = g.count(problem.edges), g.taken(problem, after), g.taken(problem, before)
        delta += count * (sum(c.exposed_s for c in now) - sum(c.exposed_s for c in then))
        for c in now:
            sync = sync.plus(_slack(problem, c, count))
        for c in then:
            sync = sync.plus(_slack(problem, c, count), -1.0)
    return delta, sync


def _edge_cost(problem: Problem, edge: Edge, choice: Mapping[str, int]) -> Cost:
    return edge.price[edge_pair(problem, edge, choice)]


def _root_change(problem: Problem, root_terms: Sequence[RootSharding], before: Mapping[str, int],
                 after: Mapping[str, int]) -> tuple[float, OverlapSlack]:
    """(critical-path seconds, gradient sync slack) by which the ops whose gradient reduction depends
    on a parameter's placement (``root_terms``, ``problem.RootSharding``) change when that placement
    alone changes (the settled problem already prices the consumers' own alternatives)."""
    exposed, sync = 0.0, OverlapSlack()
    for t in root_terms:
        if t.holds(after) != t.holds(before):
            weight = (1.0 if t.holds(after) else -1.0) * problem.decisions[t.consumer].count * t.share
            exposed += weight * t.delta.exposed_s
            sync = sync.plus(_slack(problem, t.delta, weight))
    return exposed, sync


def _slack(problem: Problem, cost: Cost, occurrences: float) -> OverlapSlack:
    return OverlapSlack.of(cost, problem.overlap_fraction, problem.microbatches, occurrences)


def _sync_delta(problem: Problem, decision, chosen: int, k: int, now: OverlapSlack, elsewhere: OverlapSlack) -> float:
    """Change in exposed gradient sync when ``decision`` takes option ``k`` (and the slack of other
    decisions changes by ``elsewhere``), from the solution's slack ``now``."""
    option = lambda i: _slack(problem, decision.options[i].cost, decision.count)  # noqa: E731
    after = now.plus(option(k)).plus(option(chosen), -1.0).plus(elsewhere)
    m, slowdown = problem.microbatches, problem.overlap_slowdown
    return after.exposed_s(m, slowdown) - now.exposed_s(m, slowdown)


def explanations(problem: Problem, choice: Mapping[str, int], index: Mapping[str, str]) -> dict[str, Any]:
    """The ``explanations`` section of a plan: alternatives per decision and a name -> decision index
    (``problem`` as solved, its ``root_terms`` not yet settled)."""
    by_root: dict[str, list[RootSharding]] = {}
    for t in problem.root_terms:
        by_root.setdefault(t.root, []).append(t)
    settled = problem.settled(choice)
    solution = _Solution(settled, choice)
    return {
        "decisions": {key: {"nodes": d.nodes, "occurrences": d.occurrences,
                            "alternatives": decision_alternatives(solution, key, by_root.get(key, ()))}
                      for key, d in settled.decisions.items() if len(d.options) > 1},
        "index": dict(index),
    }


def collective_terms(node: fx.Node, captured: CapturedGraph, strategy_of: Callable[[str], Strategy],
                     pricer: Pricer) -> list[dict[str, Any]]:
    """The collectives ``node``'s chosen strategy implies, one JSON-able entry each, with what the
    closed form needs (tensor, shape, bytes, mesh dim, group layout) and the seconds pricing charges.

    ``strategy_of``: node name -> its chosen Strategy (placeholders included). The collectives are
    the ones pricing charges (``Pricer.edge_collectives`` for resharding each input from its
    producer's placement, ``Pricer.gradient_collectives`` for partial input gradients,
    ``Pricer.ring_collectives`` for ring attention's exchanges). A move the
    readers of a value in one region share (one redistribute at run time,
    ``passes/insert_redistributes.py``) is recorded with each of the ``k`` readers at ``share`` 1/k.
    """
    strategy = strategy_of(node.name)
    terms = []
    args = tensor_inputs(node)
    kinds = captured.gradient_kinds()
    grad_kinds = [kinds[a.name] for a in args]
    views = read_through_views(node, grad_kinds)
    partial = pricer.grad_partial_dims(node, strategy, grad_kinds, views)
    roots = [_root_placement(a, strategy_of) if kind in WEIGHT_KINDS or shared is not None else None
             for a, kind, shared in zip(args, grad_kinds, views)]
    for arg, wanted, grad_partial in zip(args, strategy.inputs, partial):
        src, out = source_of(arg)
        have = strategy_of(src.name).outputs[out]
        if have is None or (have == wanted and not grad_partial):
            continue
        weight = kinds[src.name] in WEIGHT_KINDS  # a parameter or a view of one
        readers = _readers_of_move(arg, node, wanted, captured.graph, strategy_of)
        # a parameter is gathered again for each reader that keeps it; an activation's move, once for all the
        # readers of its one redistribute where one of them keeps it (``problem._shared_prices``)
        kept = (captured.keeps_what_it_reads(node, arg, pricer.float8) if weight else
                _readers_of_move(arg, node, wanted, captured.graph, strategy_of, captured.keeps_what_it_reads,
                                 pricer.float8) > 0)
        regathered = moved_again(kept, weight, have, wanted, pricer.mesh_shape)
        for i, c in enumerate(pricer.edge_collectives(arg.meta["val"], have, wanted, grad_partial, regathered,
                                                      partial_gradient_share(arg), gradient=kinds[src.name] != "none")):
            # edge_collectives lists the partial gradient's reductions first, one per dim
            resharded = i >= len(grad_partial) and not c.regather
            why = ("partial gradient" if i < len(grad_partial) else
                   f"resharding {placement_to_str(have[c.mesh_dim])} -> {placement_to_str(wanted[c.mesh_dim])}"
                   + (" again in backward" if c.regather else ""))
            shared_by = readers if resharded or c.regather and not weight else 1
            terms.append(_term(replace(c, share=c.share / shared_by) if shared_by > 1 else c, why, arg, captured,
                               pricer, per_microbatch=weight, prefetched=pricer.prefetched(c, weight)))
    for c in pricer.gradient_collectives(node, strategy, grad_kinds, roots, views):
        gathered = roots[c.slot] is not None and gathers(roots[c.slot], strategy.inputs[c.slot])
        why = "partial gradient, reduced by the gather's backward" if gathered else "partial gradient"
        terms.append(_term(c, why, args[c.slot], captured, pricer, per_microbatch=c.per_microbatch))
    for c in pricer.ring_collectives(node, strategy):  # keys and values sent in one buffer: twice the keys' bytes
        term = _term(c, "ring attention: a block of keys and values in one buffer, 2 elements per key element "
                        "(backward: and of their gradients), passed to the next cp rank", args[1], captured, pricer)
        terms.append({**term, "element_bytes": 2 * term["element_bytes"]})
    weight = next((i for i, kind in enumerate(grad_kinds) if kind in WEIGHT_KINDS), None)
    for c in pricer.amax_collectives(node, strategy):  # one fp32 number: the amax of a split operand or gradient
        of = args[c.slot] if c.phase == "forward" else node
        # a weight read as stored is cast once a step (``passes/float8.StepCasts``), its amax with it
        once = weight_amax(c, weight) and not (roots[weight] is not None
                                               and moved(roots[weight], strategy.inputs[weight]))
        why = ("float8 amax" + (" of the gradient" if c.phase == "backward" else "") + ", split on this dim"
               + (", once a step" if once else ""))
        terms.append({**_term(c, why, of, captured, pricer), "shape": [], "element_bytes": AMAX_BYTES,
                      **({"once_a_step": True} if once else {})})
    return terms


def _readers_of_move(arg: fx.Node, node: fx.Node, wanted: Placements, graph: fx.Graph,
                     strategy_of: Callable[[str], Strategy],
                     keeps: Callable[[fx.Node, fx.Node, frozenset[str]], bool] | None = None,
                     float8: frozenset[str] = frozenset()) -> int:
    """How many inputs of ops in ``node``'s region read ``arg`` at ``wanted``: the readers of its one
    redistribute there; with ``keeps`` (``CapturedGraph.keeps_what_it_reads``), those of them that keep it."""
    regions = _regions(graph)
    return sum(1 for user in arg.users if regions.get(user) == regions[node]
               for a, q in zip(tensor_inputs(user), strategy_of(user.name).inputs)
               if a is arg and q == wanted and (keeps is None or keeps(user, arg, float8)))


_REGIONS: "weakref.WeakKeyDictionary[fx.Graph, dict[fx.Node, str]]" = weakref.WeakKeyDictionary()


def _regions(graph: fx.Graph) -> dict[fx.Node, str]:
    """``reader_regions`` of ``graph``, once per graph (asked for every input of every op)."""
    if graph not in _REGIONS:
        _REGIONS[graph] = reader_regions(graph)
    return _REGIONS[graph]


def _root_placement(arg: fx.Node, strategy_of: Callable[[str], Strategy]) -> Placements | None:
    producer, out = gradient_root(arg)
    return strategy_of(producer.name).outputs[out]


def _term(c: Collective, why: str, arg: fx.Node, captured: CapturedGraph, pricer: Pricer,
          per_microbatch: bool = False, prefetched: bool = False) -> dict[str, Any]:
    """One collective as the plan records it; ``prefetched``: a gather the lowered runtime issues ahead of
    its use (``Pricer.prefetched``), priced beside compute, not on the critical path."""
    val, group = arg.meta["val"], pricer.groups[c.mesh_dim]
    seconds = pricer.collective_seconds(c)
    return {"kind": c.kind, "phase": c.phase, "why": why,
            "tensor": captured.params.get(source_of(arg)[0].name, arg.name),
            "shape": list(val.shape), "element_bytes": pricer.element_bytes(val), "mesh_dim": c.mesh_dim,
            "sharded_on": [d for d, p in enumerate(c.placements) if p.is_shard()],
            "group": [group.size, group.per_node, group.nodes], "nbytes": c.nbytes, "seconds": seconds,
            "grad_sync": c.grad_sync, "per_microbatch": per_microbatch, "share": c.share,
            **({"prefetched": True} if prefetched else {})}
