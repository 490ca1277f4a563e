"""Unit tests of the placement ILP (autopar.planning.solver): hand-built problems with known optima, random
problems against brute force, and a problem built from a real captured graph. No processes."""

from __future__ import annotations

import dataclasses
import math
import random
import re

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.core.errors import NoFeasiblePlanError
from autopar.planning.pricing import Cost
from autopar.planning.problem import Decision, Edge, LayerModes, Option, Problem, RootSharding
from autopar.planning.solver import (Pruned, brute_force, build_model, cannot_beat, evaluate, least_memory,
                                     least_time, solve)
from autopar.planning.strategies import Strategy

GIB = 2.0**30
R, S0, S1, P = (Replicate(),), (Shard(0),), (Shard(1),), (Partial(),)


def opt(out, inputs=(), *, compute=0.0, comm=None, sync=0.0, bwd=0.0, mem=0.0) -> Option:
    return Option(Strategy(tuple(inputs), (out,)),
                  Cost(compute_s=compute, comm_s=dict(comm or {}), grad_sync_s=sync, memory_bytes=mem,
                       backward_compute_s=bwd))


def dec(key, options, count=1) -> Decision:
    return Decision(key, [f"{key}#{i}" for i in range(count)], list(options))


def problem(decisions, edges=(), capacity=1e30, beta=0.8, mesh=(4,)) -> Problem:
    return Problem(tuple(mesh), {d.key: d for d in decisions}, list(edges), capacity, beta)


def close(a, b, rel=1e-9):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-15)


def check_against_brute_force(p: Problem):
    sol = solve(p)
    choice, best, _ = brute_force(p)
    step, memory = evaluate(p, sol.choice)
    assert close(step, best), (step, best)
    assert close(sol.objective_s, best), (sol.objective_s, best)
    assert memory <= p.memory_capacity_bytes
    return sol, choice, best


# ---- (a) hand-built problems ------------------------------------------------------------------

def _flip_problem(reshard_s: float, edge_count: int = 1) -> Problem:
    # producer a: R is cheaper (1.0 ms) than S(0) (1.5 ms); consumer b needs S(0).
    a = dec("a", [opt(R, compute=1.0e-3), opt(S0, compute=1.5e-3)])
    b = dec("b", [opt(R, [S0], compute=1.0e-3)])
    price = {(R, (S0, ())): Cost(comm_s={"all_gather": reshard_s}), (S0, (S0, ())): Cost()}
    return problem([a, b], [Edge("a", 0, "b", 0, edge_count, price)])


@pytest.mark.parametrize("reshard_s, want_a, want_s", [
    (0.2e-3, 0, 2.2e-3),  # cheap resharding: keep the cheaper producer and pay the edge
    (1.0e-3, 1, 2.5e-3),  # expensive resharding flips the producer to what the consumer needs
])
def test_edge_resharding_cost_flips_the_choice(reshard_s, want_a, want_s):
    p = _flip_problem(reshard_s)
    sol = solve(p)
    assert sol.choice == {"a": want_a, "b": 0}
    assert close(sol.objective_s, want_s)
    assert close(evaluate(p, sol.choice)[0], want_s)
    assert brute_force(p) == ({"a": want_a, "b": 0}, pytest.approx(want_s, rel=1e-12), {})


@pytest.mark.parametrize("count, want_a, want_s", [(1, 0, 2.3e-3), (2, 1, 2.5e-3)])
def test_edge_count_multiplies_its_price(count, want_a, want_s):
    sol = solve(_flip_problem(0.3e-3, edge_count=count))
    assert sol.choice["a"] == want_a
    assert close(sol.objective_s, want_s)


def test_decision_count_multiplies_node_cost():
    # one node: option 0 costs 1 ms + 1.2 ms resharding = 2.2 ms > option 1's 2 ms -> option 1.
    # three tied nodes: 3 ms + 1.2 ms = 4.2 ms beats 3 x 2 ms = 6 ms -> option 0.
    def build(count):
        a = dec("a", [opt(R, compute=1.0e-3), opt(S0, compute=2.0e-3)], count=count)
        b = dec("b", [opt(R, [S0])])
        price = {(R, (S0, ())): Cost(comm_s={"all_gather": 1.2e-3}), (S0, (S0, ())): Cost()}
        return problem([a, b], [Edge("a", 0, "b", 0, 1, price)])

    one, three = solve(build(1)), solve(build(3))
    assert one.choice["a"] == 1 and close(one.objective_s, 2.0e-3)
    assert three.choice["a"] == 0 and close(three.objective_s, 4.2e-3)


