"""Text views of plans: ``summarize`` (one plan) and ``compare_plans`` (several side by side).

Placements print in DTensor's short form (``S(0)``, ``R``, ``P``); parameters of repeated layers are
collapsed into one row (``blocks.*.mlp.fc_in.weight``) when every layer agrees. Nothing here changes a
plan or needs torch.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Mapping, Sequence

from autopar.core.errors import BadInputError
from autopar.inspect.collectives import KINDS, predicted_collectives
from autopar.core.plan import CHECKPOINTING, LOWERED, MIXED, RING, Plan
from autopar.core.units import fmt_bytes

_LAYER = re.compile(r"\.\d+\.")
_COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def collapsed_placements(placements: dict[str, list[str]]) -> list[tuple[str, str, int]]:
    """(name, placement text, how many parameters) with repeated layers folded into ``.*.``."""
    groups: dict[str, dict[str, int]] = {}
    for fqn, pls in placements.items():
        key = _LAYER.sub(".*.", fqn)
        text = "[" + ", ".join(pls) + "]"
        groups.setdefault(key, {}).setdefault(text, 0)
        groups[key][text] += 1
    rows = []
    for key, variants in groups.items():
        if len(variants) == 1:
            (text, n), = variants.items()
            rows.append((key, text, n))
        else:  # layers disagree: show each concrete parameter
            rows.extend((fqn, "[" + ", ".join(p) + "]", 1) for fqn, p in placements.items() if _LAYER.sub(".*.", fqn) == key)
    return rows


def _schedule_text(plan: Plan) -> str:
    """Pipeline stages, schedule and microbatching, and activation checkpointing, in one line."""
    pipe = plan.pipeline
    m, size = pipe.get("microbatches", 1), pipe.get("microbatch_size", "?")
    stages = plan.degrees.pp
    text = f"{m} microbatch{'es' if m > 1 else ''} of {size} per data-parallel rank"
    if stages > 1:
        chunks = pipe.get("virtual_stages", 1)
        text = (f"pp={stages} {pipe.get('schedule')}" + (f" (v={chunks})" if chunks > 1 else "")
                + f", layer ranges {pipe.get('stages')}{_leading_text(plan)}, " + text)
    return text + f"; checkpointing {checkpointing_text(plan)}"


def _leading_text(plan: Plan) -> str:
    """What the first range holds beside its share of the repeating layers, where the model's first layers do not
    repeat (``pipeline.leading_layers``)."""
    leading = plan.pipeline.get("leading_layers")
    if not leading:
        return ""
    return (f" (the first also holds the {leading} leading layer{'s, which do' if leading > 1 else ', which does'} not"
            f" repeat and {'are' if leading > 1 else 'is'} never recomputed)")


def checkpointing_text(plan: Plan) -> str:
    """The plan's activation checkpointing: its one mode, or how many layers recompute in each."""
    if plan.checkpointing != MIXED:
        return plan.checkpointing
    counts = Counter(plan.recomputed_layers.values())
    recomputed = ", ".join(f"{mode} on {counts[mode]}" for mode in CHECKPOINTING if counts[mode])
    return f"{MIXED} ({recomputed} of {plan.model.get('layers', '?')} layers, none on the rest)"


def precision_text(plan: Plan) -> str:
    """Compute, master-weight and gradient-reduction dtypes in words, and float8 linears where the plan has them."""
    pr = plan.precision
    if pr.mixed:
        compute = f"{pr.compute} compute, {pr.master} master weights"
    else:
        compute = f"{pr.compute} throughout" + (f" (master weights and optimizer state in {pr.master})"
                                                 if pr.master != "fp32" else "")
    float8 = (f"; the repeated layers' linear layers in float8 ({pr.fp8} scaling: e4m3 forward, e5m2 gradients), "
              "each weight read as stored cast once a step" if pr.fp8 else "")
    return f"{compute}, gradients reduced in {pr.reduce}{float8}"


def routing_lines(moe: Mapping[str, Any] | None) -> list[str]:
    """A mixture-of-experts plan's routing, capacity, dropped-token policy and assumed router imbalance
    (``Plan.model["moe"]``); none for a dense model's plan."""
    if not moe:
        return []
    factor = moe.get("capacity_factor")
    capacity = f"capacity factor {factor:g}" if factor is not None else "dropless"
    return [f"experts   {moe['experts']} x top-{moe['top_k']}, {moe['slots_per_expert']} slots per expert per "
            f"{moe['group_tokens']}-token group ({capacity}); dropped tokens: {moe['dropped_tokens']}",
            f"assumes   {moe['assumption']}"]


def context_lines(plan: Plan) -> list[str]:
    """A context-parallel plan's sequence layout and how its attention runs (``cp_layout``,
    ``cp_attention``), with where to see the price of the other way; none without cp."""
    if plan.degrees.cp <= 1:
        return []
    how = ("keys and values passed around the cp ranks, each exchange behind one block's compute"
           if plan.cp_attention == RING else "keys and values all-gathered before attention, as Llama 3")
    attention = next((name for name, op in plan.ops.items() if "scaled_dot_product_attention" in op["op"]), None)
    why = f"; the other way's price: autopar explain PLAN {attention}" if attention else ""
    return [f"context   cp={plan.degrees.cp}, {plan.cp_layout} layout, {plan.cp_attention} attention ({how}){why}"]


