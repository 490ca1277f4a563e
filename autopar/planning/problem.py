"""The planning problem on one mesh: decisions, their options and prices, and the edges between them.

A ``Problem`` is plain data built from a captured graph, the strategies DTensor allows and the
prices of ``pricing.py``; the solver reads it and knows nothing of torch. Nodes of repeated layers
share one *decision* (their tie key), so an 80-layer model costs the solver one layer's worth of
variables; prices are multiplied by how many nodes share the decision.

Activation checkpointing may be left to the solver per repeated layer (``LayerModes``, built by
``stages.stage_problem``): an op of a layer then has a price per checkpointing mode (``Option.by_mode``)
and the solver picks how many of a device's layers run in each mode; ``Problem.with_layer_modes``
fixes those counts and gives back a plain problem whose prices mix the modes.

Placeholders are decisions too: a parameter's options are its placements (``R``/``S(d)`` per mesh
dim), a user input's options are those its role allows. How a parameter's gradient (or that of an
activation read through a view) is reduced depends on two decisions at once, the op that reads it and
the placement of the value it reads (``RootSharding``): the problem lists those pairs for the solver
(constraint (9)) and ``Problem.settled`` folds them into plain prices once a solution is known.
``getitem`` nodes are not decisions: they select one output of their producer, so edges leaving them
start at the producer's output slot.

Under a pipeline, the device of the first stage and that of the last hold different things: the ops
before the repeated layers (the embedding) and the values only they read are the first's, those after
them (final norm, head, loss) the last's, and the last holds its layers' activations for fewer
microbatches (``StageRows``, built by ``stages.stage_problem``). Memory then has one row per end stage
(``memory_rows``, ``held_bytes``): every device fits when both do.

The readers of one value in one region (``ir.layers.reader_regions``: a layer, or the code before or
after the layers) that need it in the same placement share one redistribute at run time
(``passes/insert_redistributes.py``: q, k and v of one sequence-split norm output, one all_gather).
Their edges then price only what is theirs (a reduction, a re-gather) and a ``SharedResharding``
prices the move, once per placement some reader takes (solver constraint (11)).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Mapping, NamedTuple, Sequence

import torch
from torch import fx
from torch.distributed.tensor import Placement, Replicate

from autopar.core.placement import Placements
from autopar.core.plan import MEMORY_STAGES
from autopar.ir.capture import WEIGHT_KINDS, CapturedGraph, is_view, through_views, view_root
from autopar.planning.pricing import Cost, Pricer, moved_again, weighted_cost, with_fields
from autopar.planning.strategies import Strategy, StrategyFinder, candidate_placements
from autopar.ir.layers import gather_unit, is_getitem, output_vals, reader_regions, tensor_inputs


@dataclass
class Option:
    strategy: Strategy
    cost: Cost  # per occurrence; the solver multiplies by the decision's count
    grad_partial: tuple[tuple[int, ...], ...] = ()  # per input slot: mesh dims its gradient is left partial on
    by_mode: dict[str, Cost] = field(default_factory=dict)  # per checkpointing mode (``LayerModes``), per occurrence
    recompute_bytes: dict[str, float] = field(default_factory=dict)
    # per mode that recomputes the op: bytes of one layer's worth of its activations, live while that
    # layer's backward runs (charged once when any layer runs in the mode)
    working_set_bytes: float = 0.0  # per occurrence, the part of ``cost.memory_bytes`` that is recomputing
    # modes' working sets (``settled_option``): live once, not held per microbatch in flight
    gathered_bytes: float = 0.0  # a parameter's: what gathering it adds while its unit runs
    # (``GATHERED_COPIES`` x ``Pricer.gathered_bytes``), held for the largest unit only (``gathered_units``)

    def edge_key(self, slot: int) -> tuple[Placements, tuple[int, ...]]:
        """What an edge into input ``slot`` depends on: the placement this option reads it in, and the
        dims on which it leaves its gradient partial (``Pricer.grad_partial_dims``)."""
        return self.strategy.inputs[slot], self.grad_partial[slot] if self.grad_partial else ()


@dataclass
class Decision:
    key: str
    nodes: list[str]  # graph nodes that share this decision
    options: list[Option]
    scale: float = 1.0  # share of the nodes one device runs (a pipeline stage holds some of the layers)
    occurrences: float | None = None  # in the real model (a traced stack's nodes stand for several); None: len(nodes)

    def __post_init__(self) -> None:
        if self.occurrences is None:
            self.occurrences = float(len(self.nodes))

    @property
    def count(self) -> float:
        """Occurrences the solver pays for: those of the whole model, times ``scale``."""
        return self.occurrences * self.scale

    def least_memory(self, held: Callable[[Cost, float], float] | None = None) -> float:
        """Its smallest memory over options (and checkpointing modes, each with its recompute working set);
        ``held(cost, working_set)``, where a device holds other than each price's ``memory_bytes``: the
        bytes per occurrence a cost (with that working set in it) puts on it (``Problem.held_bytes``)."""
        if held is None:  # (no call per option, nor a generator where an option has no modes: the search
            # bounds thousands of problems' memory)
            return min(min(self.count * c.memory_bytes + o.recompute_bytes.get(m, 0.0) for m, c in o.by_mode.items())
                       if o.by_mode else self.count * o.cost.memory_bytes for o in self.options)
        return min(min((self.count * held(c, 0.0) + o.recompute_bytes.get(m, 0.0)
                        for m, c in o.by_mode.items()), default=self.count * held(o.cost, o.working_set_bytes))
                   for o in self.options)


@dataclass
class Edge:
    """Tensors flowing from output ``src_out`` of decision ``src`` into input ``slot`` of ``dst``."""

    src: str
    src_out: int
    dst: str
    slot: int
    count: float  # occurrences the solver pays for (scaled like the consumer's decision)
    price: dict[tuple[Placements, tuple[Placements, tuple[int, ...]]], Cost] = field(default_factory=dict)
    # keyed (producer's output placement, consumer's ``Option.edge_key``)
    recomputed_under: tuple[str, ...] = ()  # checkpointing modes that recompute the consumer: its
    # forward collectives (``Cost.forward_comm_s``) run again in backward for each layer in those modes


class EdgeRows(NamedTuple):
    """Edge ``key``'s rows (2), as ``solver.add_edge_variables`` writes them: per producer placement, the
    indices of its placement pairs (in ``Edge.price``'s order) and of the producer's options that output
    it; then per consumer ``Option.edge_key``, the same for the consumer."""

    key: tuple[str, int, str, int]  # (src, src_out, dst, slot): checked where the rows are shared
    pairs: int
    rows: tuple[tuple[tuple[int, ...], str, tuple[int, ...]], ...]  # (pair indices, end decision, its options)
    consumer_from: int  # index in ``rows`` of the first consumer row (an edge may join a decision to itself)


@dataclass
class SharedResharding:
    """One redistribute several edges share: edges ``edges`` (indices into ``Problem.edges``) carry one
    value to readers in one region, and the move of that value from producer placement ``p`` to reader
    placement ``q`` (``price[p, q]``: its forward collectives and their duals, for ``p != q``) runs once
    however many of them read it at ``q``. ``share``: the part of the first edge's occurrences that
    are these readers' (the group's count is ``share`` times that edge's ``count``, which staging
    scales); the edges' own prices leave the move out (``Pricer.edge(..., shared=True)``)."""

    edges: tuple[int, ...]
    share: float
    price: dict[tuple[Placements, Placements], Cost]

    def count(self, edges: Sequence["Edge"]) -> float:
        return self.share * edges[self.edges[0]].count

    def recomputed_under(self, edges: Sequence["Edge"]) -> tuple[str, ...]:
        """Checkpointing modes that recompute some reader: the shared move, inside the readers'
        checkpointed layer, runs again in backward."""
        return tuple(dict.fromkeys(m for e in self.edges for m in edges[e].recomputed_under))

    def taken(self, problem: "Problem", choice: Mapping[str, int]) -> list[Cost]:
        """The moves ``choice`` makes: one per distinct (producer, reader) placement pair its edges carry."""
        return self.moves(edge_pair(problem, problem.edges[e], choice) for e in self.edges)

    def moves(self, pairs: Iterable[tuple[Placements, tuple[Placements, tuple[int, ...]]]]) -> list[Cost]:
        """The moves of the (producer placement, ``Option.edge_key``) pairs its edges carry, each once."""
        distinct = dict.fromkeys((p, q[0]) for p, q in pairs)
        return [self.price[pq] for pq in distinct if pq in self.price]


