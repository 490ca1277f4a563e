"""Pipeline stages and activation checkpointing, as transforms of a planning problem.

Both change *how much* of each decision a device pays for, not which placements exist, so they are
applied to a ``Problem`` already priced for its microbatch count (``Problem.with_microbatches``) and
the ILP stays the one ``solver.py`` states.

Pipeline (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. SOSP 2019; interleaved 1F1B, Narayanan et
al. SC21): ``p`` stages of ``ceil(L / p)`` of the model's ``L`` repeated layers each, one stage per
``dp x tp`` submesh, the stage dimension outermost (across nodes). A device pays for its stage: each
layer decision is scaled by ``layers_per_stage / L``. With ``v`` model chunks per device (interleaved),
a device holds ``v`` chunks of ``ceil(L / (p v))`` layers. In time, ops outside the repeated layers
(embedding, final norm, head, loss) are all priced on the stage, as if one stage ran both ends of the
model: a conservative choice that bounds the slowest stage (the first runs the embedding, the last the
head; the step is one objective, which a max of two stages' times would make a second one). In memory
each end is its own stage's (``StageRows``, the solver's two memory rows (4)): the first stage's
device holds its layers and what comes before them (the embedding, its weight's parameters, gradients
and optimizer state, the tokens), the last's its layers and what comes after them (final norm, head,
loss, the head's weight, the labels); a weight both ends read (a tied embedding and head,
``passes/tied_parameters.py``) counts on both. A pipeline fits when both rows do: the stages between
hold neither end and no more microbatches than the first.

Layers that repeat only after some first ones that do not (DeepSeek-V3's dense first layers before its
mixture-of-experts ones; ``CapturedGraph.leading_layers``) are cut after those: ``L`` counts the repeating
layers (``ir.layers.repeating_layers``), and the leading layers are priced as the code before the layers is,
on the first stage, whole and never recomputed (their ops tie among themselves, never with the repeating
layers': ``capture``), in its memory row alone; the runtime runs them in the first chunk, not checkpointed
(``passes/program.py``). What a later unit reads from before the repeating layers (an encoder's output, which
every decoder layer reads) every stage passes on, priced as a stage transfer (``LayerRoles.carried``).

Activations kept for backward are held for every microbatch in flight on the first stage: ``m`` for
GPipe, ``min(p, m)`` for 1F1B, ``p (1 + (p - 1) / (p v))`` interleaved where ``m`` is a multiple of ``p``
(Korthikanti et al. 2022, §4.2.3; ``cost_models/symbolic.py`` for the rest), 1 without a pipeline. The
last stage holds its layers' activations for fewer (``Staging.last_stage_in_flight``): ``m`` for GPipe,
1 for 1F1B, ``((v - 1) p + 1) / v`` interleaved (its warmup forwards plus one). The ops after the last
layer (final norm, head, loss: the last chunk's) are held for the microbatches in flight there: ``m``
for GPipe, 1 for 1F1B and interleaved, whose last chunk runs each backward right after its forward.
Under torch's zero-bubble schedule (Qi et al. 2024) all three are simulated from its action table
(``cost_models/pipeline.py``): ``p`` on the first stage, ``p`` on the last, and ``p`` on the last chunk,
whose weight gradients wait to fill the bubble.

Activation checkpointing (Chen et al. 2016; Korthikanti et al. MLSys 2023), per repeated layer:

* ``none``: every op keeps its output for backward;
* ``core_attention``: Megatron-LM's selective recomputation (Korthikanti et al. 2022, §5; what NeMo and
  Megatron-LM recipes call "selective"): only the attention core (``ir.layers.attention_cores``: ``QK^T``,
  mask, softmax, dropout, ``AV``, or one fused attention kernel) is recomputed, from the q, k and v it
  keeps as its inputs; every other op keeps what it keeps under ``none``. Its memory is never above
  none's: it drops the ``s x s`` scores of unfused attention (the ``5as/h`` term) and fused
  attention's log-sum-exp, for one more attention forward per layer (a core's output that a reader
  outside it saves, as the output projection of the built-in models saves fused attention's, stays
  held: ``LayerRoles.saved_outside_core``); no collective runs again unless the plan moves a value
  inside the core;
* ``selective`` (PyTorch's selective activation checkpointing with a policy that keeps every linear
  layer; torchtitan's "op" policy keeps every other ``mm`` and recomputes the rest, float8 ``_scaled_mm``
  included: a mode between this one and ``full`` that autopar neither runs nor prices): the layer's
  cheap ops are recomputed in backward; the outputs of its linear layers
  (matmuls against weights: ``mm``/``addmm``) and of fused attention kernels, whose recomputation is
  expensive and whose outputs are small, stay saved (``KEPT_UNDER_SELECTIVE``). Batched matmuls of
  two activations (an unfused attention's ``q k^T`` and ``p v``) are recomputed with the softmax
  between them: their outputs are the ``s x s`` scores, the memory Korthikanti et al.'s selective
  recomputation exists to drop. A matmul left partial (row-parallel, before its reduction) is
  recomputed too: keeping its full-size output would cost more than no recomputation (``_treatment``);
* ``save_dot_except_mlpwi`` (MaxText's remat policy of that name, ``save_only_these_names`` of the q, k,
  v and output projections and the MLP's output projection): as ``selective``, but an MLP's input
  projections (``ir.layers.widens``: a linear layer widening its rows, the up and gate projections,
  whose outputs are the widest of the layer) and fused attention are recomputed too;
* ``full``: every op of the layer is recomputed except the layer's output, which the next layer
  reads (Megatron-LM's full recomputation keeps only each layer's input).

A recomputed op runs its forward again in backward (its compute and the forward collectives that feed
it), and its activations are live only while its own layer's backward runs: one layer of one
microbatch at a time, instead of every layer of every microbatch in flight.

The mode can be a decision of the ILP, per layer: with several modes in ``Staging.checkpointing``, each
layer op is priced in every mode and the solver picks how many of a device's ``layers_per_stage``
layers run in each, together with the placements (``solver.py`` constraints (5)-(8)); e.g. 3 of 4
layers selectively recomputed and one not at all, where recomputing every layer would waste time and
none would not fit (Megatron-LM's ``--recompute-num-layers``, chosen by the cost model instead of by
hand). The planner's mesh search prices one mode for the whole model and re-solves its winner this way,
its placements held (``search._MeshSearch.refine_layer_modes``). All layers share one sharding
decision, so which layers get which mode does not change the price: ``assign_layer_modes`` gives each
stage's first layers the most recomputation.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from torch import fx

from autopar.ir.capture import CapturedGraph
from autopar.ir.layers import (attention_cores, kept_under_selective, layer_names, layer_period, repeating_layer_of,
                               repeating_layers, widens)
from autopar.core.plan import CHECKPOINTING, MIXED, SELECTIVE_MODES
from autopar.cost_models.pipeline import (last_chunk_in_flight, last_stage_in_flight, least_bubble_fraction,
                                          microbatches_in_flight, pipeline_bubble_fraction)
from autopar.planning.pricing import Cost, with_fields
from autopar.planning.problem import LayerModes, Option, Problem, StageRows, option_settled_at, settled_moves

@dataclass(frozen=True)
class Staging:
    """How a device runs the model: its pipeline stage and which activations it recomputes."""

    stages: int = 1  # p, pipeline-parallel degree
    layers: int = 0  # L, repeated layers of the model
    schedule: str = "none"  # none (p = 1) | gpipe | 1f1b | interleaved | zero_bubble
    chunks: int = 1  # v, model chunks per device (interleaved and zero_bubble only)
    checkpointing: tuple[str, ...] = ("none",)  # modes a layer may run in: one pins it, several are solved

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

    def last_stage_in_flight(self, microbatches: int) -> float:
        """Microbatches whose saved activations of its layers the last stage holds at once."""
        if self.stages == 1:
            return 1.0
        return last_stage_in_flight(self.schedule, self.stages, microbatches, self.chunks)

    def last_chunk_in_flight(self, microbatches: int) -> float:
        """Microbatches whose saved activations the model's last chunk (head and loss) holds at once."""
        if self.stages == 1:
            return 1.0
        return last_chunk_in_flight(self.schedule, self.stages, microbatches, self.chunks)

    def bubble_fraction(self, microbatches: int) -> float:
        """Idle share of the ideal time: ``(p - 1) / (v m)``."""
        if self.stages == 1:
            return 0.0
        return pipeline_bubble_fraction(self.schedule, self.stages, microbatches, self.chunks)

    def least_bubble_fraction(self, microbatches: int) -> float:
        """A lower bound of ``bubble_fraction`` that simulates no schedule (``least_bubble_fraction``)."""
        if self.stages == 1:
            return 0.0
        return least_bubble_fraction(self.schedule, self.stages, microbatches, self.chunks)