def summarize(plan: Plan) -> str:
    p = plan.predicted
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh.dim_names, plan.mesh.shape))
    degrees = "  ".join(f"{k}={v}" for k, v in plan.degrees.items())
    lines = [
        f"autopar plan  {plan.model['name']}  ({fmt_count(plan.model['params'])} params, "
        f"{plan.model.get('layers', 0)} layers, {plan.model.get('dtype', '')})",
        f"cluster   {plan.cluster['spec']}  ({plan.cluster['devices']} devices)",
        f"mesh      {mesh}",
        f"degrees   {degrees}",
        f"schedule  {_schedule_text(plan)}",
        f"precision {precision_text(plan)}",
        *context_lines(plan),
        *routing_lines(plan.model.get("moe")),
        "",
        f"predicted step {fmt_seconds(p['step_time_s'])}   tokens/s {p['tokens_per_s']:.4g}   MFU {p['mfu'] * 100:.1f}%",
        f"  compute          {fmt_seconds(p['compute_s'])}",
    ]
    for kind in _COMM_KINDS:
        if p["comm_s"].get(kind):
            lines.append(f"  {kind:<16} {fmt_seconds(p['comm_s'][kind])}")
    if p.get("bubble_s"):
        lines.append(f"  pipeline bubble  {fmt_seconds(p['bubble_s'])}")
    lines.append(f"  exposed comm     {fmt_seconds(p['exposed_comm_s'])}"
                 f"   (gradient sync {fmt_seconds(p.get('grad_sync_s', 0.0))}, overlapped with backward; what "
                 "compute does not hide, and the compute slowed beside what it does)")
    lines += _collective_count_line(plan)
    if p.get("runtime") == LOWERED:
        lines.append("  priced for the lowered runtime (autoparallelize's default): FSDP gradient "
                     "reduce_scatters and backward regathers overlapped with backward, in the gradient sync; "
                     "FSDP's forward gathers, issued a unit ahead, overlapped with forward")
    mem = p["memory_bytes"]
    cap = p.get("memory_capacity_bytes", 0)
    lines.append(f"memory/device {fmt_bytes(p['peak_memory_bytes'])} of {fmt_bytes(cap)}: "
                 + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mem.items()))
    if "gathered" in mem:
        lines.append("  gathered: the largest unit of the parameters sharded over data parallelism (a layer, or a "
                     "parameter in a plan pinned to DTensor), whole, twice: the unit running and the next one "
                     "gathered ahead (on DTensor, a parameter and its whole gradient)")
    lines += _stage_memory_line(p)
    s = plan.solver
    lines.append(f"solver    {s['status']}, gap {s['gap'] * 100:.2f}%, {s['variables']} vars, "
                 f"{s['constraints']} constraints, {s['wall_s']:.2f} s (search {s.get('search_wall_s', 0):.2f} s)")
    lines += ["", "placements (per mesh dim: " + ", ".join(plan.mesh.dim_names) + ")"]
    rows = collapsed_placements(plan.placements)
    width = max((len(r[0]) for r in rows), default=10)
    lines += [f"  {name:<{width}}  {text}" + (f"  x{n}" if n > 1 else "") for name, text, n in rows]
    if plan.candidates:
        lines += ["", "mesh candidates"]
        for c in sorted(plan.candidates, key=lambda c: c["step_time_s"]):
            stages = c.get("degrees", {}).get("pp", 1)
            shape = " x ".join([f"pp={stages}"] * (stages > 1) + [
                f"{n}={s}" for n, s in zip(c["mesh"]["dim_names"], c["mesh"]["shape"])])
            how = ", ".join(f"{k} {c[k]}" for k in ("microbatches", "checkpointing") if k in c)
            if c.get("checkpointing") == MIXED:
                how += " (" + ", ".join(f"{m} {n}" for m, n in c.get("layer_modes", {}).items() if n) + " layers)"
            lines.append(f"  {shape:<20} {fmt_seconds(c['step_time_s'])}  ({c['status']}{'; ' + how if how else ''})")
        for dims in plan.solver.get("pruned_meshes", []):
            shape = " x ".join(f"{n}={s}" for n, s in dims.items())
            lines.append(f"  {shape:<20} pruned: its lower bound is slower than the best")
    return "\n".join(lines)


def _stage_memory_line(predicted: dict) -> list[str]:
    """A pipeline's memory by end stage (``predicted.stage_peak_memory_bytes``), the binding one first: the
    first stage holds the embedding and the most microbatches in flight, the last the head and loss."""
    stages = predicted.get("stage_peak_memory_bytes")
    if not stages:
        return []
    binding = predicted.get("memory_stage")
    order = sorted(stages, key=lambda stage: stage != binding)
    return ["  by stage: " + ", ".join(f"{stage} {fmt_bytes(stages[stage])}" + (" (binds)" if stage == binding else "")
                                      for stage in order)]


