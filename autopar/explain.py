"""Why a plan chose what it chose: the alternatives of each decision, priced against the solution.

For one decision (an op, or a parameter's placement, shared by every repeated layer), each option it
could have taken is priced with everything else held at the solution: its own compute, communication
and memory, the resharding on every edge that touches it, and the change in exposed gradient sync.
The difference to the chosen option is what switching would cost, which is the reason it lost.
This is exact for a change of one decision; the solver weighed all of them at once.

It also shows the collectives the chosen strategy implies in closed form (``cost_models/symbolic.py``),
with the tensor's size written in the model's dims: ``collective_terms`` is what the planner records
per op for that (the plan's optional ``ops[name]["collectives"]``); plans without it show no formulas.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from torch import fx

from .capture import CapturedGraph
from .cost_models import GroupTopology, collective_time
from .cost_models.symbolic import render_collective, tensor_bytes_text
from .pricing import Collective, Pricer, gathers
from .problem import (Problem, RootSharding, gradient_root, partial_gradient_share, read_through_views,
                      source_of)
from .report import fmt_bytes, fmt_seconds
from .strategies import Placements, Strategy, tensor_inputs

TOP_K = 8


def decision_alternatives(problem: Problem, choice: Mapping[str, int], key: str,
                          root_terms: Sequence[RootSharding] = (), top: int = TOP_K) -> list[dict]:
    """Options of ``key`` with ``delta_s`` (step-time change if taken alone), best first. ``problem`` is
    settled at ``choice`` (``Problem.settled``); ``root_terms``: the problem's terms whose root is ``key``."""
    decision = problem.decisions[key]
    z_now = _exposed_sync(problem, choice)
    chosen = choice[key]
    rows = []
    for k, option in enumerate(decision.options):
        trial = dict(choice)
        trial[key] = k
        delta = decision.count * (option.cost.exposed_s - decision.options[chosen].cost.exposed_s)
        delta += _edge_delta(problem, choice, trial, key)
        exposed, sync = _root_change(problem, root_terms, choice, trial)
        delta += exposed + _sync_delta(problem, decision, chosen, k, z_now, sync)
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


def _edge_delta(problem: Problem, before: Mapping[str, int], after: Mapping[str, int], key: str) -> float:
    delta = 0.0
    for edge in problem.edges:
        if key not in (edge.src, edge.dst):
            continue
        delta += edge.count * (_edge_price(problem, edge, after) - _edge_price(problem, edge, before))
    return delta


def _edge_price(problem: Problem, edge, choice: Mapping[str, int]) -> float:
    p = problem.decisions[edge.src].options[choice[edge.src]].strategy.outputs[edge.src_out]
    q = problem.decisions[edge.dst].options[choice[edge.dst]].edge_key(edge.slot)
    return edge.price[(p, q)].exposed_s


def _root_change(problem: Problem, root_terms: Sequence[RootSharding], before: Mapping[str, int],
                 after: Mapping[str, int]) -> tuple[float, float]:
    """(critical-path seconds, gradient sync seconds) by which the ops whose gradient reduction depends
    on a parameter's placement (``root_terms``, ``problem.RootSharding``) change when that placement
    alone changes (the settled problem already prices the consumers' own alternatives)."""
    exposed = sync = 0.0
    for t in root_terms:
        if t.holds(after) != t.holds(before):
            weight = (1.0 if t.holds(after) else -1.0) * problem.decisions[t.consumer].count * t.share
            exposed += weight * t.delta.exposed_s
            sync += weight * t.delta.grad_sync_s
    return exposed, sync


def _exposed_sync(problem: Problem, choice: Mapping[str, int]) -> float:
    """sync - beta * backward over the solution (negative: gradient sync fully hidden)."""
    total = 0.0
    for key, d in problem.decisions.items():
        c = d.options[choice[key]].cost
        total += d.count * (c.grad_sync_s - problem.overlap_fraction * c.backward_compute_s)
    return total


