"""Property-based tests (hypothesis) that hunt for wrong results rather than check chosen cases.

* The placement ILP against brute force on small problems of drawn structure: decisions, options,
  placements, costs, edges, tied counts, memory caps and overlap (gradient sync once a step and every
  microbatch, gathers prefetched beside forward, compute slowed beside them). The solver's optimum is brute force's
  (within ``RELATIVE_GAP``), its own objective is the price of its answer, and it finds no plan exactly
  when brute force finds none.
* Training parity over drawn models (``random_models.stack``: MLP, attention and norm blocks of drawn
  widths and depth), on 2 and 4 gloo ranks under drawn pinned degrees and options: every plan the
  planner accepts trains as single-process training does (``ParityResult.assert_matches``). One example
  is a list of runs, planned here first (a refused combination is left out) and trained in one spawn per
  world size: spawning is most of the time.

Example counts follow the hypothesis profile (``tests/conftest.py``); each test has a heavy variant.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import Phase, event, given, note, settings, strategies as st

from autopar.api import plan
from autopar.core.errors import AutoparError, NoFeasiblePlanError
from autopar.models import build_model
from autopar.planning.pricing import Cost
from autopar.planning.problem import Edge, Problem
from autopar.planning.solver import RELATIVE_GAP, brute_force, evaluate, solve
from autopar.testing.parity import train_parallel_many, train_single
from conftest import examples
from random_models import BLOCKS
from test_solver import _PLACEMENTS, dec, opt

# ---- the ILP against brute force ----------------------------------------------------------------------

SECONDS = st.floats(0.0, 2e-3)
MIB = 2**20
MEMORY = st.integers(0, 4096).map(lambda n: n * MIB)
"""Memory on a MiB grid: the ILP states memory in GiB, where HiGHS's feasibility tolerance (1e-7) is about
100 bytes, so amounts that differ by less would let it take an option brute force finds too large."""


@st.composite
def problems(draw: st.DrawFn) -> Problem:
    """A problem of 1-6 decisions with 1-3 options each; each decision reads up to two earlier ones (or,
    as a tied layer does, itself); every edge prices every pair of producer output and consumer input."""
    n = draw(st.integers(1, 6))
    keys = [f"d{i}" for i in range(n)]
    incoming = {k: draw(st.lists(st.sampled_from(keys[: i + 1]), max_size=min(i + 1, 2))) for i, k in enumerate(keys)}
    placement = st.sampled_from(_PLACEMENTS)
    microbatches = draw(st.integers(1, 4))
    decisions = {}
    for k in keys:
        options = [opt(draw(placement), [draw(placement) for _ in incoming[k]], compute=draw(SECONDS),
                       comm=draw(st.dictionaries(st.sampled_from(["all_reduce", "all_gather"]), SECONDS, max_size=1)),
                       sync=draw(SECONDS), bwd=draw(SECONDS), mem=draw(MEMORY))
                   for _ in range(draw(st.integers(1, 3)))]
        for o in options:  # a share of the sync redone in each microbatch's backward (ZeRO-2, lowered FSDP)
            o.cost.grad_sync_per_microbatch_s = o.cost.grad_sync_s * draw(st.sampled_from([0.0, 0.5, 1.0])) / microbatches
            o.cost.forward_compute_s = draw(SECONDS)
        decisions[k] = dec(k, options, count=draw(st.integers(1, 3)))
    edges = []
    for k in keys:
        for slot, src in enumerate(incoming[k]):
            outs = dict.fromkeys(o.strategy.outputs[0] for o in decisions[src].options)
            ins = dict.fromkeys(o.edge_key(slot) for o in decisions[k].options)
            price = {(a, b): Cost() if a == b[0] else _move(draw) for a in outs for b in ins}
            edges.append(Edge(src, 0, k, slot, draw(st.integers(1, 3)), price))
    least = sum(d.count * min(o.cost.memory_bytes for o in d.options) for d in decisions.values())
    most = sum(d.count * max(o.cost.memory_bytes for o in d.options) for d in decisions.values())
    capacity = least + draw(st.integers(-1, 6)) * (most - least) // 5 + draw(st.sampled_from([0, -MIB, MIB]))
    return Problem((4,), decisions, edges, capacity, draw(st.floats(0.0, 1.0)), microbatches=microbatches,
                   overlap_slowdown=draw(st.sampled_from([0.0, 0.189, 1.0])))


def _move(draw: st.DrawFn) -> Cost:
    """An edge's resharding: an all_gather on the critical path, or a parameter's gathers prefetched beside
    forward (and again beside backward, in the sync every microbatch), as the lowered runtime runs FSDP's."""
    if not draw(st.booleans()):
        return Cost(comm_s={"all_gather": draw(SECONDS)})
    seconds = draw(SECONDS)
    return Cost(prefetched_s=seconds, grad_sync_s=seconds, grad_sync_per_microbatch_s=seconds)


def check_solver_matches_brute_force(p: Problem) -> None:
    try:
        best = brute_force(p)
    except NoFeasiblePlanError:
        with pytest.raises(NoFeasiblePlanError):
            solve(p)
        return
    sol = solve(p)
    step, memory = evaluate(p, sol.choice)
    note(f"brute force {best}, solver {sol.choice} at {sol.objective_s} (priced {step})")
    assert memory <= p.memory_capacity_bytes
    assert math.isclose(step, sol.objective_s, rel_tol=1e-6, abs_tol=1e-12)
    assert best.step_s - 1e-12 <= step <= best.step_s * (1 + RELATIVE_GAP) + 1e-12