def _collective_count_line(plan: Plan) -> list[str]:
    """How many collectives of each kind a step runs (``autopar.inspect.collectives``); none for plans that
    did not record their collectives."""
    counts = predicted_collectives({"ops": plan.ops, "pipeline": plan.pipeline})
    if not counts:
        return []
    return ["  collectives/step " + ", ".join(f"{kind} {counts[kind]}" for kind in KINDS if kind in counts)]


def compare_plans(plans: Sequence[Plan]) -> str:
    if len(plans) < 2:
        raise BadInputError("compare needs at least two plans")
    names = [f"[{i}] {p.model['name']}@{p.cluster['spec']}" for i, p in enumerate(plans)]
    rows: list[tuple[str, list[str]]] = [
        ("mesh", [str(dict(zip(p.mesh.dim_names, p.mesh.shape))) for p in plans]),
        ("degrees", [" ".join(f"{k}={v}" for k, v in p.degrees.items() if v != 1) or "single device" for p in plans]),
        ("precision", [f"{p.precision.compute}/{p.precision.master}/reduce {p.precision.reduce}"
                       + (f", fp8 {p.precision.fp8}" if p.precision.fp8 else "") for p in plans]),
        ("step time", [fmt_seconds(p.predicted["step_time_s"]) for p in plans]),
        ("compute", [fmt_seconds(p.predicted["compute_s"]) for p in plans]),
    ]
    for kind in _COMM_KINDS:
        vals = [p.predicted["comm_s"].get(kind, 0.0) for p in plans]
        if any(vals):
            rows.append((kind, [fmt_seconds(v) for v in vals]))
    rows.append(("exposed comm", [fmt_seconds(p.predicted["exposed_comm_s"]) for p in plans]))
    if any(p.predicted.get("bubble_s") for p in plans):
        rows.append(("pipeline bubble", [fmt_seconds(p.predicted.get("bubble_s", 0.0)) for p in plans]))
    rows.append(("memory/device", [fmt_bytes(p.predicted["peak_memory_bytes"]) for p in plans]))
    width = max(len(text) for text in [*names, *(v for _, vals in rows for v in vals)]) + 2
    out = ["".ljust(16) + "".join(n.ljust(width) for n in names)]
    out += [label.ljust(16) + "".join(v.ljust(width) for v in vals) for label, vals in rows]
    out += _differing_placements(plans)
    out.append(_verdict(plans))
    return "\n".join(out)


def _differing_placements(plans: Sequence[Plan]) -> list[str]:
    if len({p.model.get("graph_fingerprint") for p in plans}) > 1:
        return ["", "placements: not comparable (plans are for different models or shapes)"]
    if len({tuple(p.mesh.dim_names) for p in plans}) > 1:
        note = "  (meshes differ: " + " vs ".join(",".join(p.mesh.dim_names) for p in plans) + ")"
    else:
        note = ""
    base = [dict((n, t) for n, t, _ in collapsed_placements(p.placements)) for p in plans]
    diffs = [k for k in base[0] if len({b.get(k) for b in base}) > 1]
    lines = ["", f"placements that differ: {len(diffs)}{note}"]
    lines += [f"  {k}: " + "  vs  ".join(b.get(k, "-") for b in base) for k in diffs[:20]]
    if len(diffs) > 20:
        lines.append(f"  ... and {len(diffs) - 20} more")
    return lines


def _verdict(plans: Sequence[Plan]) -> str:
    times = [p.predicted["step_time_s"] for p in plans]
    best = min(range(len(plans)), key=lambda i: times[i])
    other = max(range(len(plans)), key=lambda i: times[i])
    if times[other] - times[best] <= 1e-9 * times[other]:
        return "\nverdict: equal predicted step times"
    terms = _term_deltas(plans[best], plans[other])
    why = ", ".join(f"{k} {fmt_seconds(abs(d))} {'less' if d < 0 else 'more'}" for k, d in terms[:2])
    return (f"\nverdict: [{best}] is faster than [{other}] by {times[other] / times[best]:.2f}x "
            f"({fmt_seconds(times[other] - times[best])} per step); biggest differences: {why}")


def _term_deltas(a: Plan, b: Plan) -> list[tuple[str, float]]:
    def terms(p: Plan) -> dict[str, float]:
        t = {"compute": p.predicted["compute_s"], "exposed comm": p.predicted["exposed_comm_s"],
             "pipeline bubble": p.predicted.get("bubble_s", 0.0)}
        t.update({k: v for k, v in p.predicted["comm_s"].items()})
        return t

    ta, tb = terms(a), terms(b)
    deltas = [(k, ta.get(k, 0.0) - tb.get(k, 0.0)) for k in ta]
    return sorted(deltas, key=lambda kv: -abs(kv[1]))