def _sync_delta(problem: Problem, decision, chosen: int, k: int, z_now: float, elsewhere: float = 0.0) -> float:
    """Change in exposed gradient sync when ``decision`` takes option ``k`` (and the sync of other
    decisions changes by ``elsewhere`` seconds)."""
    def term(i: int) -> float:
        c = decision.options[i].cost
        return decision.count * (c.grad_sync_s - problem.overlap_fraction * c.backward_compute_s)

    return max(0.0, z_now + term(k) - term(chosen) + elsewhere) - max(0.0, z_now)


def explanations(problem: Problem, choice: Mapping[str, int], index: Mapping[str, str]) -> dict[str, Any]:
    """The ``explanations`` section of a plan: alternatives per decision and a name -> decision index
    (``problem`` as solved, its ``root_terms`` not yet settled)."""
    by_root: dict[str, list[RootSharding]] = {}
    for t in problem.root_terms:
        by_root.setdefault(t.root, []).append(t)
    settled = problem.settled(choice)
    return {
        "decisions": {key: {"nodes": d.nodes,
                            "alternatives": decision_alternatives(settled, choice, key, by_root.get(key, ()))}
                      for key, d in settled.decisions.items() if len(d.options) > 1},
        "index": dict(index),
    }


def render(plan_data: Mapping[str, Any], name: str) -> str:
    """Text for ``autopar explain``: the alternatives of the decision behind ``name``."""
    section = plan_data.get("explanations") or {}
    key = section.get("index", {}).get(name)
    if key is None:
        close = sorted(k for k in section.get("index", {}) if name in k)[:8]
        hint = f"; names containing it: {', '.join(close)}" if close else ""
        raise KeyError(f"{name!r} is not an op or parameter of this plan{hint}")
    entry = section["decisions"].get(key)
    if entry is None:
        return "\n".join([f"{name}: decision {key!r} had a single option (nothing to choose)",
                          *collective_lines(plan_data, name)])
    lines = [f"{name}  (decision {key}, shared by {len(entry['nodes'])} node(s))",
             f"  {'strategy':<48} {'step change':>12} {'memory change':>14}  {'own compute':>11}  own comm"]
    for row in entry["alternatives"]:
        mark = "*" if row["chosen"] else " "
        delta = "chosen" if row["chosen"] else ("+" if row["delta_s"] >= 0 else "-") + fmt_seconds(abs(row["delta_s"]))
        mem = ("+" if row["delta_memory_bytes"] >= 0 else "-") + fmt_bytes(abs(row["delta_memory_bytes"]))
        comm = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in row["comm_s"].items()) or "-"
        lines.append(f"{mark} {row['strategy']:<48} {delta:>12} {mem:>14}  {fmt_seconds(row['compute_s']):>11}  {comm}")
    others = [r for r in entry["alternatives"] if not r["chosen"]]
    if others:
        best = min(others, key=lambda r: r["delta_s"])
        lines.append(f"  next best costs {fmt_seconds(best['delta_s'])} more per step" if best["delta_s"] >= 0 else
                     f"  an alternative is {fmt_seconds(-best['delta_s'])} faster alone but breaks memory or a "
                     "constraint elsewhere")
    return "\n".join(lines + collective_lines(plan_data, name))


# ---- collectives in closed form ------------------------------------------------------------------

