"""Why a plan chose what it chose: the alternatives of each decision, priced against the solution.

For one decision (an op, or a parameter's placement, shared by every repeated layer), each option it
could have taken is priced with everything else held at the solution: its own compute, communication
and memory, the resharding on every edge that touches it, and the change in exposed gradient sync.
The difference to the chosen option is what switching would cost, which is the reason it lost.
This is exact for a change of one decision; the solver weighed all of them at once.
"""

from __future__ import annotations

from typing import Any, Mapping

from .problem import Problem
from .report import fmt_bytes, fmt_seconds

TOP_K = 8


def decision_alternatives(problem: Problem, choice: Mapping[str, int], key: str, top: int = TOP_K) -> list[dict]:
    """Options of ``key`` with ``delta_s`` (step-time change if taken alone), best first."""
    decision = problem.decisions[key]
    z_now = _exposed_sync(problem, choice)
    chosen = choice[key]
    rows = []
    for k, option in enumerate(decision.options):
        trial = dict(choice)
        trial[key] = k
        delta = decision.count * (option.cost.exposed_s - decision.options[chosen].cost.exposed_s)
        delta += _edge_delta(problem, choice, trial, key)
        delta += _sync_delta(problem, decision, chosen, k, z_now)
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
    q = problem.decisions[edge.dst].options[choice[edge.dst]].strategy.inputs[edge.slot]
    return edge.price[(p, q)].exposed_s


def _exposed_sync(problem: Problem, choice: Mapping[str, int]) -> float:
    """sync - beta * backward over the solution (negative: gradient sync fully hidden)."""
    total = 0.0
    for key, d in problem.decisions.items():
        c = d.options[choice[key]].cost
        total += d.count * (c.grad_sync_s - problem.overlap_fraction * c.backward_compute_s)
    return total


def _sync_delta(problem: Problem, decision, chosen: int, k: int, z_now: float) -> float:
    def term(i: int) -> float:
        c = decision.options[i].cost
        return decision.count * (c.grad_sync_s - problem.overlap_fraction * c.backward_compute_s)

    return max(0.0, z_now + term(k) - term(chosen)) - max(0.0, z_now)


def explanations(problem: Problem, choice: Mapping[str, int], index: Mapping[str, str]) -> dict[str, Any]:
    """The ``explanations`` section of a plan: alternatives per decision and a name -> decision index."""
    return {
        "decisions": {key: {"nodes": d.nodes, "alternatives": decision_alternatives(problem, choice, key)}
                      for key, d in problem.decisions.items() if len(d.options) > 1},
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
        return f"{name}: decision {key!r} had a single option (nothing to choose)"
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
    return "\n".join(lines)