@examples(2.5)
@given(problems())
def test_the_ilp_finds_brute_force_optimum(p):
    check_solver_matches_brute_force(p)


@pytest.mark.heavy
@examples(2.5, "heavy")
@given(problems())
def test_the_ilp_finds_brute_force_optimum_heavy(p):
    check_solver_matches_brute_force(p)


# ---- parity of drawn models under drawn plans --------------------------------------------------------

MODEL = "random_models:stack"
BATCH, SEQ, STEPS = 8, 4, 2


def drawn_runs(world: int, most: int) -> st.SearchStrategy[list[tuple[dict, dict]]]:
    """One to ``most`` (model sizes, pinned constraints) for ``world`` ranks, made from a drawn seed. The
    seed, not the structure, is what hypothesis draws: its first example of a structure is the smallest
    (one MLP block, nothing pinned), and the derandomized default tier affords one example, so drawing a
    seed makes that one a varied list; shrinking, which would cost a spawn a step, is off for these tests
    (the failure message names the run)."""
    return st.integers(0, 2**32 - 1).map(lambda seed: runs_from_seed(random.Random(f"{world}-{seed}"), world, most))


def runs_from_seed(rng: random.Random, world: int, most: int) -> list[tuple[dict, dict]]:
    """Two to ``most`` runs: a model of 1-4 blocks, and constraints each pinned or not at random, drawn
    so that most can hold (dp x tp divides the world, sp only with tp > 1 and a norm to split)."""
    runs = []
    for _ in range(rng.randint(2, most)):
        heads = rng.choice([1, 2, 4])
        sizes = {"blocks": "".join(rng.choices(BLOCKS, k=rng.randint(1, 4))), "width": heads * rng.choice([2, 4, 6, 8]),
                 "hidden": rng.choice([4, 8, 12, 16]), "heads": heads, "out": rng.choice([2, 4, 8])}
        tp = rng.choice([d for d in (1, 2, 4) if world % d == 0])
        dp = rng.choice([d for d in (1, 2, 4) if (world // tp) % d == 0])
        options = {"dp": dp, "tp": tp, "fsdp": rng.choice([0, 1, 2, 3]), "microbatches": rng.choice([1, 2]),
                   "checkpointing": rng.choice(["none", "selective", "full"])}
        if tp > 1 and set(sizes["blocks"]) & {"n", "r"}:
            options["sp"] = rng.choice([0, 1])
        runs.append((sizes, {key: value for key, value in options.items() if rng.random() < 0.5}))
    return runs


def accepted_runs(world: int, drawn: list[tuple[dict, dict]]) -> list[dict]:
    """The drawn (model sizes, constraints) the planner accepts for ``world`` ranks, each as a run of
    ``train_parallel_many`` with its plan, planned here so that a refusal does not fail the spawn."""
    runs = []
    for sizes, constraints in drawn:
        bundle = build_model(MODEL, overrides=sizes, global_batch=BATCH, seq=SEQ, device="meta")
        try:
            made = plan(bundle.model, bundle.example_inputs, f"1x{world}xcpu", bundle.loss_fn, constraints,
                        example_targets=bundle.example_targets, name=MODEL)
        except AutoparError as exc:
            note(f"refused on {world} ranks: {sizes} {constraints}: {exc}")
            event(f"refused: {type(exc).__name__}")
            continue
        runs.append(dict(name=MODEL, overrides=sizes, global_batch=BATCH, seq=SEQ, steps=STEPS, plan=made.to_dict(),
                         constraints=None))
    return runs


def check_parity(world: int, drawn: list[tuple[dict, dict]]) -> None:
    runs = accepted_runs(world, drawn)
    event(f"{world} ranks: {len(runs)} of {len(drawn)} drawn runs planned")
    if not runs:
        return
    for run, result in zip(runs, train_parallel_many(world, runs)):
        degrees = {k: v for k, v in result.plan["degrees"].items() if v > 1}
        result.assert_matches(train_single(MODEL, run["overrides"], BATCH, SEQ, STEPS),
                              f"{run['overrides']} on {world} ranks under {degrees}, "
                              f"checkpointing {result.plan['checkpointing']}")


NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
@settings(examples(0.05), phases=NO_SHRINK)
@given(two=drawn_runs(2, 3), four=drawn_runs(4, 3))
def test_drawn_models_and_plans_train_as_one_process(two, four):
    check_parity(2, two)
    check_parity(4, four)


@pytest.mark.dist
@pytest.mark.heavy
@settings(examples(0.05, "heavy"), phases=NO_SHRINK)
@given(two=drawn_runs(2, 5), four=drawn_runs(4, 5))
def test_drawn_models_and_plans_train_as_one_process_heavy(two, four):
    check_parity(2, two)
    check_parity(4, four)


@pytest.mark.dist
@pytest.mark.slow
def test_an_fsdp_weight_gathered_again_in_backward_is_read_as_forward_read_it() -> None:
    """Drawn by the heavy tier (on 4 ranks): one MLP block 2 wide and 4 hidden under FSDP on DTensor. Its output
    projection's [2, 4] weight, a column a rank, gathered again in backward came back column-major and was read
    with forward's row-major strides (``reshard.view_again``): the input projection's gradients were wrong."""
    sizes = {"blocks": "m", "width": 2, "hidden": 4, "heads": 1, "out": 4}
    (run,) = accepted_runs(4, [(sizes, {"tp": 1, "fsdp": 3})])
    (result,) = train_parallel_many(4, [{**run, "lowered": False}])
    assert result.plan["placements"]["blocks.0.fc_out.weight"] == ["S(1)"]
    result.assert_matches(train_single(MODEL, sizes, BATCH, SEQ, STEPS))