def collective_terms(node: fx.Node, captured: CapturedGraph, strategy_of: Callable[[str], Strategy],
                     pricer: Pricer) -> list[dict[str, Any]]:
    """The collectives ``node``'s chosen strategy implies, one JSON-able entry each, with what the
    closed form needs (tensor, shape, bytes, mesh dim, group layout) and the seconds pricing charges.

    ``strategy_of``: node name -> its chosen Strategy (placeholders included). The collectives are
    the ones pricing charges (``Pricer.edge_collectives`` for resharding each input from its
    producer's placement, ``Pricer.gradient_collectives`` for partial input gradients).
    """
    strategy = strategy_of(node.name)
    terms = []
    args = tensor_inputs(node)
    kinds = captured.gradient_kinds()
    grad_kinds = [kinds[a.name] for a in args]
    views = read_through_views(node, grad_kinds)
    partial = pricer.grad_partial_dims(node, strategy, grad_kinds, views)
    roots = [_root_placement(a, strategy_of) if kind == "param" or shared is not None else None
             for a, kind, shared in zip(args, grad_kinds, views)]
    for arg, wanted, grad_partial in zip(args, strategy.inputs, partial):
        src, out = source_of(arg)
        have = strategy_of(src.name).outputs[out]
        if have is None or (have == wanted and not grad_partial):
            continue
        regathered = captured.keeps_parameter(node, arg)
        for i, c in enumerate(pricer.edge_collectives(arg.meta["val"], have, wanted, grad_partial, regathered,
                                                      partial_gradient_share(arg))):
            # edge_collectives lists the partial gradient's reductions first, one per dim
            why = ("partial gradient" if i < len(grad_partial) else
                   f"resharding {have[c.mesh_dim]} -> {wanted[c.mesh_dim]}" + (" again in backward" if c.regather else ""))
            weight = kinds[src.name] == "param"  # a parameter or a view of one
            terms.append(_term(c, why, arg, captured, pricer, per_microbatch=weight))
    for c in pricer.gradient_collectives(node, strategy, grad_kinds, roots, views):
        gathered = roots[c.slot] is not None and gathers(roots[c.slot], strategy.inputs[c.slot])
        why = "partial gradient, reduced by the gather's backward" if gathered else "partial gradient"
        terms.append(_term(c, why, args[c.slot], captured, pricer, per_microbatch=c.per_microbatch))
    return terms


def _root_placement(arg: fx.Node, strategy_of: Callable[[str], Strategy]) -> Placements | None:
    producer, out = gradient_root(arg)
    return strategy_of(producer.name).outputs[out]


def _term(c: Collective, why: str, arg: fx.Node, captured: CapturedGraph, pricer: Pricer,
          per_microbatch: bool = False) -> dict[str, Any]:
    val, group = arg.meta["val"], pricer.groups[c.mesh_dim]
    seconds = pricer.collective_seconds(c)
    return {"kind": c.kind, "phase": c.phase, "why": why,
            "tensor": captured.params.get(source_of(arg)[0].name, arg.name),
            "shape": list(val.shape), "element_bytes": pricer.element_bytes(val), "mesh_dim": c.mesh_dim,
            "sharded_on": [d for d, p in enumerate(c.placements) if p.startswith("S(")],
            "group": [group.size, group.per_node, group.nodes], "nbytes": c.nbytes, "seconds": seconds,
            "grad_sync": c.grad_sync, "per_microbatch": per_microbatch, "share": c.share}


def collective_lines(plan_data: Mapping[str, Any], name: str) -> list[str]:
    """Lines showing each collective of op or parameter ``name`` in closed form with its numbers;
    none for plans that did not record collectives."""
    ops = plan_data.get("ops", {})
    if not any("collectives" in op for op in ops.values()):
        return []
    terms = ops[name].get("collectives", []) if name in ops else \
        [t for op in ops.values() for t in op.get("collectives", []) if t["tensor"] == name]
    if not terms:
        return ["", "collectives: none"]
    lines = ["", "collectives, in closed form (p ranks in the group, q of them per node, N nodes; "
                 "cost_models/symbolic.py)"]
    for term in terms:
        lines += _collective_text(plan_data, term)
    return lines