def edge_pair(problem: "Problem", edge: "Edge", choice: Mapping[str, int]
              ) -> tuple[Placements, tuple[Placements, tuple[int, ...]]]:
    """The (producer placement, consumer ``Option.edge_key``) pair ``choice`` puts on ``edge``."""
    p = problem.decisions[edge.src].options[choice[edge.src]].strategy.outputs[edge.src_out]
    return p, problem.decisions[edge.dst].options[choice[edge.dst]].edge_key(edge.slot)


@dataclass(frozen=True)
class RootSharding:
    """A price that holds when two decisions are taken together: one of options ``options`` of decision
    ``consumer`` (which reads a parameter, or an activation through a view, in input ``slot`` and leaves
    its gradient partial) and one of options ``root_options`` of decision ``root``, which makes the
    value the input is a view of (the parameter itself): placements it is gathered from on its way to
    the op, all with the same price change.
    The gradient is then reduced by the gather's backward on the critical path, instead of by the
    gradient sync (a parameter: FSDP) or by one all_reduce shared by the value's readers (an
    activation: sequence parallelism) (``Pricer.gathered_root_delta``); ``delta`` is the change to the
    consumer's price per occurrence, paid by ``share`` of the consumer's nodes (those whose root is
    this one)."""

    consumer: str
    options: frozenset[int]
    slot: int
    root: str
    root_options: frozenset[int]
    share: float
    delta: Cost

    def holds(self, choice: Mapping[str, int]) -> bool:
        return choice[self.consumer] in self.options and choice[self.root] in self.root_options


@dataclass(frozen=True)
class LayerModes:
    """Activation checkpointing left to the solver: each of the ``layers`` repeated layers a device
    holds runs in one of ``modes`` (``plan.CHECKPOINTING``); the solver picks how many in each."""

    layers: int
    modes: tuple[str, ...]


FIRST_STAGE, LAST_STAGE = MEMORY_STAGES
EVERY_DEVICE = "device"
"""Memory rows (``Problem.memory_rows``): the first and the last pipeline stage's devices
(``core.plan.MEMORY_STAGES``), or every device alike (no pipeline)."""


@dataclass(frozen=True)
class StageRows:
    """What the first and the last stage of a pipeline hold differently (``stages.stage_problem``): the
    decisions only the first holds (``first_only``: ops before the repeated layers and the values only they
    read) and only the last (``last_only``: ops after them), and of a repeated layer's decisions
    (``layers``) the share of the first stage's microbatches in flight whose activations the last holds
    (``last_share``). Every other decision is on both: the layers, a weight both ends read (a tied
    embedding and head, ``passes/tied_parameters.py``)."""

    first_only: frozenset[str]
    last_only: frozenset[str]
    layers: frozenset[str]
    last_share: float

    def holds(self, stage: str, key: str) -> bool:
        """Whether ``stage``'s device holds decision ``key``."""
        return key not in (self.last_only if stage == FIRST_STAGE else self.first_only)

    def rescaled(self, stage: str, key: str) -> bool:
        """Whether ``stage``'s device holds decision ``key``'s activations for other microbatches than priced."""
        return stage == LAST_STAGE and key in self.layers

    def held_bytes(self, stage: str, key: str, cost: Cost, working_set: float) -> float:
        """Bytes per occurrence that ``cost`` (an option of decision ``key``, ``working_set`` of it a
        recomputed layer's, live once) puts on ``stage``'s device."""
        if not self.holds(stage, key):
            return 0.0
        if cost.batch_memory and self.rescaled(stage, key):
            once = working_set + cost.transient_bytes
            return self.last_share * (cost.memory_bytes - once) + once
        return cost.memory_bytes