@dataclass(frozen=True)
class FewestHeld(Staging):
    """One schedule over several chunk counts a device (``among``, each with the same layers a device as
    ``chunks``), row by row at the fewest microbatches in flight of any of them and at the least bubble.
    A problem staged with it prices the same work as under each (the layers a device are the same, and
    the chunk count changes only memory: ``stage_problem``) and needs no more memory on any row, so an
    ILP over it bounds every one of theirs (``search._ChunkBound``)."""

    among: tuple[int, ...] = ()

    def _each(self) -> list[Staging]:
        return [Staging(self.stages, self.layers, self.schedule, v, self.checkpointing) for v in self.among]

    def in_flight(self, microbatches: int) -> float:
        return min(s.in_flight(microbatches) for s in self._each())

    def last_stage_in_flight(self, microbatches: int) -> float:
        return min(s.last_stage_in_flight(microbatches) for s in self._each())

    def last_chunk_in_flight(self, microbatches: int) -> float:
        return min(s.last_chunk_in_flight(microbatches) for s in self._each())

    def bubble_fraction(self, microbatches: int) -> float:
        return self.least_bubble_fraction(microbatches)

    def least_bubble_fraction(self, microbatches: int) -> float:
        return min(s.least_bubble_fraction(microbatches) for s in self._each())


