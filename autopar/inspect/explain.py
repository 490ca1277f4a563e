"""``autopar explain``: the alternatives of a decision and its collectives in closed form, as text.

Reads only the plan's data: the ``explanations`` section and each op's optional ``collectives``,
both written when the plan was assembled (``planning/explanations.py``); plans without the latter
show no formulas.
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any, Mapping

from autopar.cost_models import GroupTopology, collective_time
from autopar.cost_models.symbolic import render_collective, tensor_bytes_text
from autopar.core.errors import UnknownNameError
from autopar.core.units import fmt_bytes
from autopar.inspect.show import fmt_seconds, routing_lines

def render(plan_data: Mapping[str, Any], name: str) -> str:
    """Text for ``autopar explain``: the alternatives of the decision behind ``name``."""
    section = plan_data.get("explanations") or {}
    key = section.get("index", {}).get(name)
    if key is None:
        close = sorted(k for k in section.get("index", {}) if name in k)[:8]
        hint = f"; names containing it: {', '.join(close)}" if close else ""
        raise UnknownNameError(f"{name!r} is not an op or parameter of this plan{hint}")
    entry = section.get("decisions", {}).get(key)  # optional in a plan file, like the index
    if entry is None:
        return "\n".join([f"{name}: decision {key!r} had a single option (nothing to choose)",
                          *collective_lines(plan_data, name), *_routing_lines(plan_data, name)])
    lines = [f"{name}  (decision {key}, shared by {entry.get('occurrences', len(entry['nodes'])):g} place(s) in the model)",
             f"  {'strategy':<48} {'step change':>12} {'memory change':>14}  {'own compute':>11}  own comm"]
    for row in entry["alternatives"]:
        mark = "*" if row["chosen"] else " "
        delta = "chosen" if row["chosen"] else ("+" if row["delta_s"] >= 0 else "-") + fmt_seconds(abs(row["delta_s"]))
        mem = ("+" if row["delta_memory_bytes"] >= 0 else "-") + fmt_bytes(abs(row["delta_memory_bytes"]))
        comm = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in row.get("comm_s", {}).items()) or "-"
        own = fmt_seconds(row["compute_s"]) if "compute_s" in row else "-"  # both optional in a plan file
        lines.append(f"{mark} {row['strategy']:<48} {delta:>12} {mem:>14}  {own:>11}  {comm}")
    others = [r for r in entry["alternatives"] if not r["chosen"]]
    if others:
        best = min(others, key=lambda r: r["delta_s"])
        lines.append(f"  next best costs {fmt_seconds(best['delta_s'])} more per step" if best["delta_s"] >= 0 else
                     f"  an alternative is {fmt_seconds(-best['delta_s'])} faster alone but breaks memory or a "
                     "constraint elsewhere")
    return "\n".join(lines + collective_lines(plan_data, name) + _routing_lines(plan_data, name))


def _routing_lines(plan_data: Mapping[str, Any], name: str) -> list[str]:
    """The routing and its assumption when ``name`` (a parameter, or an op by its module) lies in a
    mixture-of-experts layer of the plan (``model.moe.modules``)."""
    moe = plan_data.get("model", {}).get("moe")
    op = plan_data.get("ops", {}).get(name)
    path = op.get("module", "") if op else name
    inside = any(fnmatch(path, pattern) or fnmatch(path, pattern + ".*") for pattern in (moe or {}).get("modules", []))
    if not inside:
        return []
    return ["", *routing_lines(moe)]


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
    if term["kind"] == "send_recv":  # ring attention's exchange (planning/pricing.py, ring_exposed_s)
        lines.append("      runs behind one block's attention: the op's p2p charge is the part its compute does "
                     "not hide")
    elif term.get("prefetched") and not term["per_microbatch"]:  # an activation's regather
        lines.append("      launched by the lowered runtime before the matmul ahead of its readers "
                     "(passes/lower_buckets.py): hidden behind backward's compute, in the gradient sync")
    elif term.get("prefetched"):
        lines.append("      issued a unit ahead by the lowered runtime (passes/lower_buckets.py): hidden behind "
                     + ("backward's compute, in the gradient sync" if term["phase"] == "backward" else
                        "forward's compute"))
    elif term["grad_sync"] and term["kind"] == "all_reduce":
        lines.append(f"      bucketed with other gradients: charged its bandwidth term, {fmt_seconds(term['seconds'])}, "
                     "overlapped with backward")
    elif term["grad_sync"] and plan_data["predicted"].get("runtime") == "lowered" and term["kind"] == "reduce_scatter":
        lines.append("      gradient sync, overlapped with backward: ZeRO's (passes/zero.py), or FSDP's as the lowered "
                     "runtime runs it (passes/lower_buckets.py)")
    elif term["grad_sync"]:
        lines.append("      ZeRO gradient sync (passes/zero.py), overlapped with backward")
    elif term.get("share", 1.0) < 1:  # pricing: one collective for all the readers (a move, or a reduction)
        readers = round(1 / term["share"])
        one = (f"one move for the {readers} inputs that read it so (one redistribute they share)"
               if term["why"].startswith("resharding") else
               f"one reduction for the {readers} ops that leave this gradient partial (summed first)")
        lines.append(f"      {one}: "
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
