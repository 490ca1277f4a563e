"""One gather per (value, placement), shared by its readers: the runtime inserts one redistribute for the
readers of a value in one region that need it in the same placement (``passes/insert_redistributes.py``),
and the ILP charges that move once (``problem.SharedResharding``, solver constraint (11)).

* the program of tiny-llama under tp=2, sp=1 (built in one process on a fake 2-rank process group) moves
  each value to each placement once per layer: one all_gather of the normed input for q, k and v, one
  for the MLP's w1 and w3;
* the plan predicts those gathers once (``inspect/collectives.py``) and the ILP prices them once; a
  traced stack (3 of 5 layers) prices and counts them as the whole model does;
* hand-built problems: one value read by three consumers pays its gather once, also when it is
  recomputed in backward; random problems with shared moves match brute force;
* on gloo: tp=2, sp=1 with full and selective recomputation (2 ranks) and as 2 pipeline stages (4 ranks)
  train like one process.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.inspect.collectives import predicted_collectives
from autopar.ir.capture import capture
from autopar.ir.layers import layer_of
from autopar.models import build_model
from autopar.passes import build_program
from autopar.passes.insert_redistributes import redistribute
from autopar.passes.rematerialize import recomputed_op
from autopar.planning.pricing import Cost
from autopar.planning.problem import Decision, Edge, LayerModes, Option, Problem, SharedResharding
from autopar.planning.solver import brute_force, evaluate, solve
from autopar.planning.strategies import Strategy
from autopar.runtime.parallel_module import mesh_for_plan

R, S0 = (Replicate(),), (Shard(0),)
BATCH = 8


@pytest.fixture(scope="module")
def llama_tp_sp(two_fake_ranks: None):
    bundle = build_model("tiny-llama", global_batch=BATCH, device="cpu", seed=0)
    plan = autopar.plan(bundle.model, bundle.example_inputs, cluster="1x2xcpu", loss_fn=bundle.loss_fn,
                        example_targets=bundle.example_targets, constraints={"tp": 2, "sp": 1})
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    return plan, build_program(plan, captured, mesh_for_plan(plan))


def _moves(program) -> list:
    graph = program.stages[0].program.graph_module.graph
    return [n for n in graph.nodes if recomputed_op(n) is redistribute]


def test_each_value_is_moved_to_each_placement_once_per_layer(llama_tp_sp) -> None:
    plan, program = llama_tp_sp
    assert plan.degrees.sp == 2
    moves = _moves(program)
    regions = Counter((n.args[0].name, tuple(n.args[1]), {layer_of(u) for u in n.users}.pop()) for n in moves)
    assert moves and max(regions.values()) == 1, regions
    assert program.redistributes == len(moves)


def test_q_k_v_read_one_gather_and_w1_w3_another(llama_tp_sp) -> None:
    plan, program = llama_tp_sp
    gathers = [n for n in _moves(program) if tuple(n.args[1]) == ("R",)]
    readers = Counter((layer_of(next(iter(n.users))), len(n.users)) for n in gathers)
    layers = {layer for layer, _ in readers} - {None}  # outside the layers: the head's input, read once
    assert len(layers) == 2, readers  # tiny-llama's two layers
    for layer in layers:
        assert readers[layer, 3] == 1 and readers[layer, 2] == 1, readers  # attention's q, k, v; MLP's w1, w3


def test_the_plan_predicts_each_shared_gather_once(llama_tp_sp) -> None:
    plan, program = llama_tp_sp
    forward = predicted_collectives(plan.to_dict(), ["forward"])
    whole = [n for n in _moves(program) if tuple(n.args[1]) == ("R",)]  # gathered, or a partial sum reduced
    assert forward["all_gather"] + forward.get("all_reduce", 0) == len(whole)


def test_a_traced_stack_prices_and_counts_shared_gathers_as_the_whole_model() -> None:
    """tiny-llama of 5 layers under tp=2, sp=1, planned from its 3 traced layers and from all 5: the
    shared moves' occurrences follow the layers they stand for (``problem._edge_weight``), so the
    step time and the collectives per step are the whole model's."""
    from autopar.cost_models import parse_cluster
    from autopar.core.constraints import Constraints
    from autopar.ir.capture import TRACED_LAYERS
    from autopar.planning.search import make_plan

    bundle = build_model("tiny-llama", overrides={"layers": 5}, global_batch=BATCH, device="meta")
    plans = []
    for traced in (TRACED_LAYERS, None):
        captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn,
                           traced_layers=traced)
        plans.append(make_plan(captured, parse_cluster("1x8xH100"), model_name="m",
                               constraints=Constraints(tp=2, sp=1)))
    reduced, full = plans
    assert reduced.degrees.sp == full.degrees.sp == 2
    assert reduced.predicted["step_time_s"] == pytest.approx(full.predicted["step_time_s"], rel=1e-4)
    assert predicted_collectives(reduced.to_dict()) == predicted_collectives(full.to_dict())


# ---- the ILP ------------------------------------------------------------------------------------

def _opt(out, inputs=(), compute=0.0) -> Option:
    return Option(Strategy(tuple(inputs), (out,)), Cost(compute_s=compute))