@pytest.mark.parametrize("capacity_gib, want", [(20, 0), (5, 1)])
def test_memory_constraint_excludes_the_cheapest_option(capacity_gib, want):
    w = dec("w", [opt(R, compute=1e-3, mem=10 * GIB), opt(S0, compute=2e-3, mem=1 * GIB)])
    p = problem([w], capacity=capacity_gib * GIB)
    sol = solve(p)
    assert sol.choice == {"w": want}
    assert close(sol.objective_s, [1e-3, 2e-3][want])
    assert evaluate(p, sol.choice)[1] <= p.memory_capacity_bytes


def test_memory_counts_every_tied_node():
    # 3 nodes x 2 GiB = 6 GiB does not fit 5 GiB even though one node's 2 GiB would.
    w = dec("w", [opt(R, compute=1e-3, mem=2 * GIB), opt(S0, compute=2e-3, mem=0.5 * GIB)], count=3)
    assert solve(problem([w], capacity=5 * GIB)).choice == {"w": 1}
    assert solve(problem([w], capacity=7 * GIB)).choice == {"w": 0}


def test_memory_is_shared_between_decisions():
    # Only one of a, b can take its fast 3 GiB option under 4.5 GiB: giving it to a saves more time.
    a = dec("a", [opt(R, compute=1e-3, mem=3 * GIB), opt(S0, compute=3e-3, mem=1 * GIB)])
    b = dec("b", [opt(R, compute=1e-3, mem=3 * GIB), opt(S0, compute=2e-3, mem=1 * GIB)])
    p = problem([a, b], capacity=4.5 * GIB)
    sol = solve(p)
    assert sol.choice == {"a": 0, "b": 1}
    assert close(sol.objective_s, 3e-3)
    assert brute_force(p)[0] == sol.choice


@pytest.mark.parametrize("beta, want, want_s", [
    # option 0: 1.0 ms compute (0.6 ms of it backward) + sync 1.0 ms -> z = max(0, 1.0 - beta * 0.6)
    # option 1: 1.5 ms compute (1.0 ms backward) + sync 0.2 ms -> z = max(0, 0.2 - beta * 1.0) = 0
    (0.5, 1, 1.5e-3),  # option 0 would cost 1.0 + 0.7 = 1.7 ms
    (1.0, 0, 1.4e-3),  # option 0 costs 1.0 + 0.4 = 1.4 ms
    (0.0, 1, 1.7e-3),  # no overlap: option 0 costs 1.0 + 1.0 = 2.0 ms, option 1 1.5 + 0.2 = 1.7 ms
])
def test_gradient_overlap_term(beta, want, want_s):
    d = dec("d", [opt(R, compute=1.0e-3, bwd=0.6e-3, sync=1.0e-3),
                  opt(S0, compute=1.5e-3, bwd=1.0e-3, sync=0.2e-3)])
    p = problem([d], beta=beta)
    sol = solve(p)
    assert sol.choice == {"d": want}
    assert close(sol.objective_s, want_s)
    assert close(evaluate(p, sol.choice)[0], want_s)


def test_gradient_overlap_is_one_budget_for_the_whole_step():
    # a's backward (2 ms, 80% usable) hides b's 1 ms gradient sync completely, so b keeps the option
    # without compute; a per-decision overlap would charge b 1 ms and pick its 0.5 ms option instead.
    a = dec("a", [opt(R, compute=2e-3, bwd=2e-3)])
    b = dec("b", [opt(R, sync=1e-3), opt(S0, compute=0.5e-3)])
    sol = solve(problem([a, b], beta=0.8))
    assert sol.choice == {"a": 0, "b": 0}
    assert close(sol.objective_s, 2e-3)
    # without enough backward to hide behind, the exposed part z = 1 - 0.8 * 0.25 = 0.8 ms counts
    a_small = dec("a", [opt(R, compute=0.25e-3, bwd=0.25e-3)])
    b_sync_only = dec("b", [opt(R, sync=1e-3)])
    sol = solve(problem([a_small, b_sync_only], beta=0.8))
    assert close(sol.objective_s, 0.25e-3 + 0.8e-3)


def test_evaluate_by_hand():
    a = dec("a", [opt(R, compute=1e-3, comm={"all_reduce": 0.5e-3}, sync=2e-3, bwd=1e-3, mem=1 * GIB)], count=2)
    b = dec("b", [opt(S0, [R], compute=3e-3, mem=2 * GIB)])
    p = problem([a, b], [Edge("a", 0, "b", 0, 3, {(R, (R, ())): Cost(comm_s={"all_gather": 0.1e-3})})], beta=0.5)
    step, memory = evaluate(p, {"a": 0, "b": 0})
    # nodes: 2 * 1.5 + 3 = 6 ms; edge 3 * 0.1 = 0.3 ms; z = 2 * 2 - 0.5 * 2 * 1 = 3 ms
    assert close(step, 9.3e-3)
    assert memory == 4 * GIB
    assert close(solve(p).objective_s, 9.3e-3)