@dataclass
class Problem:
    mesh_shape: tuple[int, ...]
    decisions: dict[str, Decision]
    edges: list[Edge]
    memory_capacity_bytes: float
    overlap_fraction: float  # share of backward compute that can hide gradient all_reduce
    unsupported_ops: set[str] = field(default_factory=set)  # ops with no DTensor strategy (run replicated)
    microbatches: int = 1  # gradient accumulation steps the prices assume
    overlap_slowdown: float = 0.0  # how much longer compute takes beside a collective (DeviceSpec's)
    layer_modes: LayerModes | None = None  # per-layer checkpointing still to choose (solver.py (5)-(8))
    root_terms: list[RootSharding] = field(default_factory=list)  # prices of two decisions together (9)
    shared: list[SharedResharding] = field(default_factory=list)  # moves several edges share (11)
    stage_rows: StageRows | None = None  # under a pipeline, what its end stages hold apart (memory rows (4))
    gathered_units: dict[str, dict[str, int]] = field(default_factory=dict)
    # unit -> its parameters' decisions (and how many of each one's nodes are in it) where an option
    # gathers a parameter sharded over data parallelism (``gathered_units``): memory rows (12)
    edge_rows: "dict[int, EdgeRows] | None" = field(default=None, repr=False, compare=False)
    # the rows (2) of each edge (by index), shared by the problems derived from a built one that keep its
    # edges' placement pairs and its decisions' options, re-priced or staged (``solver.add_edge_variables``
    # fills it); None: not shared (``with_choice`` keeps one pair an edge, and hand-built problems)

    @property
    def memory_rows(self) -> tuple[str, ...]:
        """The devices whose memory bounds every device's: the first and the last stage of a pipeline,
        one row otherwise."""
        return (FIRST_STAGE, LAST_STAGE) if self.stage_rows is not None else (EVERY_DEVICE,)

    def holds(self, stage: str, key: str) -> bool:
        """Whether the device of memory row ``stage`` holds decision ``key`` (every device does without a
        pipeline)."""
        return self.stage_rows is None or self.stage_rows.holds(stage, key)

    def held_as_priced(self, stage: str, key: str) -> bool:
        """Whether the device of memory row ``stage`` holds each option of decision ``key`` at its price's
        ``memory_bytes`` (where it holds the decision at all)."""
        return self.stage_rows is None or not self.stage_rows.rescaled(stage, key)

    def held_bytes(self, stage: str, key: str, cost: Cost, working_set: float = 0.0) -> float:
        """Bytes per occurrence that ``cost``, an option of decision ``key`` (``working_set`` of it a
        recomputed layer's, ``Option.working_set_bytes``), puts on the device of memory row ``stage``."""
        if self.stage_rows is None:
            return cost.memory_bytes
        return self.stage_rows.held_bytes(stage, key, cost, working_set)

    def memory_by_stage(self, choice: Mapping[str, int]) -> dict[str, float]:
        """Bytes per device of each memory row at ``choice``, on a problem whose layers' modes are settled
        (``with_layer_modes``): the solver's constraints (4) and (12)."""
        problem = self.settled(choice)
        chosen = {key: d.options[choice[key]] for key, d in problem.decisions.items()}
        return {stage: sum(d.count * problem.held_bytes(stage, key, o.cost, o.working_set_bytes)
                           for key, d in problem.decisions.items() for o in (chosen[key],))
                + problem.gathered_bytes(stage, chosen)
                for stage in problem.memory_rows}

    def gathered_bytes(self, stage: str, chosen: Mapping[str, Option]) -> float:
        """What the largest unit of parameters gathered over data parallelism adds to the device of memory
        row ``stage`` at the options ``chosen`` (decision key -> option): the solver's (12)."""
        return max((sum(count * chosen[key].gathered_bytes for key, count in members.items()
                        if self.holds(stage, key))
                    for members in self.gathered_units.values()), default=0.0)

    def with_microbatches(self, m: int, pricer: Pricer) -> "Problem":
        """The same problem priced for gradient accumulation over ``m`` microbatches (each distinct
        price once: edges share their ``Cost`` objects, ``Pricer.edge``)."""
        repriced: dict[int, tuple[Cost, Cost]] = {}

        def again(cost: Cost) -> Cost:
            if id(cost) not in repriced:
                repriced[id(cost)] = (cost, pricer.for_microbatches(cost, m))  # keeps ``cost`` alive: ids stay unique
            return repriced[id(cost)][1]

        def prices(price: dict) -> dict:  # the same dict where no price changes (most: keys hash slowly)
            costs = [again(c) for c in price.values()]
            return price if all(a is b for a, b in zip(costs, price.values())) else dict(zip(price, costs))

        def options(d: Decision) -> Decision:
            repriced = [o if (cost := again(o.cost)) is o.cost else with_fields(o, cost=cost) for o in d.options]
            return d if all(a is b for a, b in zip(repriced, d.options)) else with_fields(d, options=repriced)

        decisions = {k: options(d) for k, d in self.decisions.items()}
        edges = [e if (price := prices(e.price)) is e.price else with_fields(e, price=price) for e in self.edges]
        root_terms = [with_fields(t, delta=again(t.delta)) for t in self.root_terms]
        shared = [g if (price := prices(g.price)) is g.price else with_fields(g, price=price) for g in self.shared]
        return with_fields(self, decisions=decisions, edges=edges, microbatches=m, root_terms=root_terms, shared=shared)

    def settled(self, choice: Mapping[str, int]) -> "Problem":
        """The problem with the parameter placements of ``choice`` taken as given: each ``RootSharding``
        whose root option ``choice`` takes is folded into its consumer options' prices, and the
        problem has no such terms left. Its prices for ``choice`` are the ILP's (``solver.evaluate``),
        and an option of a consumer is priced as if taken with those placements (``planning/explanations.py``)."""
        if not self.root_terms:
            return self
        extra: dict[tuple[str, int], list[Cost]] = defaultdict(list)
        for t in self.root_terms:
            if choice[t.root] in t.root_options:
                for k in t.options:
                    extra[t.consumer, k].append(scaled_cost(t.delta, t.share))
        decisions = dict(self.decisions)
        for key in {key for key, _ in extra}:
            d = decisions[key]
            options = [with_fields(o, cost=summed_cost([o.cost, *extra[key, k]]),
                               by_mode={m: summed_cost([c, *extra[key, k]]) for m, c in o.by_mode.items()})
                       if (key, k) in extra else o for k, o in enumerate(d.options)]
            decisions[key] = with_fields(d, options=options)
        return with_fields(self, decisions=decisions, root_terms=[])

    def with_layer_modes(self, counts: dict[str, int]) -> "Problem":
        """The plain problem once ``counts[mode]`` of a device's layers run in each mode: a layer op's
        price is the mix ``sum_m counts[m] / layers * by_mode[m]`` plus, per recomputing mode in use,
        one layer's working set; an edge into an op recomputed in ``m`` pays its forward collectives
        again for that share of the layers."""
        modes = self.layer_modes
        if modes is None:
            return self
        if set(counts) - set(modes.modes) or sum(counts.values()) != modes.layers:
            raise ValueError(f"layer modes {counts} do not give the {modes.layers} layers modes of {modes.modes}")
        share = {m: counts.get(m, 0) / modes.layers for m in modes.modes}
        decisions = {k: with_fields(d, options=[settled_option(o, share, d.count) for o in d.options])
                     for k, d in self.decisions.items()}
        return with_fields(self, decisions=decisions, layer_modes=None, **settled_moves(self.edges, self.shared, share))

    def with_choice(self, choice: Mapping[str, int]) -> "Problem":
        """The problem with every decision held to option ``choice[key]``, its only option (index 0): what
        is left open is what prices an option by mode, the layers' checkpointing modes (``layer_modes``).
        Each edge keeps the one placement pair its ends take, and each root-sharding term that holds at
        ``choice`` stays on the kept options (the others cannot hold)."""
        decisions = {key: with_fields(d, options=[d.options[choice[key]]]) for key, d in self.decisions.items()}
        edges = [with_fields(e, price={pair: e.price[pair]})
                 for e in self.edges for pair in (edge_pair(self, e, choice),)]
        root_terms = [with_fields(t, options=frozenset({0}), root_options=frozenset({0}))
                      for t in self.root_terms if t.holds(choice)]
        return with_fields(self, decisions=decisions, edges=edges, root_terms=root_terms, edge_rows=None)

    def size(self) -> tuple[int, int]:
        """(options, edge placement pairs): a rough measure of the ILP."""
        return (sum(len(d.options) for d in self.decisions.values()), sum(len(e.price) for e in self.edges))