def device_layers(captured: CapturedGraph, ranges: list[list[int]], stages: int) -> list[list[str]]:
    """The repeating layers (``ir.layers.repeating_layers``) each pipeline stage's device holds, from a plan's
    layer ranges (chunk ``i`` on stage ``i mod stages``; the leading layers, in the first range, left out)."""
    names = layer_names(captured)
    repeating = set(repeating_layers(captured))
    ranges = ranges or [[0, len(names)]]
    return [[name for first, end in ranges[s::stages] for name in names[first:end] if name in repeating]
            for s in range(stages)]


def assign_layer_modes(layers_by_device: list[list[str]], counts: dict[str, int], period: int = 1) -> dict[str, str]:
    """Each layer's checkpointing mode when every device runs ``counts[mode]`` of its units of ``period``
    layers (``layer_period``; the layers listed in ``layers_by_device``) in each mode: the most
    recomputation first (``CHECKPOINTING`` backwards), the rest none (a device holding fewer layers than
    priced recomputes at least as large a share); the layers of a unit alike."""
    queue = [m for m in reversed(CHECKPOINTING) for _ in range(counts.get(m, 0))]
    modes = {}
    for layers in layers_by_device:
        modes.update((layer, queue[i // period]) for i, layer in enumerate(layers) if i // period < len(queue))
    return modes


def checkpointing_summary(counts: dict[str, int]) -> str:
    """A plan's ``checkpointing`` from its layers' modes: the one they all run in, or ``MIXED``."""
    used = [m for m, n in counts.items() if n]
    return used[0] if len(used) == 1 else (MIXED if used else "none")


def count_layer_modes(device_layers: list[str], mode_of: Callable[[str], str], units: int, period: int = 1
                      ) -> dict[str, int]:
    """How many of the ``units`` (of ``period`` layers) a device is priced for run in each mode, from the
    modes of the layers it holds (``device_layers``), a unit's being its first layer's; any it is priced
    for beyond those count as ``none``."""
    counts: dict[str, int] = {}
    for layer in device_layers[::period]:
        counts[mode_of(layer)] = counts.get(mode_of(layer), 0) + 1
    recomputed = sum(n for mode, n in counts.items() if mode != "none")
    return {**counts, "none": units - recomputed} if units > recomputed else counts


@dataclass(frozen=True)
class LayerRoles:
    """Per decision key, what the layer structure says about it (from the captured graph)."""

    in_layer: frozenset[str]  # keys whose nodes belong to a repeated layer
    boundary: frozenset[str]  # ... and whose output leaves its layer (the next layer's input)
    expensive: frozenset[str]  # ... and that are matmuls or attention (kept under selective)
    widening: frozenset[str]  # ... and that are an MLP's input projections (``ir.layers.widens``)
    after_layers: frozenset[str]  # keys of ops after the last layer's (final norm, head, loss)
    attention_core: frozenset[str] = frozenset()  # keys of a layer's attention core (core_attention recomputes)
    saved_outside_core: frozenset[str] = frozenset()  # ... whose output an op outside its core saves (still held)
    first_stage_only: frozenset[str] = frozenset()  # keys of ops before the first layer and of the values only they read
    last_stage_only: frozenset[str] = frozenset()  # keys of ``after_layers`` and of the values only they read
    stage_boundary: frozenset[str] = frozenset()  # keys of ``boundary`` whose output leaves its unit of
    # ``layer_period`` layers: what a pipeline stage hands the next (``boundary`` where every layer is alike)
    carried: tuple[tuple[str, int], ...] = ()  # (key, how many of its nodes) of values made from parameters before
    # the repeating layers that a unit after the first reads (an encoder's output, read by every decoder layer):
    # every stage passes them on


_last_roles: list[tuple[CapturedGraph, tuple[str, ...], LayerRoles]] = []  # the last graph's: a search asks hundreds of times


def layer_roles(captured: CapturedGraph, problem: Problem) -> LayerRoles:
    """What each decision of ``problem`` is to the repeated layers (``LayerRoles``). The roles depend on
    the graph and the decisions' keys alone, the same for every mesh, microbatch count and staging of a
    search, so the last graph's are kept."""
    keys = tuple(problem.decisions)
    if _last_roles and _last_roles[0][0] is captured and _last_roles[0][1] == keys:
        return _last_roles[0][2]
    roles = _layer_roles(captured, problem)
    _last_roles[:] = [(captured, keys, roles)]
    return roles


def _layer_roles(captured: CapturedGraph, problem: Problem) -> LayerRoles:
    key_of = {n: key for key, d in problem.decisions.items() for n in d.nodes}
    period, layer_of = layer_period(captured), repeating_layer_of(captured)
    unit_of = {name: i // period for i, name in enumerate(repeating_layers(captured))}
    in_layer, boundary, expensive, widening, after_layers = set(), set(), set(), set(), set()
    stage_boundary = set()
    cores = attention_cores(captured.graph.nodes)
    core = {key_of[n.name] for nodes in cores for n in nodes if n.name in key_of}
    savers = captured.saved_for_backward().savers
    saved_outside = {key_of[n.name] for nodes in cores for n in nodes
                     if n.name in key_of and savers.get(n.name, frozenset()) - {m.name for m in nodes}}
    for node in captured.graph.nodes:
        key = key_of.get(node.name)
        layer = layer_of(node)
        if key is None:
            continue
        if layer is None:
            if node.op == "call_function" and in_layer:
                after_layers.add(key)  # cleared again if a layer's op follows it
            continue
        after_layers.clear()
        in_layer.add(key)
        if node.op == "call_function":
            users = _users_through_getitem(node)
            if any(layer_of(user) != layer for user in users):
                boundary.add(key)
            if any(unit_of.get(layer_of(user)) != unit_of.get(layer) for user in users):
                stage_boundary.add(key)
            if kept_under_selective(node.target):
                expensive.add(key)
            if widens(node):
                widening.add(key)
    first, last = _held_at_one_end(captured, key_of, after_layers)
    return LayerRoles(frozenset(in_layer), frozenset(boundary), frozenset(expensive), frozenset(widening),
                      frozenset(after_layers),
                      frozenset(core & in_layer), frozenset(saved_outside & in_layer), first, last,
                      frozenset(stage_boundary), _carried(captured, key_of, unit_of))


def _carried(captured: CapturedGraph, key_of: dict[str, str], unit_of: dict[str, int]
             ) -> tuple[tuple[str, int], ...]:
    """``LayerRoles.carried``: the keys of ops before the first repeating layer's, computed from a parameter, that
    an op of a unit after the first reads. ``passes/split_stages.py`` sends such a value from the first chunk
    through every chunk to its last reader; a value computed from no parameter (a mask, a rotary table) each chunk
    computes itself."""
    layer_of, from_params, carried = repeating_layer_of(captured), set(captured.params), Counter()
    for node in captured.graph.nodes:
        if node.op != "call_function" or not any(i.name in from_params for i in node.all_input_nodes):
            continue
        if layer_of(node) is not None:
            break
        from_params.add(node.name)
        key = key_of.get(node.name)
        if key is not None and any(unit_of.get(layer_of(user), 0) > 0 for user in _users_through_getitem(node)):
            carried[key] += 1
    return tuple(sorted(carried.items()))


def _held_at_one_end(captured: CapturedGraph, key_of: dict[str, str], after: set[str]
                     ) -> tuple[frozenset[str], frozenset[str]]:
    """(keys only the first stage holds, keys only the last holds), as ``passes/split_stages.py`` gives
    nodes to chunks: the ops ``after`` the repeated layers (final norm, head, loss) are the last stage's;
    an op before them is the first's when only the first layer (a real one, not a traced stack's
    representative of several) and other such ops read it (the embedding), not when later layers do too
    (a rotary table or a mask, which every stage that reads it computes or receives). A placeholder is
    one end's when only that end's ops read it (the tokens and the embedding's weight; the labels and
    the head's weight); a weight both ends read (a tied embedding and head, of which
    ``passes/tied_parameters.py`` gives each end stage a copy) is held by both."""
    nodes, layer_of = list(captured.graph.nodes), repeating_layer_of(captured)
    layer_ops = [n for n in nodes if n.op == "call_function" and layer_of(n) is not None]
    first_layer = layer_of(layer_ops[0]) if layer_ops else None
    before = nodes[:nodes.index(layer_ops[0])] if layer_ops else []
    first: set[str] = set()  # node names
    for node in reversed(before):  # readers first
        if node.op == "call_function" and node.users and all(
                user.name in first or (layer_of(user) == first_layer and captured.weight(user.name) == 1.0)
                for user in node.users):
            first.add(node.name)
    last = {node.name for node in nodes if key_of.get(node.name) in after}
    for node in nodes:
        if node.op == "placeholder" and node.users:
            for end in (first, last):
                if all(user.name in end for user in node.users):
                    end.add(node.name)
    return _keys_wholly_in(first, key_of), _keys_wholly_in(last, key_of)


def _keys_wholly_in(names: set[str], key_of: dict[str, str]) -> frozenset[str]:
    """The decision keys all of whose nodes are among ``names``."""
    members: dict[str, list[str]] = {}
    for name, key in key_of.items():
        members.setdefault(key, []).append(name)
    return frozenset(key for key, names_of in members.items() if all(n in names for n in names_of))


def _users_through_getitem(node: fx.Node) -> list[fx.Node]:
    out = []
    for user in node.users:
        if user.op == "call_function" and getattr(user.target, "__name__", "") == "getitem":
            out.extend(user.users)
        else:
            out.append(user)
    return out


def staged_alike(staging: Staging, microbatches: int) -> tuple:
    """What of ``staging`` ``stage_problem`` reads for a problem of ``microbatches``: two stagings equal in it
    stage a problem alike. Schedules and chunk counts differ only in the microbatches in flight (torch's
    zero-bubble schedule holds ``p`` on the first stage at any count of chunks a device), and the chunk
    counts a search tries hold as many layers a device (``search.interleaving_chunks``)."""
    m = microbatches
    return (staging.stages, staging.layers_per_stage, staging.layer_scale, staging.checkpointing,
            staging.in_flight(m), staging.last_chunk_in_flight(m), staging.last_stage_in_flight(m))


def stage_problem(problem: Problem, captured: CapturedGraph, staging: Staging) -> Problem:
    """``problem`` (priced for its microbatches) as one device of ``staging`` pays for it. With one
    checkpointing mode the result is plain; with several, each layer op is priced per mode and the
    problem carries ``LayerModes`` for the solver to choose how many layers run in each. Prices are the
    first stage's; under a pipeline the problem carries ``StageRows``, what the last stage holds apart.
    It reads of ``staging`` only what ``staged_alike`` lists."""
    layers = staging.layers_per_stage
    modes = staging.checkpointing if layers else ("none",)
    if staging.stages == 1 and modes == ("none",):
        return problem
    roles = layer_roles(captured, problem)
    recomputed = {m: _recomputed(roles, m) for m in modes}
    kept_whole = {m: _kept_whole(roles, m) for m in modes}
    still_held = {m: roles.saved_outside_core if m == "core_attention" else frozenset() for m in modes}
    in_flight = staging.in_flight(problem.microbatches)
    last_in_flight = staging.last_chunk_in_flight(problem.microbatches)
    rows = _stage_rows(problem, roles, staging) if staging.stages > 1 else None
    one_mode = {modes[0]: 1.0} if len(modes) == 1 else None  # every layer in it: settled here, in one pass
    decisions = {}
    for key, d in problem.decisions.items():
        staged = with_fields(d, scale=d.scale * (staging.layer_scale if _is_layer_decision(key, roles) else 1.0))
        if key in roles.in_layer - roles.boundary:
            treated = [(o, {m: (*_treatment(key, o, m, recomputed[m], kept_whole[m]), key in still_held[m])
                            for m in modes}) for o in d.options]
            per_layer = staged.count / layers
            if one_mode:
                options = [_settled_in_one_mode(o, treatment[modes[0]], in_flight, per_layer, problem.microbatches,
                                                staged.count) for o, treatment in treated]
            else:
                options = [_priced_by_mode(o, treatment, in_flight, per_layer, problem.microbatches)
                           for o, treatment in treated]
        else:
            held = last_in_flight if key in roles.after_layers else in_flight
            options = [with_fields(o, cost=_held(o.cost, held)) for o in d.options]
        decisions[key] = with_fields(staged, options=options)
    edges = [with_fields(e, count=e.count * decisions[e.dst].scale,
                     recomputed_under=tuple(m for m in modes if e.dst in recomputed[m]))
             for e in problem.edges]
    if one_mode:
        return with_fields(problem, decisions=decisions, layer_modes=None, stage_rows=rows,
                           **settled_moves(edges, problem.shared, one_mode))
    return with_fields(problem, decisions=decisions, edges=edges, layer_modes=LayerModes(layers, modes),
                       stage_rows=rows)


def _stage_rows(problem: Problem, roles: LayerRoles, staging: Staging) -> StageRows:
    """What the first and the last stage hold apart (``StageRows``): each its end's ops, and the last its
    layers' activations for ``last_stage_in_flight`` of the first stage's ``in_flight`` microbatches."""
    layers = frozenset(key for key in problem.decisions if _is_layer_decision(key, roles))
    share = staging.last_stage_in_flight(problem.microbatches) / staging.in_flight(problem.microbatches)
    return StageRows(roles.first_stage_only, roles.last_stage_only, layers, share)


def _treatment(key: str, option: Option, mode: str, recomputed: frozenset[str], kept_whole: frozenset[str]
               ) -> tuple[bool, bool]:
    """(recomputed, kept whole) of a layer op's option in ``mode``. Selective keeps the outputs of
    linear layers and attention, but not one the option leaves partial (a row-parallel matmul before its
    reduction: as large as the unsharded output and needed by no backward), which it recomputes, as
    ``passes/checkpoint.py`` runs it. (The edges into such a matmul are not priced as re-run: its input
    arrives sharded as it reads it, with no collective to repeat.)"""
    if key in kept_whole and _leaves_partial(option):
        return True, False
    return key in recomputed, key in kept_whole


def _leaves_partial(option: Option) -> bool:
    return any(p is not None and any(x.is_partial() for x in p) for p in option.strategy.outputs)


def _priced_by_mode(option: Option, treatment: dict[str, tuple[bool, bool, bool]], in_flight: float,
                    per_layer: float, microbatches: int) -> Option:
    """A layer op's option priced in each checkpointing mode (``treatment[mode]``, ``_priced_in_mode``), its
    ``by_mode`` prices and the ``recompute_bytes`` of the modes that recompute it."""
    by_mode, recompute_bytes = {}, {}
    for mode, treated in treatment.items():
        by_mode[mode], recompute = _priced_in_mode(option.cost, *treated, in_flight, per_layer, microbatches)
        if recompute is not None:
            recompute_bytes[mode] = recompute
    return with_fields(option, by_mode=by_mode, recompute_bytes=recompute_bytes)


def _settled_in_one_mode(option: Option, treated: tuple[bool, bool, bool], in_flight: float, per_layer: float,
                         microbatches: int, count: float) -> Option:
    """``option`` priced in the one mode every layer runs in: what ``settled_option`` makes of
    ``_priced_by_mode``'s option with that mode's share 1, its recompute working set per occurrence in its
    memory, in one copy of the option instead of two (a search stages tens of thousands of them)."""
    cost, recompute = _priced_in_mode(option.cost, *treated, in_flight, per_layer, microbatches)
    return option_settled_at(option, cost, (recompute if recompute is not None else 0) / count)


def _priced_in_mode(cost: Cost, recomputed: bool, kept_whole: bool, held_anyway: bool, in_flight: float,
                    per_layer: float, microbatches: int) -> tuple[Cost, float | None]:
    """A layer op's price in one checkpointing mode (whether the mode recomputes the op, whether it keeps
    its outputs whole, whether a reader the mode does not recompute saves them all the same), and the
    bytes its recomputation needs live (None where it is not recomputed, or held anyway): its saved
    activations held for every microbatch in flight, kept whole (selective's linear layers), or
    recomputed: paid again in forward time during backward (which also lengthens the last microbatch's
    backward that gradient sync hides behind), its activations live for one layer of one microbatch at a
    time, unless still held (an attention core's output that the output projection saves:
    core_attention)."""
    if not cost.batch_memory:
        return cost, None
    if recomputed:  # compute_s is forward + backward (2x forward), over all microbatches; an output backward makes
        # again anyway (``Kernel.remade``) is made by the layer's recomputation instead: no more time
        forward = 0.0 if cost.kernel is not None and cost.kernel.remade else cost.compute_s / 3
        memory = _held(cost, in_flight).memory_bytes if held_anyway else 0.0
        priced = with_fields(cost, compute_s=cost.compute_s + forward, memory_bytes=memory,
                             backward_compute_s=cost.backward_compute_s + forward / microbatches)
        # (the held copy of a layer is freed by its reader's backward before the recompute)
        return priced, None if held_anyway else cost.memory_bytes * per_layer  # per_layer: occurrences in a layer
    return _held(_as_kept(cost) if kept_whole else cost, in_flight), None


def _is_layer_decision(key: str, roles: LayerRoles) -> bool:
    """Ops of repeated layers, and the parameters and buffers of those layers (``param:layers.*.w``)."""
    if key in roles.in_layer:
        return True
    return key.startswith(("param:", "buffer:")) and ".*" in key


def _recomputed(roles: LayerRoles, checkpointing: str) -> frozenset[str]:
    if checkpointing == "full":
        return roles.in_layer - roles.boundary
    if checkpointing in SELECTIVE_MODES:
        return roles.in_layer - roles.boundary - _kept_by(roles, checkpointing)
    if checkpointing == "core_attention":
        return roles.attention_core - roles.boundary
    return frozenset()


def _kept_whole(roles: LayerRoles, checkpointing: str) -> frozenset[str]:
    """Ops whose outputs the checkpoint policy saves whole, needed by backward or not: selective
    checkpointing's linear layers and fused attention (``passes/checkpoint.py`` marks them MUST_SAVE)."""
    if checkpointing in SELECTIVE_MODES:
        return (roles.in_layer & _kept_by(roles, checkpointing)) - roles.boundary
    return frozenset()


def _kept_by(roles: LayerRoles, checkpointing: str) -> frozenset[str]:
    """The kept-list ops (``KEPT_UNDER_SELECTIVE``) a selective mode keeps: all, or the linear layers but
    an MLP's input projections."""
    if checkpointing == "save_dot_except_mlpwi":
        return roles.expensive - roles.widening - roles.attention_core
    return roles.expensive


def _as_kept(cost: Cost) -> Cost:
    """Its outputs kept whole for backward (selective recomputation's linear layers), beside its working set."""
    if not cost.batch_memory:
        return cost
    return with_fields(cost, memory_bytes=max(cost.memory_bytes - cost.transient_bytes, cost.output_bytes)
                       + cost.transient_bytes)


def _held(cost: Cost, in_flight: float) -> Cost:
    """Saved activations held for every microbatch in flight; a working set (``Cost.transient_bytes``) for
    the one the op runs on."""
    if not cost.batch_memory:
        return cost
    transient = cost.transient_bytes
    return with_fields(cost, memory_bytes=(cost.memory_bytes - transient) * in_flight + transient)
