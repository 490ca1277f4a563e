"""``simulated_trace``: a Chrome/Perfetto trace of one predicted training step on rank 0.

For: seeing, op by op, where a plan's predicted step time goes (``autopar report PLAN -o r.html
--trace t.json``; open the JSON in Perfetto or chrome://tracing). The timeline is drawn from the
per-op costs in ``plan.ops``, which are totals over the step:

* each microbatch runs every op's forward in graph order (a third of its compute, split evenly over
  the microbatches), then every op's backward in reverse order (the other two thirds);
* an op's communication is exposed: it runs on the communication track just before the op's forward;
* an op of a traced layer that stands for ``count`` layers (``plan.ops[name]["count"]``, plans of
  long stacks) is drawn once with ``count`` times its cost;
* gradient sync runs once, in the last microbatch, on its own track: each op's bucketed all_reduce
  starts when that op's backward ends (or when the previous one finishes), overlapping the rest of
  backward;
* the parameter gathers the lowered runtime issues a unit ahead in forward (``cost.prefetched_s``) are
  not drawn: they run beside forward's compute.

Not for: measurements. It is a picture of the cost model, not a profile of a run. When ops x
microbatches would pass ``MAX_EVENTS``, consecutive ops of one module are merged into one event (and,
if still too many, ops of one layer), so the file stays small enough to open.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from autopar.core.plan import Plan

MAX_EVENTS = 20_000
TRACKS = {"compute": 0, "communication": 1, "gradient sync": 2, "microbatches": 3}
_US = 1e6


@dataclass
class _Segment:
    """One op, or a run of consecutive ops merged into one event."""

    name: str
    module: str
    compute_s: float = 0.0
    comm_s: dict[str, float] = field(default_factory=dict)
    grad_sync_s: float = 0.0
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.compute_s or self.grad_sync_s or any(self.comm_s.values()))


def simulated_trace(plan: Plan) -> dict[str, Any]:
    """``{"traceEvents": [...], "displayTimeUnit": "ms"}`` for one simulated step of rank 0."""
    m = plan.pipeline.microbatches
    segments, level = _fitting_segments(plan.ops, m)
    events = _metadata(plan)
    t, sync_free = 0.0, 0.0
    for mb in range(m):
        t = _forward(events, segments, mb, m, t)
        t, sync_free = _backward(events, segments, mb, m, t, sync=(mb == m - 1), sync_free=sync_free)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"model": plan.model.get("name"), "cluster": plan.cluster.get("spec"),
                          "microbatches": m, "events_per": level,
                          "predicted_step_time_us": plan.predicted.get("step_time_s", 0.0) * _US,
                          "note": "simulated from plan.ops costs, not measured"}}


# ---- timeline ----------------------------------------------------------------------------------
def _forward(events: list, segments: list[_Segment], mb: int, m: int, t: float) -> float:
    start = t
    for seg in segments:
        for kind, s in seg.comm_s.items():
            if s > 0:
                events.append(_event(f"{kind}", "comm", "communication", t, s / m,
                                     {**seg.args, "kind": kind, "microbatch": mb}))
                t += s / m
        if seg.compute_s > 0:
            dur = seg.compute_s / 3 / m
            events.append(_event(seg.name, "forward", "compute", t, dur, {**seg.args, "microbatch": mb}))
            t += dur
    events.append(_event(f"microbatch {mb} forward", "microbatch", "microbatches", start, t - start,
                         {"microbatch": mb}))
    return t


def _backward(events: list, segments: list[_Segment], mb: int, m: int, t: float, sync: bool,
              sync_free: float) -> tuple[float, float]:
    start = t
    for seg in reversed(segments):
        if seg.compute_s > 0:
            dur = 2 * seg.compute_s / 3 / m
            events.append(_event(f"{seg.name} (backward)", "backward", "compute", t, dur,
                                 {**seg.args, "microbatch": mb}))
            t += dur
        if sync and seg.grad_sync_s > 0:
            begin = max(t, sync_free)
            events.append(_event(f"grad all_reduce {seg.module or seg.name}", "grad_sync", "gradient sync", begin,
                                 seg.grad_sync_s, {**seg.args, "kind": "all_reduce"}))
            sync_free = begin + seg.grad_sync_s
    events.append(_event(f"microbatch {mb} backward", "microbatch", "microbatches", start, t - start,
                         {"microbatch": mb}))
    return t, sync_free


def _event(name: str, cat: str, track: str, start_s: float, dur_s: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": TRACKS[track],
            "ts": round(start_s * _US, 4), "dur": round(dur_s * _US, 4), "args": args}


def _metadata(plan: Plan) -> list[dict[str, Any]]:
    title = f"autopar simulated step, rank 0: {plan.model.get('name')} on {plan.cluster.get('spec')}"
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": title}}]
    for track, tid in TRACKS.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": track}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
    return events


# ---- keeping the event count bounded -----------------------------------------------------------
def _layer_of(module: str) -> str:
    """``blocks.3.mlp.fc_in`` -> ``blocks.3``: the first two path components."""
    return ".".join(module.split(".")[:2])


_LEVELS: list[tuple[str, Callable[[str, dict], str] | None]] = [
    ("op", None),
    ("module", lambda name, op: op.get("module", "")),
    ("layer", lambda name, op: _layer_of(op.get("module", ""))),
    ("microbatch", lambda name, op: "step"),
]


def _fitting_segments(ops: dict[str, dict[str, Any]], m: int) -> tuple[list[_Segment], str]:
    """The finest segmentation (per op, per module run, per layer run, one per microbatch) under MAX_EVENTS."""
    for level, key in _LEVELS:
        segments = _per_op(ops) if key is None else _merged(ops, key)
        if _event_count(segments, m) <= MAX_EVENTS:
            return segments, level
    return segments, level


def _event_count(segments: list[_Segment], m: int) -> int:
    per_mb = sum(2 * (s.compute_s > 0) + sum(v > 0 for v in s.comm_s.values()) for s in segments) + 2
    return m * per_mb + sum(s.grad_sync_s > 0 for s in segments)


def _per_op(ops: dict[str, dict[str, Any]]) -> list[_Segment]:
    out = []
    for name, op in ops.items():
        seg = _Segment(name=f"{name} ({_short(op.get('op', ''))})", module=op.get("module", ""),
                       args={"op": name, "target": op.get("op"), "module": op.get("module", ""),
                             "inputs": op.get("inputs"), "outputs": op.get("outputs")})
        _add_cost(seg, op)
        if not seg.empty:
            out.append(seg)
    return out


def _merged(ops: dict[str, dict[str, Any]], key: Callable[[str, dict], str]) -> list[_Segment]:
    out: list[_Segment] = []
    for name, op in ops.items():
        k = key(name, op)
        if not out or out[-1].args["module"] != k:
            out.append(_Segment(name=k or "(top level)", module=k, args={"module": k, "ops": 0, "first_op": name}))
        seg = out[-1]
        _add_cost(seg, op)
        seg.args["ops"] += 1
        seg.args["last_op"] = name
    return [s for s in out if not s.empty]


def _add_cost(seg: _Segment, op: dict[str, Any]) -> None:
    """Add ``op``'s step cost to ``seg``: its cost per occurrence times the real ops it stands for."""
    cost, times = op.get("cost", {}), op.get("count", 1.0)
    seg.compute_s += times * cost.get("compute_s", 0.0)
    seg.grad_sync_s += times * cost.get("grad_sync_s", 0.0)
    for kind, seconds in cost.get("comm_s", {}).items():
        seg.comm_s[kind] = seg.comm_s.get(kind, 0.0) + times * seconds


def _short(target: str) -> str:
    """``aten.mm.default`` -> ``aten.mm``."""
    parts = target.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else target
