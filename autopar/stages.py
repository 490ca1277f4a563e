"""Pipeline stages and activation checkpointing, as transforms of a planning problem.

Both change *how much* of each decision a device pays for, not which placements exist, so they are
applied to a ``Problem`` already priced for its microbatch count (``Problem.with_microbatches``) and
the ILP stays the one ``solver.py`` states.

Pipeline (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. SOSP 2019; interleaved 1F1B, Narayanan et
al. SC21): ``p`` stages of ``ceil(L / p)`` of the model's ``L`` repeated layers each, one stage per
``dp x tp`` submesh, the stage dimension outermost (across nodes). A device pays for its stage: each
layer decision is scaled by ``layers_per_stage / L``. Ops outside the repeated layers (embedding,
final norm, head, loss) are all priced on the stage, as if one stage held both ends of the model: a
conservative choice that bounds the slowest stage (the first holds the embedding, the last the head).
With ``v`` model chunks per device (interleaved), a device holds ``v`` chunks of ``ceil(L / (p v))``
layers.

Activations kept for backward are held for every microbatch in flight on the first stage: ``m`` for
GPipe, ``min(p, m)`` for 1F1B, ``min(p, m) (1 + (p - 1) / (p v))`` interleaved (Korthikanti et al.
2022, §4.2.3), 1 without a pipeline.

Activation checkpointing (Chen et al. 2016; Korthikanti et al. MLSys 2023), per repeated layer:

* ``none``: every op keeps its output for backward;
* ``selective``: the layer's cheap ops are recomputed in backward; the outputs of its linear layers
  (matmuls against weights: ``mm``/``addmm``) and of fused attention kernels, whose recomputation is
  expensive and whose outputs are small, stay saved (``KEPT_UNDER_SELECTIVE``). Batched matmuls of
  two activations (an unfused attention's ``q k^T`` and ``p v``) are recomputed with the softmax
  between them: their outputs are the ``s x s`` scores, the memory Korthikanti et al.'s selective
  recomputation exists to drop;
* ``full``: every op of the layer is recomputed except the layer's output, which the next layer
  reads (Megatron-LM's full recomputation keeps only each layer's input).

A recomputed op runs its forward again in backward (its compute and the forward collectives that feed
it), and its activations are live only while its own layer's backward runs: one layer of one
microbatch at a time, instead of every layer of every microbatch in flight.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch
from torch import fx

from .capture import CapturedGraph, module_path
from .cost_models.pipeline import SCHEDULES, microbatches_in_flight, pipeline_bubble_fraction
from .pricing import Cost
from .problem import Edge, Problem

CHECKPOINTING = ("none", "selective", "full")
_LAYER = re.compile(r"^(.*?\.\d+)(?=\.|$)")  # "layers.3.attn.q" -> "layers.3"


@dataclass(frozen=True)
class Staging:
    """How a device runs the model: its pipeline stage and which activations it recomputes."""

    stages: int = 1  # p, pipeline-parallel degree
    layers: int = 0  # L, repeated layers of the model
    schedule: str = "none"  # none (p = 1) | gpipe | 1f1b | interleaved
    chunks: int = 1  # v, model chunks per device (interleaved only)
    checkpointing: str = "none"

    @property
    def layers_per_stage(self) -> int:
        """Layers one device holds: ``ceil(L / (p v))`` per chunk, ``v`` chunks."""
        if self.layers == 0:
            return 0
        return math.ceil(self.layers / (self.stages * self.chunks)) * self.chunks

    @property
    def layer_scale(self) -> float:
        return self.layers_per_stage / self.layers if self.layers else 1.0

    def in_flight(self, microbatches: int) -> float:
        """Microbatches whose saved activations the first stage holds at once."""
        if self.stages == 1:
            return 1.0
        return microbatches_in_flight(self.schedule, self.stages, microbatches, self.chunks)

    def bubble_fraction(self, microbatches: int) -> float:
        """Idle share of the ideal time: ``(p - 1) / (v m)``."""
        if self.stages == 1:
            return 0.0
        return pipeline_bubble_fraction(self.schedule, self.stages, microbatches, self.chunks)


_aten = torch.ops.aten
KEPT_UNDER_SELECTIVE = frozenset(getattr(_aten, name) for name in (
    "mm", "addmm", "convolution", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu") if hasattr(_aten, name))
"""Op packets whose outputs selective checkpointing keeps: the pricer's and the runtime's one list
(``passes/checkpoint.py``'s policy sees the ops as dispatched, the pricer as captured; both are aten)."""


def kept_under_selective(target: object) -> bool:
    """Whether selective checkpointing keeps the output of an op with this aten ``target``."""
    return getattr(target, "overloadpacket", target) in KEPT_UNDER_SELECTIVE


@dataclass(frozen=True)
class LayerRoles:
    """Per decision key, what the layer structure says about it (from the captured graph)."""

    in_layer: frozenset[str]  # keys whose nodes belong to a repeated layer
    boundary: frozenset[str]  # ... and whose output leaves its layer (the next layer's input)
    expensive: frozenset[str]  # ... and that are matmuls or attention (kept under selective)


def layer_roles(captured: CapturedGraph, problem: Problem) -> LayerRoles:
    key_of = {n: key for key, d in problem.decisions.items() for n in d.nodes}
    in_layer, boundary, expensive = set(), set(), set()
    for node in captured.graph.nodes:
        key = key_of.get(node.name)
        layer = layer_of(node)
        if key is None or layer is None:
            continue
        in_layer.add(key)
        if node.op == "call_function":
            if any(layer_of(user) != layer for user in _users_through_getitem(node)):
                boundary.add(key)
            if kept_under_selective(node.target):
                expensive.add(key)
    return LayerRoles(frozenset(in_layer), frozenset(boundary), frozenset(expensive))


def layer_of(node: fx.Node) -> str | None:
    """The repeated-layer instance a node belongs to (``layers.3``), or None outside layers."""
    if node.op == "placeholder":
        return None
    match = _LAYER.match(module_path(node))
    return match.group(1) if match else None


def _users_through_getitem(node: fx.Node) -> list[fx.Node]:
    out = []
    for user in node.users:
        if user.op == "call_function" and getattr(user.target, "__name__", "") == "getitem":
            out.extend(user.users)
        else:
            out.append(user)
    return out


def stage_problem(problem: Problem, captured: CapturedGraph, staging: Staging) -> Problem:
    """``problem`` (priced for its microbatches) as one device of ``staging`` pays for it."""
    if staging.stages == 1 and staging.checkpointing == "none":
        return problem
    roles = layer_roles(captured, problem)
    recomputed = _recomputed(roles, staging.checkpointing)
    kept_whole = _kept_whole(roles, staging.checkpointing)
    in_flight = staging.in_flight(problem.microbatches)
    decisions = {}
    for key, d in problem.decisions.items():
        scale = staging.layer_scale if _is_layer_decision(key, roles) else 1.0
        options = [replace(o, cost=_device_cost(_as_kept(o.cost) if key in kept_whole else o.cost,
                                                key in recomputed, in_flight, staging, problem.microbatches))
                   for o in d.options]
        decisions[key] = replace(d, options=options, scale=d.scale * scale)
    again: dict[int, Cost] = {}  # edge prices are shared Cost objects (Pricer.edge caches them)
    edges = [_staged_edge(e, decisions[e.dst].scale, e.dst in recomputed, again) for e in problem.edges]
    return replace(problem, decisions=decisions, edges=edges)


def _is_layer_decision(key: str, roles: LayerRoles) -> bool:
    """Ops of repeated layers, and the parameters of those layers (``param:layers.*.w``)."""
    if key in roles.in_layer:
        return True
    return key.startswith("param:") and ".*" in key


def _recomputed(roles: LayerRoles, checkpointing: str) -> frozenset[str]:
    if checkpointing == "full":
        return roles.in_layer - roles.boundary
    if checkpointing == "selective":
        return roles.in_layer - roles.boundary - roles.expensive
    return frozenset()


def _kept_whole(roles: LayerRoles, checkpointing: str) -> frozenset[str]:
    """Ops whose outputs the checkpoint policy saves whole, needed by backward or not: selective
    checkpointing's linear layers and fused attention (``passes/checkpoint.py`` marks them MUST_SAVE)."""
    if checkpointing == "selective":
        return (roles.in_layer & roles.expensive) - roles.boundary
    return frozenset()


def _as_kept(cost: Cost) -> Cost:
    return replace(cost, memory_bytes=max(cost.memory_bytes, cost.output_bytes)) if cost.batch_memory else cost


def _device_cost(cost: Cost, recomputed: bool, in_flight: float, staging: Staging, microbatches: int) -> Cost:
    """A cost as one device pays for it: saved activations held for every microbatch in flight, or,
    recomputed, live for one layer at a time and paid again in forward time (during backward, so it
    also lengthens the last microbatch's backward that gradient sync hides behind)."""
    if not cost.batch_memory:
        return cost
    if not recomputed:
        return replace(cost, memory_bytes=cost.memory_bytes * in_flight)
    forward = cost.compute_s / 3  # compute_s is forward + backward (2x forward), over all microbatches
    return replace(cost, compute_s=cost.compute_s + forward,
                   backward_compute_s=cost.backward_compute_s + forward / microbatches,
                   memory_bytes=cost.memory_bytes / max(1, staging.layers_per_stage))


def _staged_edge(edge: Edge, scale: float, into_recomputed: bool, again: dict[int, Cost]) -> Edge:
    """An edge scaled like its consumer; feeding a recomputed op, its forward collectives run twice."""
    price = edge.price
    if into_recomputed:
        price = {}
        for pq, c in edge.price.items():
            if id(c) not in again:
                again[id(c)] = _with_forward_again(c)
            price[pq] = again[id(c)]
    return replace(edge, count=edge.count * scale, price=price)


def _with_forward_again(cost: Cost) -> Cost:
    if not cost.forward_comm_s:
        return cost
    out = replace(cost, comm_s=dict(cost.comm_s))
    for kind, seconds in cost.forward_comm_s.items():
        out.add_comm(kind, seconds)
    return out