def _collective_text(plan_data: Mapping[str, Any], term: Mapping[str, Any]) -> list[str]:
    dim_names = plan_data["mesh"]["dim_names"]
    group = _group(plan_data["cluster"], term["group"])
    text, values = tensor_bytes_text(term["shape"], term["element_bytes"], named_dims(plan_data),
                                     {dim_names[d]: plan_data["mesh"]["shape"][d] for d in term["sharded_on"]})
    shown = render_collective(term["kind"], group, text, term["nbytes"])
    seconds = collective_time(term["kind"], term["nbytes"], group)
    given = ", ".join(f"{k}={v}" for k, v in {**values, **shown.topology}.items())
    lines = [f"  {term['phase']} {term['kind']} over {dim_names[term['mesh_dim']]} ({term['why']} of "
             f"{term['tensor']}): {shown.algorithm}, {shown.layout}",
             f"      {shown.formula}" + (f"  with {given}" if given else "") + f" -> {fmt_seconds(seconds)}"]
    if term["grad_sync"] and term["kind"] == "all_reduce":
        lines.append(f"      bucketed with other gradients: charged its bandwidth term, {fmt_seconds(term['seconds'])}, "
                     "overlapped with backward")
    elif term["grad_sync"]:
        lines.append("      ZeRO gradient sync (passes/zero.py), overlapped with backward")
    elif term.get("share", 1.0) < 1:  # pricing: one reduction for all the readers that leave it partial
        readers = round(1 / term["share"])
        lines.append(f"      one reduction for the {readers} ops that leave this gradient partial (summed first): "
                     f"1/{readers} of {fmt_seconds(term['seconds'] / term['share'])} charged here, "
                     f"{fmt_seconds(term['seconds'])}")
    elif term["seconds"] > seconds:  # pricing.in_step_collective_time: the device's redistribute_s
        lines.append(f"      + {fmt_seconds(term['seconds'] - seconds)} per collective DTensor runs inside a step "
                     f"(the device's calibrated redistribute_s) = {fmt_seconds(term['seconds'])}")
    microbatches = plan_data.get("pipeline", {}).get("microbatches", 1)
    if term["per_microbatch"] and microbatches > 1:
        lines.append(f"      once per microbatch: x{microbatches} = {fmt_seconds(microbatches * term['seconds'])}")
    return lines


def _group(cluster: Mapping[str, Any], layout: list[int]) -> GroupTopology:
    size, per_node, nodes = layout
    device = cluster["device_spec"]
    return GroupTopology(size=size, per_node=per_node, nodes=nodes, intra_bw=cluster["intra_bw"],
                         inter_bw=cluster["inter_bw"], intra_latency_s=device["intra_latency_s"],
                         inter_latency_s=device["inter_latency_s"], base_latency_s=device["base_latency_s"])


def named_dims(plan_data: Mapping[str, Any]) -> dict[str, int]:
    """Names for tensor dims, by priority: ``b`` (and ``s`` and the flattened ``b·s`` for token ids)
    from the first example input's shape, then the model's dims when the plan records them
    (``model["dims"]``). Where sizes coincide the first name wins."""
    dims: dict[str, int] = {}
    first = next(iter(plan_data.get("inputs", {}).values()), None)
    if first and first.get("shape"):
        dims["b"] = first["shape"][0]
        if len(first["shape"]) >= 2 and str(first.get("dtype", "")).startswith("int"):
            dims["s"] = first["shape"][1]
            dims["b·s"] = dims["b"] * dims["s"]
    for key, size in plan_data.get("model", {}).get("dims", {}).items():
        dims.setdefault(key, size)
    return dims


def model_dims(config: Any) -> dict[str, int]:
    """Named sizes of a model config (``h``, ``heads``, ``head_dim``, ``kv_heads``, ``ffn``, ``vocab``)
    for ``Plan.model["dims"]``; attributes a config lacks are left out."""
    hidden, heads = getattr(config, "hidden", None), getattr(config, "heads", None)
    ffn = getattr(config, "ffn_hidden", None) or (
        hidden * config.mlp_ratio if hidden and getattr(config, "mlp_ratio", None) else None)
    dims = {"h": hidden, "ffn": ffn, "vocab": getattr(config, "vocab", None), "heads": heads,
            "kv_heads": getattr(config, "kv_heads", None),
            "head_dim": hidden // heads if hidden and heads else None}
    return {k: int(v) for k, v in dims.items() if isinstance(v, int) and not isinstance(v, bool)}