def settled_option(option: Option, share: dict[str, float], count: float) -> Option:
    """``option`` priced once ``share[m]`` of the layers run in mode ``m`` (its ``by_mode`` mixed, plus the
    working set of each recomputing mode in use; ``count``: the decision's occurrences)."""
    if not option.by_mode:
        return option
    used = [(share[m], c) for m, c in option.by_mode.items() if share[m]]
    working_set = sum(b for m, b in option.recompute_bytes.items() if share[m]) / count
    every_layer_in_one = len(used) == 1 and used[0][0] == 1.0  # its price as it is
    return option_settled_at(option, used[0][1] if every_layer_in_one else weighted_cost(used), working_set)


def option_settled_at(option: Option, cost: Cost, working_set: float) -> Option:
    """``option`` with no modes left: priced ``cost`` plus ``working_set``, the bytes per occurrence its
    recomputation needs live (``settled_option``; ``stages.stage_problem`` for one mode)."""
    if working_set:
        cost = with_fields(cost, memory_bytes=cost.memory_bytes + working_set)
    return with_fields(option, cost=cost, by_mode={}, recompute_bytes={}, working_set_bytes=working_set)


def settled_moves(edges: list[Edge], shared: list["SharedResharding"], share: dict[str, float]
                  ) -> dict[str, list]:
    """``edges`` and ``shared`` moves (keyword arguments of a ``Problem``) once ``share[m]`` of the layers
    run in mode ``m``: a move into an op recomputed in ``m`` pays its forward collectives again for that
    share of the layers."""
    again: dict[tuple[int, float], Cost] = {}  # edge prices are shared Cost objects (Pricer.edge caches them)
    settled = [with_fields(e, price=_rerun_prices(e.price, sum(share[m] for m in e.recomputed_under if m in share),
                                                  again), recomputed_under=())
               for e in edges]
    moves = [with_fields(g, price=_rerun_prices(g.price, sum(share[m] for m in g.recomputed_under(edges) if m in share),
                                                again))
             for g in shared]
    return {"edges": settled, "shared": moves}


def _rerun_prices(prices: dict, recomputed_share: float, again: dict[tuple[int, float], Cost]) -> dict:
    """``prices`` with their forward collectives run again for ``recomputed_share`` of the layers."""
    if not recomputed_share:
        return prices
    out = {}
    for pq, c in prices.items():
        if (id(c), recomputed_share) not in again:
            again[(id(c), recomputed_share)] = _with_forward_again(c, recomputed_share)
        out[pq] = again[(id(c), recomputed_share)]
    return out


def _with_forward_again(cost: Cost, times: float) -> Cost:
    """``cost`` with its forward collectives run ``times`` more (a recomputed consumer's inputs)."""
    if not cost.forward_comm_s:
        return cost
    out = with_fields(cost, comm_s=dict(cost.comm_s))
    for kind, seconds in cost.forward_comm_s.items():
        out.add_comm(kind, times * seconds)
    return out


def summed_cost(costs: Sequence[Cost]) -> Cost:
    """Field-by-field sum of ``costs`` (flags and the kernel from the first)."""
    return weighted_cost([(1.0, c) for c in costs])


def scaled_cost(cost: Cost, factor: float) -> Cost:
    return cost if factor == 1.0 else weighted_cost([(factor, cost)])


OUTPUT_KEY = "<loss>"


@dataclass(frozen=True)
class Rule:
    """A role's rule on the strategies of ops: ``allow(node, strategy)``, whether the op may run that strategy,
    and ``key(node)``, all that ``allow`` reads of the node, hashable: ops of equal keys allow the same of the
    same strategies (``Roles.allowed`` asks ``allow`` once per key and list of strategies: ops alike, such as
    a layer's elementwise ops of one shape and split, ask once)."""

    allow: Callable[[fx.Node, Strategy], bool]
    key: Callable[[fx.Node], Hashable]


ALLOW_ANY = Rule(lambda node, strategy: True, lambda node: ())
"""The rule with nothing to check (a role whose mesh dims the mesh lacks): every strategy may run. Rules
return this very object then, so that ``roles._all_of`` leaves them out of the per-strategy loop."""