def test_solution_reports_status_size_and_bounds():
    p = _flip_problem(1e-3)
    sol = solve(p)
    assert sol.status == "optimal"
    assert sol.gap == 0.0
    assert close(sol.bound_s, sol.objective_s, rel=1e-6)
    n_x = sum(len(d.options) for d in p.decisions.values())
    n_y = sum(len(e.price) for e in p.edges)
    assert sol.variables >= n_x + n_y
    assert sol.constraints >= len(p.decisions)
    assert sol.wall_s >= 0.0


# ---- (b) random problems: ILP == brute force -------------------------------------------------

_PLACEMENTS = [R, S0, S1, P]


def random_problem(seed: int) -> Problem:
    rng = random.Random(seed)
    n = rng.randint(2, 8)
    keys = [f"d{i}" for i in range(n)]
    incoming: dict[str, list[str]] = {k: [] for k in keys}
    for j in range(1, n):
        for i in rng.sample(range(j), k=min(j, rng.randint(1, 2))):
            incoming[keys[j]].append(keys[i])
        if rng.random() < 0.2:  # tied repeated layers feed themselves
            incoming[keys[j]].append(keys[j])
    decisions = {}
    for k in keys:
        options = []
        for _ in range(rng.randint(2, 3)):
            strategy = Strategy(tuple(rng.choice(_PLACEMENTS) for _ in incoming[k]), (rng.choice(_PLACEMENTS),))
            comm = {"all_reduce": rng.uniform(0, 1e-3)} if rng.random() < 0.5 else {}
            cost = Cost(compute_s=rng.uniform(0, 1e-3), comm_s=comm, grad_sync_s=rng.uniform(0, 2e-3),
                        backward_compute_s=rng.uniform(0, 1e-3), memory_bytes=rng.uniform(0, 4 * GIB))
            options.append(Option(strategy, cost))
        decisions[k] = Decision(k, [f"{k}#{c}" for c in range(rng.randint(1, 3))], options)
    edges = []
    for k in keys:
        for slot, src in enumerate(incoming[k]):
            outs = dict.fromkeys(o.strategy.outputs[0] for o in decisions[src].options)  # a set's order
            ins = dict.fromkeys(o.edge_key(slot) for o in decisions[k].options)  # would follow the hash seed
            price = {(a, b): Cost(comm_s={} if a == b[0] else {"all_gather": rng.uniform(0, 2e-3)})
                     for a in outs for b in ins}
            edges.append(Edge(src, 0, k, slot, rng.randint(1, 3), price))
    lo = sum(d.count * min(o.cost.memory_bytes for o in d.options) for d in decisions.values())
    hi = sum(d.count * max(o.cost.memory_bytes for o in d.options) for d in decisions.values())
    return Problem((4,), decisions, edges, lo + rng.uniform(0.2, 1.1) * (hi - lo), rng.uniform(0.0, 1.0))


SEEDS = list(range(24))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_problem_matches_brute_force(seed):
    p = random_problem(seed)
    assert 2 <= len(p.decisions) <= 8
    sol, _, _ = check_against_brute_force(p)
    assert sol.status == "optimal"
    assert sol.variables >= sum(len(d.options) for d in p.decisions.values())
    assert sol.constraints >= len(p.decisions)
    assert set(sol.choice) == set(p.decisions)
    assert all(0 <= k < len(p.decisions[key].options) for key, k in sol.choice.items())



@pytest.mark.parametrize("seed", SEEDS)
def test_the_relaxation_prunes_only_cutoffs_the_optimum_does_not_beat(seed):
    """``cannot_beat``: the LP relaxation never prunes a cutoff the optimum beats (under a bubble ``f`` the
    optimum's step is at most ``(1 + f)`` times its objective), and on these problems it proves the
    cutoff halfway between the least time and the optimum unbeatable, as the ILP does (``Pruned``)."""
    p = random_problem(seed)
    _, best, _ = brute_force(p)
    assert not cannot_beat(p, best * (1 + 1e-6))
    assert not cannot_beat(p, 1.25 * best * (1 + 1e-6), bubble_fraction=0.25)
    halfway = (least_time(p) + best) / 2
    assert least_time(p) < halfway < best
    assert cannot_beat(p, halfway)
    with pytest.raises(Pruned):
        solve(p, cutoff_s=halfway)