def _three_readers(gather_s: float, replicated_s: float, recomputed: tuple[str, ...] = (),
                   layer_modes: LayerModes | None = None) -> Problem:
    """Producer ``x`` makes its output sharded (free) or replicated (``replicated_s``); three consumers
    read it replicated. Moving S(0) -> R costs ``gather_s`` (forward all_gather), once for the three."""
    x = Decision("x", ["x"], [_opt(S0), _opt(R, compute=replicated_s)])
    readers = [Decision(k, [k], [_opt(R, [R], compute=1e-3)]) for k in ("q", "k", "v")]
    own = {(S0, (R, ())): Cost(), (R, (R, ())): Cost()}  # the edges' own prices: the move is shared
    edges = [Edge("x", 0, k, 0, 1, dict(own), recomputed_under=recomputed) for k in ("q", "k", "v")]
    gather = Cost(comm_s={"all_gather": gather_s}, forward_comm_s={"all_gather": gather_s})
    shared = [SharedResharding((0, 1, 2), 1.0, {(S0, R): gather})]
    return Problem((4,), {d.key: d for d in (x, *readers)}, edges, 1e30, 0.8, layer_modes=layer_modes,
                   shared=shared)


@pytest.mark.parametrize("gather_s, replicated_s, sharded", [(1e-3, 2e-3, True), (1e-3, 0.5e-3, False),
                                                             (0.9e-3, 1e-3, True)])
def test_one_value_read_by_three_consumers_pays_its_gather_once(gather_s, replicated_s, sharded) -> None:
    """3 ms of compute, plus the gather once (1 ms, not 3) or the producer's replicated compute: with
    the gather at 0.9 ms against 1 ms replicated, charging it three times would pick R instead."""
    p = _three_readers(gather_s, replicated_s)
    solution = solve(p)
    assert solution.choice["x"] == (0 if sharded else 1)
    expected = 3e-3 + (gather_s if sharded else replicated_s)
    assert math.isclose(solution.objective_s, expected, rel_tol=1e-9)
    assert math.isclose(evaluate(p, solution.choice)[0], expected, rel_tol=1e-9)


def test_a_shared_gather_in_a_recomputed_layer_runs_again_once_per_recomputed_layer() -> None:
    """Two layers, one in mode ``full``: the shared gather runs once per layer, and once more for the
    recomputed one (the readers' own prices recompute nothing here)."""
    none = Cost(compute_s=1e-3)
    modes = LayerModes(2, ("none", "full"))
    p = _three_readers(1e-3, 5e-3, recomputed=("full",), layer_modes=modes)
    readers = {k: Decision(k, [k], [Option(Strategy((R,), (R,)), none, by_mode={"none": none, "full": none})])
               for k in ("q", "k", "v")}
    p.decisions.update(readers)
    for e in p.edges:  # two layers' worth: the group's count follows its first edge's
        e.count = 2.0
    step, _ = evaluate(p, {"x": 0, "q": 0, "k": 0, "v": 0}, {"none": 1, "full": 1})
    assert math.isclose(step, 3e-3 + 2 * 1e-3 + 1e-3, rel_tol=1e-9)
    solution = solve(p)
    assert math.isclose(solution.objective_s, brute_force(p).step_s, rel_tol=1e-6)


def _random_problem(seed: int) -> Problem:
    """A producer with 2-3 placements read by 2-4 consumers of 1-3 options each, some edges grouped
    into a shared move, with random prices."""
    rng = random.Random(seed)
    places = [R, S0, (Shard(1),)][:rng.randint(2, 3)]
    x = Decision("x", ["x"], [_opt(p, compute=rng.uniform(0, 2e-3)) for p in places])
    names = [f"c{i}" for i in range(rng.randint(2, 4))]
    readers = [Decision(k, [k], [_opt(R, [q], compute=rng.uniform(0, 2e-3))
                                 for q in rng.sample(places, rng.randint(1, len(places)))]) for k in names]
    edges = []
    for d in readers:
        qs = dict.fromkeys(o.strategy.inputs[0] for o in d.options)
        edges.append(Edge("x", 0, d.key, 0, 1, {(p, (q, ())): Cost(comm_s={"all_reduce": rng.uniform(0, 1e-4)})
                                                   for p in places for q in qs}))
    moves = {(p, q): Cost(comm_s={"all_gather": rng.uniform(0, 2e-3)}) for p in places for q in places if p != q}
    group = tuple(sorted(rng.sample(range(len(edges)), rng.randint(2, len(edges)))))
    return Problem((4,), {d.key: d for d in (x, *readers)}, edges, 1e30, 0.8,
                   shared=[SharedResharding(group, 1.0, moves)])


@pytest.mark.parametrize("seed", range(12))
def test_random_problems_with_shared_moves_match_brute_force(seed: int) -> None:
    p = _random_problem(seed)
    solution = solve(p)
    best = brute_force(p)
    assert math.isclose(solution.objective_s, best.step_s, rel_tol=1e-6), (solution.objective_s, best)
    assert math.isclose(evaluate(p, solution.choice)[0], best.step_s, rel_tol=1e-6)


# ---- on gloo ----------------------------------------------------------------------------------------

@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_shared_gathers_in_recomputed_layers_match_single_process() -> None:
    """3 SGD steps of tiny-llama under tp=2, sp=1 with every layer recomputed (full, selective), and on
    4 ranks as 2 pipeline stages of tp=2, sp=1: a shared gather inside a checkpointed layer runs again
    in its recompute, and one inside a stage program stays there; gradients, losses and parameters
    match one process."""
    from autopar.testing.parity import train_parallel_many, train_single

    single = train_single("tiny-llama", None, BATCH, None, 3)
    for world, cases in ((2, [{"tp": 2, "sp": 1, "checkpointing": mode} for mode in ("full", "selective")]),
                         (4, [{"pp": 2, "tp": 2, "sp": 1, "microbatches": 2}])):
        results = train_parallel_many(world, [dict(name="tiny-llama", overrides=None, global_batch=BATCH, seq=None,
                                                   steps=3, plan=None, constraints=c) for c in cases])
        for constraints, result in zip(cases, results):
            assert result.plan["degrees"]["sp"] == 2, constraints
            assert result.plan["checkpointing"] == constraints.get("checkpointing", "none"), constraints
            result.assert_matches(single)