@dataclass
class Roles:
    """What each mesh dimension's role allows (the planner encodes dp/tp semantics here).

    ``param``, ``user_input``, ``buffer``: candidate placements of placeholders; ``rule``: which strategies
    an op may run (``allowed``).
    """

    param: Callable[[torch.Tensor], list[Placements]]
    user_input: Callable[[torch.Tensor], list[Placements]]
    buffer: Callable[[torch.Tensor], list[Placements]]
    rule: Rule = ALLOW_ANY
    _allowed: dict[tuple[int, Hashable], tuple[list[Strategy], list[Strategy]]] = field(
        default_factory=dict, repr=False)

    def allowed(self, node: fx.Node, strategies: list[Strategy]) -> list[Strategy]:
        """Those of ``strategies`` (``node``'s) that ``rule`` allows, all of them where it allows none; asked
        once per list of strategies and rule key (on Mixtral's meshes 588,321 checks of 14,196 ops)."""
        key = (id(strategies), self.rule.key(node))
        found = self._allowed.get(key)
        if found is None:
            allowed = [s for s in strategies if self.rule.allow(node, s)] or strategies
            found = self._allowed[key] = (allowed, strategies)  # ``strategies`` held: its id stays its own
        return found[0]


def build_problem(
    captured: CapturedGraph, finder: StrategyFinder, pricer: Pricer, roles: Roles,
    memory_capacity_bytes: float, overlap_fraction: float, gathered_by_parameter: bool = False,
    edges: bool = True, priced: PricedAlike | None = None,
) -> Problem:
    """The problem of one mesh; ``gathered_by_parameter``: the plan runs on DTensor, which gathers a
    parameter sharded over data parallelism alone (``gathered_units``). Without ``edges``, the problem
    has no edges and no shared moves (``with_edges`` adds them): a relaxation of the whole one (every
    edge and move only adds to the objective and to the gradient sync, and only constrains), cheaper to
    build by half. ``priced``: what an earlier problem of the mesh, priced alike but for the ZeRO stage, left
    to read (else left there for a later one: ``PricedAlike``)."""
    graph = captured.graph
    keys = captured.tie_keys
    members: dict[str, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if _is_decision(node):
            members[keys[node.name]].append(node)
    decisions = {
        key: Decision(key, [n.name for n in nodes], _priced_options(nodes[0], captured, finder, pricer, roles,
                                                                     priced and priced.checked(pricer)),
                      occurrences=sum(captured.weight(n.name) for n in nodes))
        for key, nodes in members.items()
    }
    decisions[OUTPUT_KEY] = Decision(OUTPUT_KEY, [OUTPUT_KEY], [
        Option(Strategy((tuple([Replicate()] * len(pricer.mesh_shape)),), ()), Cost())
    ])
    _charge_working_set(captured, decisions, pricer)
    problem = Problem(tuple(pricer.mesh_shape), decisions, [], memory_capacity_bytes, overlap_fraction,
                      set(finder.unsupported), root_terms=_root_terms(captured, decisions, pricer),
                      gathered_units=gathered_units(captured, decisions, pricer, gathered_by_parameter), edge_rows={},
                      overlap_slowdown=pricer.cluster.device.overlap_slowdown)
    return with_edges(problem, captured, pricer, priced) if edges else problem


def with_edges(problem: Problem, captured: CapturedGraph, pricer: Pricer, priced: PricedAlike | None = None
               ) -> Problem:
    """``problem``, as ``build_problem`` makes it without edges, with its edges and the moves their readers
    share, priced by ``pricer`` (the one it was built with); ``priced``: as ``build_problem``'s."""
    edges, shared = _edges(captured, problem.decisions, pricer, priced and priced.checked(pricer))
    return with_fields(problem, edges=edges, shared=shared, edge_rows={})


def _is_decision(node: fx.Node) -> bool:
    if node.op == "placeholder":
        return True
    return node.op == "call_function" and not is_getitem(node)


@dataclass
class PricedAlike:
    """What one problem of a mesh prices for the mesh's later problems whose pricers differ from its own in the
    ZeRO stage alone (``search._MeshSearch.search_mesh`` builds two a mesh, with and without ZeRO-1): the
    options of the ops that read no weight (``_priced_options``) and the prices of the edges whose producer is
    no weight (``_edges``). The ZeRO stage changes what a weight costs (its placements, state and gradient
    sync: ``Pricer.gradient_collectives``, ``parameter_memory``), never the strategies of such an op (the
    roles' rules do not read it), its price, nor a resharding's (``Pricer.share_edge_prices``)."""

    signature: tuple | None = None  # the pricers' (``Pricer.edge_prices``), once one has priced here
    options: dict[str, tuple[tuple[Strategy, Cost, tuple[tuple[int, ...], ...]], ...]] = field(default_factory=dict)
    edges: dict[tuple[str, int, str, int], dict] = field(default_factory=dict)  # ``Edge.price`` by edge key

    def checked(self, pricer: Pricer) -> "PricedAlike":
        """These prices, for ``pricer``: refused where an earlier pricer here priced another mesh, dtype or
        runtime."""
        signature = pricer.edge_prices().signature
        if self.signature is None:
            self.signature = signature
        elif signature != self.signature:
            raise ValueError("prices are shared only between pricers of one mesh, dtype and runtime")
        return self


def _reads_no_weight(node: fx.Node, captured: CapturedGraph) -> bool:
    """Whether ``node`` is an op none of whose inputs is a weight (``WEIGHT_KINDS``)."""
    kinds = captured.gradient_kinds()
    return node.op == "call_function" and all(kinds[a.name] not in WEIGHT_KINDS for a in tensor_inputs(node))


def _priced_options(node: fx.Node, captured: CapturedGraph, finder: StrategyFinder, pricer: Pricer,
                    roles: Roles, priced: PricedAlike | None) -> list[Option]:
    """``_options`` of ``node``; of an op that reads no weight, as ``priced`` holds them (``PricedAlike``),
    else priced now and left there. New options every time: ``_charge_working_set`` adds to a problem's own."""
    if priced is None or not _reads_no_weight(node, captured):
        return _options(node, captured, finder, pricer, roles)
    if node.name not in priced.options:
        priced.options[node.name] = tuple((o.strategy, o.cost, o.grad_partial)
                                          for o in _options(node, captured, finder, pricer, roles))
    return [Option(strategy, cost, partial) for strategy, cost, partial in priced.options[node.name]]


def _options(node: fx.Node, captured: CapturedGraph, finder: StrategyFinder, pricer: Pricer,
             roles: Roles) -> list[Option]:
    if node.op == "placeholder":
        val = node.meta["val"]
        if node.name in captured.params:
            frozen = node.name in captured.frozen_parameters()
            accumulation = Cost() if frozen else pricer.gradient_accumulation()  # frozen: no gradient to add
            float8 = node.name in pricer.float8_weights
            return [Option(Strategy((), (p,)), with_fields(
                accumulation, memory_bytes=sum(pricer.parameter_memory(val, p, frozen, float8).values())))
                    for p in roles.param(val)]
        if node.name in captured.user_inputs:
            return [Option(Strategy((), (p,)), Cost(memory_bytes=pricer.local_bytes(val, p), batch_memory=True))
                    for p in roles.user_input(val)]
        whole = node.name in captured.written_buffers()  # its write copies a whole value into it (``buffer_writes``)
        return [Option(Strategy((), (p,)), Cost(memory_bytes=pricer.local_bytes(val, p))) for p in roles.buffer(val)
                if not whole or all(x.is_replicate() for x in p)]
    kinds = captured.gradient_kinds()
    grad_kinds = [kinds[a.name] for a in tensor_inputs(node)]
    strategies = finder.for_node(node)
    allowed = roles.allowed(node, strategies)
    kept = captured.saved_for_backward(pricer.float8)
    saved, copies = kept.of(node), kept.copies_of(node)
    views = read_through_views(node, grad_kinds)
    recomputed = node.name in kept.recomputed
    return [Option(s, pricer.node(node, s, grad_kinds, saved, views, copies, recomputed),
                   pricer.grad_partial_dims(node, s, grad_kinds, views)) for s in allowed]


def read_through_views(node: fx.Node, grad_kinds: Sequence[str]) -> list[float | None]:
    """Per tensor input of ``node``: for an activation read through a view, the share of its partial
    gradient's reduction this op pays (``partial_gradient_share``; the op prices that reduction,
    ``Pricer.gradient_collectives``), else None (priced on the input's edge)."""
    return [partial_gradient_share(a) if kind == "activation" and is_view(a) else None
            for a, kind in zip(tensor_inputs(node), grad_kinds)]


def gradient_root(arg: fx.Node) -> tuple[fx.Node, int]:
    """(producer, output index) of the value ``arg`` reads through views: whose placement says whether
    ``arg`` was gathered on its way (``RootSharding``)."""
    return source_of(view_root(arg))


def _charge_working_set(captured: CapturedGraph, decisions: dict[str, Decision], pricer: Pricer) -> None:
    """Add, once per problem, the largest working set of one op to that op's options.

    Ops are charged the bytes autograd saves (``saved_tensors.py``), all alive when forward ends.
    On top of them, an op's forward holds its inputs and outputs, and its backward the gradients of
    its outputs and of its activation inputs: tensors of the same shapes. The step's peak is bounded
    by the saved bytes plus the largest such working set (in a language model the loss's: the
    logits, their log-softmax and its gradient), which we charge to the op that has it, at the
    placements each of its strategies gives those tensors, divided among the nodes that share the
    decision so that it counts once. It is per microbatch (``batch_memory``) and held once
    (``Cost.transient_bytes``): under a pipeline, ``stages.py`` holds the op's saved activations for
    every microbatch in flight where it runs, and its working set for the one microbatch it runs on.
    """
    candidates = [n for n in captured.graph.nodes if _is_decision(n) and n.op == "call_function"
                  and not getattr(n.target, "is_view", False)]
    if not candidates:
        return
    widest = max(candidates, key=lambda n: _working_set_bytes(n, captured, pricer, None))
    decision = decisions[captured.tie_keys[widest.name]]
    for option in decision.options:
        extra = _working_set_bytes(widest, captured, pricer, option.strategy) / decision.occurrences
        option.cost = with_fields(option.cost, memory_bytes=option.cost.memory_bytes + extra,
                                  transient_bytes=option.cost.transient_bytes + extra)


GATHERED_COPIES = 2
"""Copies of a gathered unit's parameters a device holds at the step's peak. The plan's peak is the start of
backward (every activation held, ``_charge_working_set``): on the lowered runtime the unit running and the
next one gathered ahead (``passes/lower_buckets.py``, as FSDP2 prefetches); on DTensor the parameter and,
as its backward runs, its whole gradient before the reduce_scatter. Later in backward a unit's whole
gradients take the prefetched copy's place, in the compute dtype (cast to the reduction dtype as they
are reduce-scattered) while the activations of the layers behind are freed."""


def gathered_units(captured: CapturedGraph, decisions: dict[str, Decision], pricer: Pricer, by_parameter: bool
                   ) -> dict[str, dict[str, int]]:
    """Set each parameter option's ``gathered_bytes`` and return the units they are gathered by: unit ->
    {decision key: its nodes in the unit}, for the decisions with an option that gathers.

    A parameter sharded over data parallelism is gathered whole to be read (``Pricer.gathered_bytes``,
    ``GATHERED_COPIES`` of it held). The lowered runtime gathers a unit at a time
    (``ir.layers.gather_unit``: a layer, or a module outside layers) and reduce-scatters the unit's
    gradients together (``passes/lower_buckets.py``), as FSDP2 does, in one-stage programs and in each
    pipeline chunk; DTensor gathers each parameter for its reader alone, so under ``by_parameter`` (a plan
    pinned to DTensor) each parameter is its own unit. Plans priced for DTensor that run lowered by
    default (pipelines: ``roles.priced_runtime``) are held to units, on the side of caution. A device
    holds one unit's working set at a time, so the memory rows charge the largest (the solver's (12)), on
    top of the sharded parameters, the saved activations and the largest op's working set."""
    units: dict[str, dict[str, int]] = defaultdict(dict)
    for key, d in decisions.items():
        first = d.nodes[0]
        if first not in captured.params:
            continue
        val = captured.node(first).meta["val"]
        for option in d.options:
            option.gathered_bytes = GATHERED_COPIES * pricer.gathered_bytes(val, option.strategy.outputs[0])
        if not any(o.gathered_bytes for o in d.options):
            continue
        for name in d.nodes:
            path = captured.params[name]
            unit = units[path if by_parameter else gather_unit(path)]
            unit[key] = unit.get(key, 0) + 1
    return dict(units)


def _working_set_bytes(node: fx.Node, captured: CapturedGraph, pricer: Pricer, strategy: Strategy | None) -> float:
    """Bytes of ``node``'s outputs and non-parameter inputs, local under ``strategy`` (None: whole), the
    inputs backward makes again (``SavedTensors.recomputed``) twice: made beside their gradients."""
    kinds = captured.gradient_kinds()
    remade = captured.saved_for_backward(pricer.float8).recomputed
    outs, ins = output_vals(node), tensor_inputs(node)
    whole = tuple(Replicate() for _ in pricer.mesh_shape)
    out_places = strategy.outputs if strategy else [whole] * len(outs)
    in_places = strategy.inputs if strategy else [whole] * len(ins)
    total = sum(pricer.local_bytes(v, p) for v, p in zip(outs, out_places)
                if isinstance(v, torch.Tensor) and p is not None)
    total += sum(pricer.local_bytes(a.meta["val"], p) * (2 if a.name in remade else 1) for a, p in zip(ins, in_places)
                 if kinds[a.name] not in WEIGHT_KINDS)
    return total


def _root_terms(captured: CapturedGraph, decisions: dict[str, Decision], pricer: Pricer) -> list[RootSharding]:
    """Every (consumer options, root placement) pair whose gradient reduction differs from the price
    ``Pricer.node`` gave the consumer (``RootSharding``): per op reading a parameter or an activation
    through views, per such input slot, the options that read it the same way and leave the same dims
    partial, against each placement of the value the input is a view of that gathers it."""
    kinds = captured.gradient_kinds()
    terms = []
    for key, d in decisions.items():
        first = captured.node(d.nodes[0]) if key != OUTPUT_KEY else None
        if first is None or first.op != "call_function" or is_view(first):
            continue
        grad_kinds = [kinds[a.name] for a in tensor_inputs(first)]
        views = read_through_views(first, grad_kinds)
        for slot, kind in enumerate(grad_kinds):
            if kind not in WEIGHT_KINDS and views[slot] is None:
                continue
            roots = Counter(_root_key(captured, tensor_inputs(captured.node(n))[slot]) for n in d.nodes)
            for (root, out), readers in roots.items():
                terms += _slot_terms(first, d, slot, grad_kinds, views, decisions[root], out,
                                     readers / len(d.nodes), pricer)
    return terms


def _root_key(captured: CapturedGraph, arg: fx.Node) -> tuple[str, int]:
    producer, out = gradient_root(arg)
    return captured.tie_keys[producer.name], out


def _slot_terms(node: fx.Node, consumer: Decision, slot: int, grad_kinds: list[str], views: list[float | None],
                root: Decision, out: int, share: float, pricer: Pricer) -> list[RootSharding]:
    alike: dict[tuple, list[int]] = defaultdict(list)  # options that read the input the same way
    for k, o in enumerate(consumer.options):
        alike[o.strategy.inputs[slot], o.strategy.outputs[:1]].append(k)
    terms = []
    deltas = (functools.partial(pricer.gathered_root_delta, views=views),) + ((pricer.recast_root_delta,)
                                                                               if pricer.float8 else ())
    for ks, delta_of in itertools.product(alike.values(), deltas):
        strategy = consumer.options[ks[0]].strategy
        same: dict[tuple, tuple[Cost, list[int]]] = {}  # root options with the same price change share a term
        for j, r in enumerate(root.options):
            placed = r.strategy.outputs[out]
            delta = None if placed is None else delta_of(node, strategy, grad_kinds, slot, placed)
            if delta is not None:
                same.setdefault(_price_key(delta), (delta, []))[1].append(j)
        terms += [RootSharding(consumer.key, frozenset(ks), slot, root.key, frozenset(js), share, delta)
                  for delta, js in same.values()]
    return terms


def _price_key(cost: Cost) -> tuple:
    return (cost.compute_s, cost.accumulate_s, cost.grad_sync_s, cost.grad_sync_per_microbatch_s,
            tuple(sorted(cost.comm_s.items())), cost.repeated_comm_s, cost.repeats_per_microbatch)


def source_of(arg: fx.Node) -> tuple[fx.Node, int]:
    """(producer, output index) of a tensor argument, looking through ``getitem``."""
    if is_getitem(arg):
        return arg.args[0], int(arg.args[1])
    return arg, 0


def _edges(captured: CapturedGraph, decisions: dict[str, Decision], pricer: Pricer, priced: PricedAlike | None
           ) -> tuple[list[Edge], list[SharedResharding]]:
    keys = dict(captured.tie_keys)
    keys[OUTPUT_KEY] = OUTPUT_KEY
    grouped: dict[tuple[str, int, str, int], Edge] = {}
    first: dict[tuple[str, int, str, int], tuple[fx.Node, fx.Node]] = {}  # (consumer, input) of its first occurrence
    regions = reader_regions(captured.graph)
    readings: dict[tuple[str, int, str], list[tuple[tuple[str, int, str, int], float]]] = defaultdict(list)
    for node in captured.graph.nodes:
        if node.op == "output":
            consumer, args = OUTPUT_KEY, [captured.node(captured.loss_node)]
        elif _is_decision(node) and node.op == "call_function":
            consumer, args = keys[node.name], tensor_inputs(node)
        else:
            continue
        for slot, arg in enumerate(args):
            src, out = source_of(arg)
            ekey = (keys[src.name], out, consumer, slot)
            weight = _edge_weight(captured, src, node)
            if ekey in grouped:
                grouped[ekey].count += weight
            else:
                grouped[ekey] = Edge(*ekey, count=weight)
                first[ekey] = (node, arg)
            if node.op != "output":
                readings[src.name, out, regions[node]].append((ekey, weight))
    kinds = captured.gradient_kinds()  # a parameter or a view of one: the same every microbatch
    weights = {keys[name] for name, kind in kinds.items() if kind in WEIGHT_KINDS}
    sharing = _sharing_readers(readings.values(), grouped)
    shares = {ekey for group in sharing for ekey in group}
    kept = {ekey: node.op != "output" and captured.keeps_what_it_reads(node, arg, pricer.float8)
            for ekey, (node, arg) in first.items()}
    # a parameter is gathered again by each reader that keeps it; an activation's move, once for the readers
    # sharing it (one recipe, ``passes/rematerialize.py``): on the shared move, not on their edges
    regathered = {ekey: keeps and (ekey[0] in weights or ekey not in shares) for ekey, keeps in kept.items()}
    for ekey, edge in grouped.items():
        if priced is not None and edge.src not in weights and ekey in priced.edges:
            edge.price = priced.edges[ekey]
            continue
        arg = first[ekey][1]
        edge.price = _edge_prices(edge, decisions, arg.meta["val"], pricer, edge.src in weights, regathered[ekey],
                                  partial_gradient_share(arg), ekey in shares, kinds[source_of(arg)[0].name] != "none")
        if priced is not None and edge.src not in weights:
            priced.edges[ekey] = edge.price
    index = {ekey: i for i, ekey in enumerate(grouped)}
    shared = [SharedResharding(tuple(index[k] for k in group), occurrences / grouped[group[0]].count,
                               _shared_prices([grouped[k] for k in group], decisions, first[group[0]][1].meta["val"],
                                              pricer, group[0][0] in weights, any(kept[k] for k in group),
                                              kinds[source_of(first[group[0]][1])[0].name] != "none"))
              for group, occurrences in sharing.items()]
    return list(grouped.values()), [g for g in shared if g.price]


def _sharing_readers(readings: Iterable[list[tuple[tuple, float]]], edges: Mapping[tuple, Edge]
                     ) -> dict[tuple, float]:
    """Groups of edges (keys, in graph order) that share their moves, with their occurrences: per value
    and region, the edges of its readers (``readings``: edge key and occurrences of each read), where
    two or more edges do, and only where every occurrence of each of those edges lies in such a group
    with the same edges (else no group prices it, and the edges pay their whole moves)."""
    occurrences: dict[tuple, float] = defaultdict(float)
    groups_of: dict[tuple, set[tuple]] = defaultdict(set)
    for reads in readings:
        group = tuple(dict.fromkeys(ekey for ekey, _ in reads))
        if len(group) > 1:
            occurrences[group] += reads[0][1]
            for ekey in group:
                groups_of[ekey].add(group)
    covered: dict[tuple, float] = defaultdict(float)
    for group, n in occurrences.items():
        for ekey in group:
            covered[ekey] += n
    whole = {ekey for ekey, groups in groups_of.items()
             if len(groups) == 1 and math.isclose(covered[ekey], edges[ekey].count)}
    return {group: n for group, n in occurrences.items() if all(ekey in whole for ekey in group)}


def _shared_prices(edges: Sequence[Edge], decisions: dict[str, Decision], val: torch.Tensor, pricer: Pricer,
                   from_param: bool, kept: bool, gradient: bool) -> dict[tuple[Placements, Placements], Cost]:
    """The moves a ``SharedResharding`` prices: from each placement of the producer to each placement a
    reader may take, where they differ and the move costs something. A parameter its readers keep
    (``kept``) is gathered again in backward by each of them (on their edges), which a recomputed layer's
    rerun replaces, so the shared move is then not priced again under recomputation (``Pricer.edge``). An
    activation its readers keep is moved again once for all of them, here (``moved_again``)."""
    srcs = dict.fromkeys(o.strategy.outputs[edges[0].src_out] for o in decisions[edges[0].src].options)
    dsts = dict.fromkeys(o.strategy.inputs[e.slot] for e in edges for o in decisions[e.dst].options)
    prices = {}
    for a in srcs:
        for b in dsts:
            if a is None or a == b:
                continue
            again = not from_param and moved_again(kept, False, a, b, pricer.mesh_shape)
            cost = pricer.edge(val, a, b, per_microbatch=from_param, regathered=again, gradient=gradient)
            if cost.exposed_s > 0:
                prices[a, b] = with_fields(cost, forward_comm_s={}) if kept and from_param else cost
    return prices


def _edge_weight(captured: CapturedGraph, producer: fx.Node, consumer: fx.Node) -> float:
    """Occurrences in the real model of an edge of the traced graph: its consumer's when that lies in a
    traced layer, else its producer's (what follows the stack reads the last layer once, or each layer)."""
    if consumer.op != "output" and captured.traced_layer(consumer.name) is not None:
        return captured.weight(consumer.name)
    return captured.weight(producer.name)


def partial_gradient_share(arg: fx.Node) -> float:
    """The share of ``arg``'s partial-gradient reduction that one reader pays: ``1/k`` for a value read
    by ``k`` ops other than views, directly or through views of it (``autopar.planning.pricing``: the readers'
    partial gradients are summed, through the views' backward, before the one reduction)."""
    readers = {n for user in view_root(arg).users for n in through_views(user)
               if n.op == "call_function" and not is_view(n)}
    return 1.0 / max(1, len(readers))


def _edge_prices(edge: Edge, decisions: dict[str, Decision], val: torch.Tensor, pricer: Pricer,
                 from_param: bool, regathered: bool, partial_share: float, shared: bool, gradient: bool
                 ) -> dict[tuple[Placements, tuple[Placements, tuple[int, ...]]], Cost]:
    # in the options' order (a set's order would follow the hashes, which vary from run to run for
    # ``Partial``, and the order of the ILP's variables picks among equally priced plans)
    srcs = dict.fromkeys(o.strategy.outputs[edge.src_out] for o in decisions[edge.src].options)
    dsts = dict.fromkeys(o.edge_key(edge.slot) for o in decisions[edge.dst].options)
    return {(a, b): pricer.edge(val, a, b[0], per_microbatch=from_param, grad_partial=b[1],
                                regathered=moved_again(regathered, from_param, a, b[0], pricer.mesh_shape),
                                partial_share=partial_share, shared=shared, gradient=gradient)
            for a in srcs if a is not None for b in dsts}


def placeholder_candidates(mesh_shape: Sequence[int], fixed: dict[int, Placement]
                           ) -> Callable[[torch.Tensor], list[Placements]]:
    """Candidates of R/S(d) per mesh dim, with some dims pinned (e.g. ``{0: Replicate()}``)."""

    def pick(val: torch.Tensor) -> list[Placements]:
        out = []
        for c in candidate_placements(val, mesh_shape, partial=False):
            if all(c[d] == want for d, want in fixed.items() if _pin_applies(want, val)):
                out.append(c)
        return out or [tuple(Replicate() for _ in mesh_shape)]

    return pick


def _pin_applies(want: Placement, val: torch.Tensor) -> bool:
    return not (want.is_shard() and val.ndim == 0)