def test_random_problems_exercise_memory_and_overlap():
    """The property test above is only as good as its problems: some must be memory-bound and some
    must leave gradient sync exposed at the optimum."""
    memory_bound = exposed_sync = 0
    for seed in SEEDS:
        p = random_problem(seed)
        best = brute_force(p).step_s
        free_best = brute_force(dataclasses.replace(p, memory_capacity_bytes=math.inf)).step_s
        memory_bound += best > free_best * (1 + 1e-9)
        choice = solve(p).choice
        sync = sum(d.count * d.options[choice[k]].cost.grad_sync_s for k, d in p.decisions.items())
        hide = sum(d.count * p.overlap_fraction * d.options[choice[k]].cost.backward_compute_s
                   for k, d in p.decisions.items())
        exposed_sync += sync > hide
    assert memory_bound >= 3
    assert exposed_sync >= 3


# ---- (c) a problem from a real captured graph -------------------------------------------------

class _TiedStack(nn.Module):
    """Two identical Linear layers in a ModuleList: their nodes share decisions (tied layers)."""

    def __init__(self, dim: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("seed", SEEDS[:8])
def test_every_row_of_the_model_lists_its_variables_once_in_ascending_order(seed, wide_problem):
    """What ``Ilp.sorted_row`` takes on trust from its callers (rows (1), (2) and (11) are written as they
    are made, unsorted and unmerged): every row of a built model, those of ``Ilp.row`` alike, lists each
    variable once and in ascending order, as MathOpt's sparse matrix wants it. Random problems have
    decisions that feed themselves (tied layers): an edge whose producer and consumer rows are one
    decision's."""
    for p in (random_problem(seed), random_layered_problem(seed), wide_problem):
        model = build_model(p, cutoff_s=1.0, bubble_fraction=0.1)[0]
        rows, columns, _ = model.entries
        by_row: dict[int, list[int]] = {}
        for row, column in zip(rows, columns):
            by_row.setdefault(row, []).append(column)
        assert rows == sorted(rows)
        assert all(cols == sorted(set(cols)) for cols in by_row.values())


def _real_problem(dim: int, batch: int):
    from autopar.ir.capture import capture
    from autopar.cost_models import parse_cluster, usable_bytes
    from autopar.planning.pricing import Pricer
    from autopar.planning.problem import Roles, build_problem, placeholder_candidates
    from autopar.planning.strategies import StrategyFinder

    with torch.device("meta"):
        model = _TiedStack(dim)
    x = torch.randn(batch, dim, device="meta")
    y = torch.randn(batch, dim, device="meta")
    captured = capture(model, (x,), y, nn.functional.mse_loss)
    mesh = (2,)
    cluster = parse_cluster("1x2xH100")
    cands = placeholder_candidates(mesh, {})
    roles = Roles(param=cands, user_input=cands, buffer=cands)
    return build_problem(captured, StrategyFinder(mesh), Pricer(cluster, mesh, "bf16"), roles,
                         usable_bytes(cluster.device), 0.8)


@pytest.fixture(scope="module")
def wide_problem():
    return _real_problem(dim=4096, batch=8)


@pytest.fixture(scope="module")
def tall_problem():
    return _real_problem(dim=1024, batch=8192)


def test_real_graph_problem_is_small_and_tied(wide_problem):
    p = wide_problem
    assert len(p.decisions) <= 10
    assert any(d.count == 2 for d in p.decisions.values()), "the two layers should share decisions"
    assert any(e.src == e.dst for e in p.edges), "layer 0's output feeds the tied layer 1"
    assert math.prod(len(d.options) for d in p.decisions.values()) <= 200_000
    assert all(len(d.options) >= 1 for d in p.decisions.values())


def test_real_graph_solver_matches_brute_force(wide_problem):
    sol, _, best = check_against_brute_force(wide_problem)
    assert best > 0
    assert sol.status == "optimal"


def test_real_graph_memory_cap_changes_the_optimum(tall_problem):
    free = solve(tall_problem)
    _, free_memory = evaluate(tall_problem, free.choice)
    cap = 0.9 * free_memory
    assert least_memory(tall_problem) < cap  # a cheaper-in-memory plan exists
    capped = dataclasses.replace(tall_problem, memory_capacity_bytes=cap)
    sol, _, best = check_against_brute_force(capped)
    assert sol.choice != free.choice
    assert evaluate(capped, sol.choice)[1] <= cap
    assert best >= free.objective_s * (1 - 1e-9)  # a tighter cap never makes the step faster


# ---- (d) infeasible memory -----------------------------------------------------------------------

def test_infeasible_memory_raises_with_gib_message():
    w = dec("w", [opt(R, mem=4 * GIB), opt(S0, mem=3 * GIB)], count=2)
    p = problem([w], capacity=4 * GIB)
    with pytest.raises(NoFeasiblePlanError) as info:
        solve(p)
    msg = str(info.value)
    assert re.search(r"6\.00 GiB per device", msg), msg  # the least any plan needs
    assert re.search(r"capacity of 4\.00 GiB", msg), msg  # the capacity
    with pytest.raises(NoFeasiblePlanError):
        brute_force(p)


def test_infeasible_real_graph_raises(wide_problem):
    p = dataclasses.replace(wide_problem, memory_capacity_bytes=1024.0)
    with pytest.raises(NoFeasiblePlanError, match=r"need 288\.32 MiB per device, 288\.32 MiB more than the capacity of 1\.00 KiB"):
        solve(p)


# ---- (d) per-layer activation checkpointing: modes chosen by the ILP ---------------------------

MODES = ("none", "selective", "full")


def random_layered_problem(seed: int) -> Problem:
    """``random_problem`` whose first decisions are ops of ``L`` repeated layers, each priced per
    checkpointing mode (recomputation adds compute, frees memory but holds one layer's working set),
    and whose edges into them rerun forward collectives when recomputed."""
    rng = random.Random(1000 + seed)
    p = random_problem(seed)
    layers = rng.randint(2, 5)
    layered = [k for k in p.decisions if k != "d0"][: rng.randint(1, 3)]
    decisions = dict(p.decisions)
    for k in layered:
        d = decisions[k]
        decisions[k] = dataclasses.replace(d, options=[_by_mode(o, rng, d.count, layers) for o in d.options])
    recomputed = {"selective": set(layered[:1]), "full": set(layered)}
    edges = []
    for e in p.edges:
        under = tuple(m for m in MODES if e.dst in recomputed.get(m, ()))
        price = {pq: dataclasses.replace(c, forward_comm_s=dict(c.comm_s)) if c.comm_s and under else c
                 for pq, c in e.price.items()}
        edges.append(dataclasses.replace(e, price=price, recomputed_under=under))
    out = dataclasses.replace(p, decisions=decisions, edges=edges, layer_modes=LayerModes(layers, MODES))
    lo, hi = least_memory(out), least_memory(out.with_layer_modes({"none": layers}))
    return dataclasses.replace(out, memory_capacity_bytes=lo + rng.uniform(0.2, 1.1) * (hi - lo))


def _by_mode(option: Option, rng: random.Random, count: float, layers: int) -> Option:
    c = option.cost
    by_mode = {"none": c,
               "selective": dataclasses.replace(c, compute_s=c.compute_s * 1.2, memory_bytes=c.memory_bytes * 0.5,
                                                backward_compute_s=c.backward_compute_s * 1.2),
               "full": dataclasses.replace(c, compute_s=c.compute_s * 1.33, memory_bytes=0.0,
                                           backward_compute_s=c.backward_compute_s * 1.5)}
    working = {"selective": c.memory_bytes * 0.3 * count / layers, "full": c.memory_bytes * 0.6 * count / layers}
    return dataclasses.replace(option, by_mode=by_mode, recompute_bytes=working)


LAYERED_SEEDS = list(range(12))


@pytest.mark.parametrize("seed", LAYERED_SEEDS)
def test_layer_modes_match_brute_force(seed):
    """Constraints (5)-(8) make the ILP exact: its optimum over placements and per-layer modes equals
    enumeration of both, and its objective is the settled problem's price of its own answer."""
    p = random_layered_problem(seed)
    sol = solve(p)
    best = brute_force(p)
    assert sum(sol.layer_modes.values()) == p.layer_modes.layers
    step, memory = evaluate(p, sol.choice, sol.layer_modes)
    assert close(step, best.step_s, rel=1e-6), (step, best)
    assert close(sol.objective_s, step, rel=1e-6)
    assert memory <= p.memory_capacity_bytes * (1 + 1e-9)


@pytest.mark.parametrize("seed", LAYERED_SEEDS)
def test_the_optimums_placements_held_leave_its_layer_modes_optimal(seed):
    """``Problem.with_choice`` (the planner's per-layer refinement holds the winner's placements): held
    at the joint optimum's placements, the ILP over the layers' modes alone reaches the joint optimum,
    and the modes it picks are priced so on the whole problem."""
    p = random_layered_problem(seed)
    joint = solve(p)
    held = p.with_choice(joint.choice)
    assert all(len(d.options) == 1 for d in held.decisions.values()) and all(len(e.price) == 1 for e in held.edges)
    modes = solve(held)
    assert close(modes.objective_s, joint.objective_s, rel=1e-6), (modes, joint)
    step, memory = evaluate(p, joint.choice, modes.layer_modes)
    assert close(step, modes.objective_s, rel=1e-6)
    assert memory <= p.memory_capacity_bytes * (1 + 1e-9)


def test_layered_problems_mix_modes():
    """The property test above is only as good as its problems: in some the best plan recomputes some
    layers in one mode and others in another, in some every layer runs in one mode."""
    mixes = [brute_force(random_layered_problem(seed)).layer_modes for seed in LAYERED_SEEDS]
    assert sum(sum(1 for n in counts.values() if n) > 1 for counts in mixes) >= 3, mixes
    assert any(max(counts.values()) == sum(counts.values()) for counts in mixes), mixes


def test_settled_problem_prices_the_mix_by_hand():
    """Two layers, one op: 1 ms and 4 GiB kept (none) or 1.5 ms and a 1 GiB working set (full);
    its input edge runs a 0.2 ms forward all_gather, again when recomputed. One layer of each: 1.25 ms
    + 2 GiB per occurrence (x2 layers), plus the working set once; the edge pays 0.2 ms + 0.1 ms."""
    none = Cost(compute_s=1e-3, memory_bytes=4 * GIB, batch_memory=True)
    full = Cost(compute_s=1.5e-3, batch_memory=True)
    op = Option(Strategy((S0,), (S0,)), none, by_mode={"none": none, "full": full}, recompute_bytes={"full": 1 * GIB})
    src = dec("x", [opt(R)])
    gather = Cost(comm_s={"all_gather": 2e-4}, forward_comm_s={"all_gather": 2e-4})
    p = Problem((4,), {"x": src, "op": dec("op", [op], count=2)},
                [Edge("x", 0, "op", 0, 2, {(R, (S0, ())): gather}, recomputed_under=("full",))],
                1e30, 0.8, layer_modes=LayerModes(2, ("none", "full")))
    step, memory = evaluate(p, {"x": 0, "op": 0}, {"none": 1, "full": 1})
    assert close(step, 2 * 1.25e-3 + 2 * 2e-4 + 2 * 0.5 * 2e-4)
    assert close(memory, 2 * 2 * GIB + 1 * GIB)
    with pytest.raises(ValueError, match="do not give the 2 layers"):
        p.with_layer_modes({"none": 1})


# ---- (e) prices of two decisions together: constraint (9) -------------------------------------

def _fsdp_or_ddp_problem(capacity_gib: float, beta: float = 0.0) -> Problem:
    """A weight ``w`` (R: 4 GiB of state; S(0): 1 GiB) read ``R`` by op ``mm``, which leaves its gradient
    partial. ``mm`` alone assumes the gradient sync: 1 ms, overlappable. With ``w`` sharded the edge
    gathers it (0.4 ms) and the gather's backward reduce-scatters the gradient instead (0.5 ms on the
    critical path, no gradient sync): the RootSharding term's price change."""
    w = dec("w", [opt(R, mem=4 * GIB), opt(S0, mem=1 * GIB)])
    mm = dec("mm", [opt(S0, [R], compute=2e-3, bwd=1e-3, sync=1e-3)])
    price = {(R, (R, ())): Cost(), (S0, (R, ())): Cost(comm_s={"all_gather": 0.4e-3})}
    term = RootSharding("mm", frozenset({0}), 0, "w", frozenset({1}), 1.0,
                        Cost(comm_s={"reduce_scatter": 0.5e-3}, grad_sync_s=-1e-3))
    return Problem((4,), {"w": w, "mm": mm}, [Edge("w", 0, "mm", 0, 1, price)], capacity_gib * GIB, beta,
                   root_terms=[term])


@pytest.mark.parametrize("capacity_gib, beta, want_w, want_s", [
    (10, 0.0, 1, 2.9e-3),  # no overlap: DDP costs 2 + 1 ms of sync, FSDP 2 + 0.4 + 0.5 ms
    (10, 0.8, 0, 2.2e-3),  # DDP's sync hides behind 0.8 ms of backward: 2 + 0.2 ms; FSDP still 2.9 ms
    (2, 0.8, 1, 2.9e-3),   # only FSDP fits
])
def test_a_gathered_parameter_trades_its_gradient_sync_for_a_reduce_scatter(capacity_gib, beta, want_w, want_s):
    p = _fsdp_or_ddp_problem(capacity_gib, beta)
    sol = solve(p)
    assert sol.choice["w"] == want_w
    assert close(sol.objective_s, want_s)
    assert close(evaluate(p, sol.choice)[0], want_s)
    assert close(evaluate(p, {"w": 1, "mm": 0})[0], 2.9e-3)  # FSDP: no sync left to expose
    assert close(brute_force(p).step_s, want_s)


def test_no_fit_under_an_infinite_cutoff_is_no_fit_not_pruned():
    """A search's first solve of a mesh has nothing to beat (cutoff infinite). Where memory leaves no plan
    that the cheap bound sees (here a root term's 5 GiB: sharded ``w`` needs 1 + 5 GiB, whole 4, of 3),
    the ILP must say nothing fits: "pruned" made the search report "no mesh shape satisfies the
    constraints" for a pinned mesh that did not fit memory."""
    p = _fsdp_or_ddp_problem(3)
    p = dataclasses.replace(p, root_terms=[dataclasses.replace(p.root_terms[0], delta=Cost(memory_bytes=5 * GIB))])
    assert least_memory(p) <= p.memory_capacity_bytes
    with pytest.raises(NoFeasiblePlanError):
        solve(p, cutoff_s=math.inf)


@pytest.mark.parametrize("choice, want_s", [({"w": 0, "mm": 0}, 3.0e-3), ({"w": 1, "mm": 0}, 2.9e-3)])
def test_a_held_choice_keeps_the_root_terms_that_hold_there(choice, want_s):
    """``Problem.with_choice`` keeps a term where the choice takes both its options (FSDP's reduce_scatter
    in place of the sync), and drops it where it cannot hold (DDP), so its ILP prices the choice as
    the whole problem does."""
    p = _fsdp_or_ddp_problem(10)
    held = p.with_choice(choice)
    assert len(held.root_terms) == choice["w"]
    assert close(solve(held).objective_s, want_s) and close(evaluate(p, choice)[0], want_s)


def test_settled_problem_folds_the_terms_of_the_chosen_root_only():
    p = _fsdp_or_ddp_problem(10)
    ddp, fsdp = p.settled({"w": 0, "mm": 0}), p.settled({"w": 1, "mm": 0})
    assert not ddp.root_terms and not fsdp.root_terms
    assert ddp.decisions["mm"].options[0].cost.grad_sync_s == pytest.approx(1e-3)
    mm = fsdp.decisions["mm"].options[0].cost
    assert mm.grad_sync_s == pytest.approx(0.0) and mm.comm_s == {"reduce_scatter": pytest.approx(0.5e-3)}


def _with_root_terms(p: Problem, seed: int) -> Problem:
    """``p`` with random terms pairing a decision's options with another decision's option, prices of
    either sign (as ``Pricer.gathered_root_delta`` gives: critical path up, gradient sync down)."""
    rng = random.Random(1000 + seed)
    keys = list(p.decisions)
    terms = []
    for _ in range(rng.randint(1, 4)):
        consumer, root = rng.sample(keys, 2)
        options = frozenset(rng.sample(range(len(p.decisions[consumer].options)), rng.randint(1, 2)))
        delta = Cost(comm_s={"reduce_scatter": rng.uniform(0, 1e-3)}, grad_sync_s=-rng.uniform(0, 2e-3),
                     compute_s=-rng.uniform(0, 0.2e-3))
        root_options = frozenset(rng.sample(range(len(p.decisions[root].options)), rng.randint(1, 2)))
        terms.append(RootSharding(consumer, options, 0, root, root_options,
                                  rng.choice([1.0, 0.5]), delta))
    return dataclasses.replace(p, root_terms=terms)


@pytest.mark.parametrize("seed", SEEDS[:12])
def test_random_problems_with_root_terms_match_brute_force(seed):
    """Constraint (9) is exact: the ILP's optimum over problems with terms on pairs of decisions equals
    enumeration, which prices each assignment by settling its terms (``Problem.settled``)."""
    check_against_brute_force(_with_root_terms(random_problem(seed), seed))


def test_random_root_terms_change_some_optima():
    """The property test above is only as good as its terms: some must hold at the optimum and change it."""
    changed = 0
    for seed in SEEDS[:12]:
        plain = random_problem(seed)
        with_terms = _with_root_terms(plain, seed)
        best = brute_force(with_terms)
        holds = any(t.holds(best.choice) for t in with_terms.root_terms)
        changed += not close(best.step_s, brute_force(plain).step_s) and holds
    assert changed >= 3


def test_the_cheap_bound_charges_each_edge_to_the_reader_option_it_serves():
    """``least_time`` on a hand-checkable pair: ``a`` costs 1 ms whether it outputs a shard or a replica;
    its reader ``b`` runs in 1 ms on the shard, but every way to hand the shard over costs 4 ms, or in
    6 ms on the replica, handed over for free; a third option of ``b`` reads a partial sum that no pair of
    the edge allows. The optimum is 6 ms. Options and edges at their cheapest apart give 1 + 0 + 0 = 1 ms;
    charging each of ``b``'s options its edge's cheapest allowed pair gives the optimum itself, with the
    disallowed option left out. A root term that lowers one option of ``b`` counts only there."""
    from autopar.planning.solver import least_time

    shard, replica, partial = (Shard(0),), (Replicate(),), (Partial(),)
    a = Decision("a", ["a"], [Option(Strategy((), (shard,)), Cost(compute_s=1e-3)),
                              Option(Strategy((), (replica,)), Cost(compute_s=1e-3))])
    b = Decision("b", ["b"], [Option(Strategy((shard,), (replica,)), Cost(compute_s=1e-3)),
                              Option(Strategy((replica,), (replica,)), Cost(compute_s=6e-3)),
                              Option(Strategy((partial,), (replica,)), Cost())])
    gather = Cost(comm_s={"all_gather": 4e-3})
    reads_shard, reads_replica = b.options[0].edge_key(0), b.options[1].edge_key(0)
    edge = Edge("a", 0, "b", 0, 1, {(shard, reads_shard): gather, (replica, reads_shard): gather,
                                    (replica, reads_replica): Cost()})
    problem = Problem((4,), {"a": a, "b": b}, [edge], 1e12, 0.0)
    assert solve(problem).objective_s == pytest.approx(6e-3)
    assert least_time(problem) == pytest.approx(6e-3)
    lowered = dataclasses.replace(problem, root_terms=[
        RootSharding("b", frozenset({1}), 0, "a", frozenset({1}), 1.0, Cost(compute_s=-2e-3))])
    assert least_time(lowered) == pytest.approx(5e-3)
    assert solve(lowered).objective_s == pytest.approx(5e-3)


# ---- (f) FSDP's working set: the largest gathered unit, constraint (12) ----------------------------

def _gathered_problem(capacity_gib: float) -> Problem:
    """Parameters ``a`` and ``b`` of one unit and ``c`` of another, each replicated (1 ms, 4 GiB for a and
    b, 2 GiB for c) or sharded (2 ms, 1 GiB or 0.5 GiB) and then gathered while its unit runs (3 GiB each
    for a and b, 5 GiB for c). Step and memory (GiB) by choice: RRR 3 ms, 10; RRS 4, 8.5 + 5; SRR and RSR
    4, 7 + 3; SSR 5, 4 + 6; SRS and RSS 5, 5.5 + 5; SSS 6, 2.5 + max(6, 5) = 8.5 (13.5 if units added)."""
    def param(key: str, whole_gib: float, shard_gib: float, gathered_gib: float) -> Decision:
        sharded = dataclasses.replace(opt(S0, compute=2e-3, mem=shard_gib * GIB), gathered_bytes=gathered_gib * GIB)
        return dec(key, [opt(R, compute=1e-3, mem=whole_gib * GIB), sharded])

    decisions = [param("a", 4, 1, 3), param("b", 4, 1, 3), param("c", 2, 0.5, 5)]
    return dataclasses.replace(problem(decisions, capacity=capacity_gib * GIB),
                               gathered_units={"u1": {"a": 1, "b": 1}, "u2": {"c": 1}})


@pytest.mark.parametrize("capacity_gib, want, want_s", [
    (12, {"a": 0, "b": 0, "c": 0}, 3e-3),
    (9, {"a": 1, "b": 1, "c": 1}, 6e-3),  # only all sharded fits: the units' working sets are not added up
])
def test_the_largest_gathered_unit_is_held_not_every_unit(capacity_gib, want, want_s):
    p = _gathered_problem(capacity_gib)
    sol = solve(p)
    assert sol.choice == want and close(sol.objective_s, want_s)
    assert close(evaluate(p, {"a": 1, "b": 1, "c": 1})[1], 8.5 * GIB)
    assert close(evaluate(p, {"a": 0, "b": 0, "c": 1})[1], 13.5 * GIB)
    assert brute_force(p)[0] == sol.choice


def test_no_fit_when_the_smallest_plan_leaves_no_room_for_a_gathered_unit():
    """The bound counts the unit that raises it most, each of its parameters at its least with its working
    set: 2.5 GiB of shards, u1 +6 (a and b: 1 + 3 each against 4 whole), u2 +1.5 (c: 2 whole)."""
    p = _gathered_problem(8)
    assert close(least_memory(p), 8.5 * GIB)
    with pytest.raises(NoFeasiblePlanError, match="GiB"):
        solve(p)


@pytest.mark.parametrize("seed", SEEDS[:12])
def test_random_problems_with_gathered_units_match_brute_force(seed):
    """Random problems whose options gather, in two units over their decisions, tighter memory to make
    the working set matter: the ILP's (12) and ``evaluate``'s largest unit agree."""
    p = random_problem(seed)
    rng = random.Random(1000 + seed)
    for d in p.decisions.values():
        for option in d.options:
            option.gathered_bytes = rng.choice([0.0, rng.uniform(0, 3 * GIB)])
    keys = list(p.decisions)
    units = {"u1": {k: len(p.decisions[k].nodes) for k in keys[::2]}, "u2": {k: 1 for k in keys[1::2]}}
    p = dataclasses.replace(p, gathered_units=units,
                            memory_capacity_bytes=p.memory_capacity_bytes + rng.uniform(0, 3) * GIB)
    try:
        check_against_brute_force(p)
    except NoFeasiblePlanError:
        with pytest.raises(NoFeasiblePlanError):
            brute_force(p)
