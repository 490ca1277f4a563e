"""Planning at scale (issue 15): a stack of identical layers traced two layers deep plans exactly as the
whole model does, the same input gives the same plan byte for byte, and nothing depends on time.

* the reduced problem (a traced stack, ``capture.LayerStack``) has the full problem's optimum: same
  step time, degrees, placements and per-op strategies (matched by their tie keys) on small models;
* the plan of a traced stack runs: ``ir.bind.bind_ops`` gives every op of the whole graph its entry,
  and 3 SGD steps under it on 2 gloo ranks match single-process training;
* ``autopar plan ... --json`` twice, under different hash seeds, prints the same JSON (timings aside), and
  a search run by one process or by two forked workers gives the same plan (``planning/workers.py``);
* a plan's predicted step time equals re-pricing it on the problem it was solved on (``autopar.reprice``);
* the solver's limits are on work (``solver_nodes``), never on time, and the plan says when one was hit;
* the search reports its progress (phase, meshes, best plan and bound), which the CLI draws on one line.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import warnings

import pytest

import autopar
from autopar.cli import main as cli_main
from autopar.core.constraints import Constraints
from autopar.planning.workers import WINDOW, Workers
from autopar.cost_models import parse_cluster
from autopar.ir.capture import TRACED_LAYERS, capture
from autopar.models import build_model
from autopar.ir.bind import bind_ops
from autopar.planning.search import make_plan
from autopar.planning.solver import RELATIVE_GAP, solve
from autopar.testing.parity import train_parallel, train_single

TIMINGS = ("wall_s", "search_wall_s", "phases_s")


def _bundle(name: str, layers: int, batch: int = 8, seq: int | None = None):
    return build_model(name, overrides={"layers": layers}, global_batch=batch, seq=seq, device="meta")


def _planned(bundle, cluster: str, traced: int | None, constraints: dict | None = None):
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn,
                       traced_layers=traced)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return captured, make_plan(captured, parse_cluster(cluster), model_name="m",
                                   constraints=Constraints.from_mapping(constraints or {}))


def _strategies_by_key(plan) -> dict[str, tuple]:
    return {op["decision"]: (op["op"], json.dumps(op["inputs"]), json.dumps(op["outputs"])) for op in plan.ops.values()}


@pytest.mark.parametrize("name, layers, cluster, constraints", [
    ("tiny-llama", 6, "2x4xH100", None),
    ("tiny-gpt", 5, "1x8xH100", {"tp": 2}),
    ("tiny-llama", 4, "4x2xH100", {"pp": 2, "checkpointing": "full"}),
])
def test_a_traced_stack_has_the_whole_models_optimum(name, layers, cluster, constraints):
    bundle = _bundle(name, layers)
    short, reduced = _planned(bundle, cluster, TRACED_LAYERS, constraints)
    whole, full = _planned(bundle, cluster, None, constraints)
    assert short.stack is not None and short.stack.layers == layers and whole.stack is None
    assert len(short.graph.nodes) < len(whole.graph.nodes)
    assert reduced.predicted["step_time_s"] == pytest.approx(full.predicted["step_time_s"], rel=RELATIVE_GAP)
    assert reduced.predicted["peak_memory_bytes"] == pytest.approx(full.predicted["peak_memory_bytes"], rel=1e-6)
    assert (reduced.model["params"], reduced.model["layers"], reduced.model["graph_fingerprint"]) == \
        (full.model["params"], full.model["layers"], full.model["graph_fingerprint"])
    assert reduced.model["flops_per_step"] == pytest.approx(full.model["flops_per_step"], rel=1e-9)
    assert dict(reduced.degrees) == dict(full.degrees)
    assert reduced.placements == full.placements
    assert _strategies_by_key(reduced) == _strategies_by_key(full)


def test_binding_gives_every_op_of_the_whole_graph_its_traced_strategy():
    bundle = _bundle("tiny-llama", 5)
    _, plan = _planned(bundle, "1x4xH100", TRACED_LAYERS, {"tp": 2})
    whole = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    bound = bind_ops(plan, whole)
    ops = [n for n in whole.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") != "getitem"]
    assert set(bound.ops) == {n.name for n in ops}
    assert all(bound.ops[n.name]["op"] == str(n.target) for n in ops)
    assert len(plan.ops) < len(bound.ops)


@pytest.mark.dist
@pytest.mark.slow
def test_a_plan_of_a_traced_stack_trains_like_one_process():
    layers, batch, steps = 4, 8, 3
    bundle = _bundle("tiny-llama", layers, batch)
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, {"tp": 2},
                        example_targets=bundle.example_targets)
    assert any("count" in op for op in plan.ops.values()), "the plan should come from a traced stack"
    result = train_parallel(2, "tiny-llama", {"layers": layers}, batch, None, steps, plan=plan.to_dict())
    result.assert_matches(train_single("tiny-llama", {"layers": layers}, batch, None, steps))


def _cli_plan(seed: str) -> dict:
    args = [sys.executable, "-m", "autopar", "plan", "tiny-llama", "--set", "layers=6", "--cluster", "2x8xH100",
            "--global-batch", "32", "--json"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=300,
                         env={**os.environ, "PYTHONHASHSEED": seed})
    plan = json.loads(out.stdout)
    for key in TIMINGS:
        plan["solver"].pop(key)
    return plan


@pytest.mark.slow
def test_the_same_command_prints_the_same_plan():
    first, second = _cli_plan("1"), _cli_plan("2")
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    assert first["solver"]["limit_hit"] is False


@pytest.mark.slow
def test_a_pipeline_mesh_pruned_without_zero_is_searched_under_zero_one_where_memory_is_tight(tmp_path):
    """Llama 3 405B on 16,384 H100s: without ZeRO, the bound of pp 16 x dp 128 x tp 8 lost to the best plan
    before it, so the mesh was pruned and never searched under ZeRO-1, whose freed optimizer state lets it run
    without recomputation: 5.60 s a step, Llama 3's own configuration (Dubey et al., 2024, Table 4), where the
    search chose pp 8 x dp 256 x tp 8 at 6.03 s. A mesh the cutoff prunes without ZeRO is searched under ZeRO-1
    too (``search._distributed_optimizer_may_help``); where its fewest microbatch count does not fit without
    ZeRO, under ZeRO-1 first (``search._MeshSearch.fewest_count_refused``)."""
    out = tmp_path / "plan.json"
    assert cli_main(["plan", "llama3-405b", "--cluster", "2048x8xH100", "--global-batch", "2048",
                    "--seq", "8192", "--json", "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    degrees = plan["degrees"]
    assert (degrees["pp"], degrees["dp"], degrees["tp"], degrees["zero"]) == (16, 128, 8, 1), degrees
    assert plan["predicted"]["step_time_s"] < 6.0


def test_a_plan_reprices_to_its_own_prediction(tmp_path):
    bundle = _bundle("tiny-llama", 6, batch=32)
    problem_file = tmp_path / "p.json"
    plan = autopar.plan(bundle.model, bundle.example_inputs, "2x8xH100", bundle.loss_fn,
                        example_targets=bundle.example_targets, save_problem=problem_file)
    again = autopar.reprice(plan, autopar.load_problem(problem_file), "2x8xH100")
    assert again.predicted["step_time_s"] == pytest.approx(plan.predicted["step_time_s"], rel=1e-3)


def test_a_time_limit_is_refused_with_what_to_use_instead():
    with pytest.raises(autopar.BadInputError, match="solver_nodes"):
        Constraints.from_mapping({"time_limit_s": 5})


def test_the_node_limit_stops_the_search_and_the_solution_says_so():
    from tests.test_solver import random_layered_problem

    hard = next(p for p in map(random_layered_problem, range(40)) if solve(p).nodes > 1)
    stopped = solve(hard, node_limit=1)
    assert stopped.limit_hit and stopped.status == "feasible"
    assert stopped.bound_s <= solve(hard).objective_s <= stopped.objective_s
    assert not solve(hard).limit_hit


def _without_timings(plan) -> str:
    data = plan.to_dict()
    for key in TIMINGS:
        data["solver"].pop(key)
    return json.dumps(data, sort_keys=True)


def test_the_plan_is_the_same_with_one_worker_or_two(monkeypatch):
    from autopar.planning.workers import worker_count

    bundle = _bundle("tiny-llama", 6, batch=32)
    plans, lines = {}, []
    for workers in (1, 2):
        monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", str(workers))
        if workers == 2 and worker_count() != 2:
            pytest.skip("this machine cannot run two planning workers (one core, or no fork)")
        plans[workers] = autopar.plan(bundle.model, bundle.example_inputs, "2x8xH100", bundle.loss_fn,
                                      example_targets=bundle.example_targets, progress=lambda p: lines.append(p.line()))
    assert _without_timings(plans[1]) == _without_timings(plans[2])
    assert plans[2].solver["meshes_tried"] > WINDOW  # the window slid
    assert any(line.startswith("planning: search (2 workers)") for line in lines)


@pytest.mark.parametrize("count", [1, 2])
def test_each_task_reads_the_results_taken_up_to_the_window_with_any_number_of_workers(count):
    """``Workers.in_order`` asks for item ``i`` once the results of items ``0 .. max(0, i - WINDOW)`` are
    taken, and no later ones, in one process as in two forked workers; results come back in order; the
    first item, which runs alone, runs in this process (the workers forked after it start from its caches)."""
    taken: list[int] = []
    asked_after: dict[int, int] = {}
    ran_in: dict[int, int] = {}

    def item_for(i: int) -> int | None:
        asked_after[i] = len(taken)
        return None if i == 5 else i

    with Workers(lambda i: (i * i, os.getpid()), count) as workers:
        for i, result in workers.in_order(12, item_for):
            if i == 5:
                assert result is None
            else:
                assert result[0] == i * i
                ran_in[i] = result[1]
            taken.append(i)
    assert taken == list(range(12))
    assert asked_after == {i: 0 if i == 0 else max(1, i - WINDOW + 1) for i in range(12)}
    assert ran_in[0] == os.getpid()
    assert (set(ran_in.values()) == {os.getpid()}) == (count == 1)


@pytest.mark.parametrize("count", [1, 2])
def test_tasks_run_one_at_a_time_until_a_result_settles_what_the_later_ones_read(count):
    """Until a result ``settles`` (a mesh's search found a plan: its step time cuts the later searches
    off), item ``i`` is asked for once every result before it is taken and runs in this process, so no
    search starts without what the earlier ones found; after the first that settles (item 3), item ``i``
    is asked for once the results up to ``max(3, i - WINDOW)`` are, in one process as in two."""
    taken: list[int] = []
    asked_after: dict[int, int] = {}
    ran_in: dict[int, int] = {}

    def item_for(i: int) -> int:
        asked_after[i] = len(taken)
        return i

    with Workers(lambda i: (i, os.getpid()), count) as workers:
        for i, result in workers.in_order(12, item_for, settles=lambda result: result[0] == 3):
            assert result[0] == i
            ran_in[i] = result[1]
            taken.append(i)
    assert asked_after == {i: i if i <= 3 else max(4, i - WINDOW + 1) for i in range(12)}
    assert all(ran_in[i] == os.getpid() for i in range(4))
    assert (set(ran_in.values()) == {os.getpid()}) == (count == 1)


def test_a_pricer_sent_back_by_a_worker_keeps_no_prices_keyed_by_the_workers_object_ids():
    """A candidate comes back from a planning worker pickled, its pricer with it; the pricer's cache of
    costs re-priced per microbatch count is keyed by the ids of the worker's cost objects, which in the
    parent name other objects: kept, a lookup could hand a cost another's price (a plan then changed from
    run to run with two workers: gpt-oss-120b pinned on 64 B200s, 2.503-2.561 s a step). The cache is
    left behind, and what the pricer computes after the trip is each cost's own price."""
    import pickle

    from autopar.cost_models import parse_cluster
    from autopar.planning.pricing import Cost, Kernel, Pricer

    pricer = Pricer(parse_cluster("1x8xH100"), (8,), "bf16")
    costs = [Cost(kernel=Kernel(1e12 * (i + 1), 0.0, "matmul"), memory_bytes=1e6, batch_memory=True) for i in range(4)]
    before = [pricer.for_microbatches(c, 2) for c in costs]
    travelled = pickle.loads(pickle.dumps(pricer))
    assert pricer._per_microbatches and not travelled._per_microbatches
    assert [travelled.for_microbatches(c, 2).compute_s for c in pickle.loads(pickle.dumps(costs))] == \
        [b.compute_s for b in before]


def test_the_search_reports_its_progress(monkeypatch):
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "1")  # phases are drawn as this process enters them
    bundle = _bundle("tiny-llama", 4)
    lines: list[str] = []
    plan = autopar.plan(bundle.model, bundle.example_inputs, "2x8xH100", bundle.loss_fn,
                        example_targets=bundle.example_targets, progress=lambda p: lines.append(p.line()))
    assert lines[0].startswith("planning: capture")
    assert any(line.startswith("planning: build") for line in lines)
    assert any(line.startswith("planning: solve") for line in lines)
    assert f"{plan.predicted['step_time_s'] * 1e3:.1f} ms/step" in lines[-1] and "meshes" in lines[-1]
    assert set(plan.solver["phases_s"]) >= {"capture", "build", "solve"}


def test_the_progress_line_is_rewritten_in_place_and_erased():
    from autopar.cli import ProgressLine
    from autopar.planning.progress import SearchProgress

    out = io.StringIO()
    line = ProgressLine(out)
    progress = SearchProgress(line, candidates=3)
    with progress.phase("build"):
        progress.found(0.5, 0.49, "dp=8")
    line.clear()
    text = out.getvalue()
    assert "\rplanning: build  0/3 meshes (0 pruned)\r" in text
    assert "\rplanning: build  1/3 meshes (0 pruned)  best dp=8 500.0 ms/step (bound 490" in text  # cut to 79 columns
    assert text.endswith("\r") and "\n" not in text


def test_the_cheap_bound_is_below_the_optimum_and_prunes_before_the_model_is_built(monkeypatch):
    from autopar.planning import solver
    from tests.test_solver import random_problem

    for seed in range(20):
        p = random_problem(seed)
        best = solve(p)
        assert solver.least_time(p) <= best.objective_s * (1 + 1e-9)
    p = random_problem(0)
    monkeypatch.setattr(solver, "Ilp", None)  # pruned by the bound alone: no model is built
    with pytest.raises(solver.Pruned):
        solve(p, cutoff_s=solver.least_time(p) * 0.999)


def test_a_mesh_whose_least_configuration_loses_is_pruned_by_one_root_to_the_same_plan(monkeypatch):
    """``_MeshSearch._cannot_win``: a mesh whose problem at the fewest microbatches, without recomputation
    or memory row and stretched by the least bubble, cannot beat the cutoff is listed as pruned before
    its modes, counts and schedules are searched; the plan is the one searching each of them finds (tiny
    Llama on 16 H100s: some meshes are pruned so, not all)."""
    from autopar.planning import search

    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "1")
    verdicts: list[bool] = []
    check = search._MeshSearch._cannot_win
    monkeypatch.setattr(search._MeshSearch, "_cannot_win",
                        lambda self, *args: (verdicts.append(check(self, *args)), verdicts[-1])[1])
    bundle = _bundle("tiny-llama", 6, batch=32)
    plan = autopar.plan(bundle.model, bundle.example_inputs, "2x8xH100", bundle.loss_fn,
                        example_targets=bundle.example_targets)
    assert any(verdicts) and not all(verdicts), verdicts
    monkeypatch.setattr(search._MeshSearch, "_cannot_win", lambda self, *args: False)
    searched = autopar.plan(bundle.model, bundle.example_inputs, "2x8xH100", bundle.loss_fn,
                            example_targets=bundle.example_targets)
    assert {tuple(sorted(m.items())) for m in searched.solver["pruned_meshes"]} <= \
        {tuple(sorted(m.items())) for m in plan.solver["pruned_meshes"]}
    for pruned in (plan, searched):
        pruned.solver.pop("pruned_meshes")
        pruned.solver.pop("meshes_tried")
    assert _without_timings(searched) == _without_timings(plan)


def test_chunk_counts_a_schedule_cannot_win_with_are_pruned_by_one_relaxation_to_the_same_plan(monkeypatch):
    """``_ChunkBound``: the microbatch counts at which no chunk count of zero bubble can beat the cutoff
    (tiny Llama, 8 layers pinned to pp=2 x dp=4: chunk counts 1, 2 and 4) are skipped, each proven by
    one LP in place of an ILP a chunk count; each chunk count's ILP there is pruned too, and the plan is
    the one solving each of them finds."""
    from autopar.core.errors import NoFeasiblePlanError
    from autopar.planning import search
    from autopar.planning.assemble import least_stage_transfers
    from autopar.planning.solver import Pruned

    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "1")
    verdicts: dict[tuple[str, int], bool] = {}
    check = search._ChunkBound.cannot_win

    def noted(bound, m, cutoff_s):
        verdicts[bound.staging.schedule, m] = check(bound, m, cutoff_s)
        for v in bound.staging.among if verdicts[bound.staging.schedule, m] else ():
            staging = search.Staging(bound.staging.stages, bound.staging.layers, bound.staging.schedule, v,
                                     bound.staging.checkpointing)
            problem = bound.search._staged(bound.per_m[m], staging)
            bubble = staging.bubble_fraction(m)
            sends = least_stage_transfers(bound.search.captured, problem, staging, bound.pricer, bound.mesh)
            with pytest.raises((Pruned, NoFeasiblePlanError)):
                solve(problem, cutoff_s=cutoff_s - (1 + bubble) * sends, bubble_fraction=bubble)
        return verdicts[bound.staging.schedule, m]

    monkeypatch.setattr(search._ChunkBound, "cannot_win", noted)
    bundle = _bundle("tiny-llama", 8, batch=32)
    pinned = {"pp": 2, "dp": 4}
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x8xH100", bundle.loss_fn, pinned,
                        example_targets=bundle.example_targets)
    assert plan.pipeline.schedule == "zero_bubble" and plan.pipeline.virtual_stages == 4
    assert any(verdicts.values()) and not all(verdicts.values()), verdicts
    monkeypatch.setattr(search._MeshSearch, "_chunk_bound", lambda self, *args: None)
    solved = autopar.plan(bundle.model, bundle.example_inputs, "1x8xH100", bundle.loss_fn, pinned,
                          example_targets=bundle.example_targets)
    assert _without_timings(solved) == _without_timings(plan)

@pytest.mark.parametrize("tp, stages, capacity_mb, must", [(2, 1, 1.2, True), (4, 1, 1.2, False),
                                                            (2, 2, 1.2, False), (2, 2, 0.5, True)])
def test_parameters_must_be_sharded_where_their_replicated_state_exceeds_a_device(tp, stages, capacity_mb, must):
    """``_MeshSearch.must_shard_parameters`` by hand: tiny-llama's 180,800 parameters in bf16 on H100s
    hold 18 bytes each replicated (2 bf16, 4 fp32 gradient, 12 fp32 master and AdamW moments), split at
    most over tp and the stages (1.63 MB over tp=2, 0.81 MB over tp=4 or tp=2 x 2 stages); dp takes none
    of it."""
    from autopar.core.axes import MeshAxis
    from autopar.planning.meshes import MeshChoice
    from autopar.planning.progress import SearchProgress
    from autopar.planning.search import _MeshSearch

    bundle = _bundle("tiny-llama", 4, batch=8)
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    assert captured.num_params() == 180_800
    assert (18 * captured.num_params() / (tp * stages) > capacity_mb * 1e6) == must
    search = _MeshSearch(captured, parse_cluster("1x8xH100"), "bf16", capacity_mb * 1e6, 8, Constraints(),
                         SearchProgress())
    mesh = MeshChoice(((MeshAxis.DP_SHARD, 8 // (tp * stages)), (MeshAxis.TP, tp)), stages)
    assert search.must_shard_parameters(mesh) == must


def test_a_mesh_that_must_shard_is_searched_under_zero_one_first_and_keeps_its_better_plan(monkeypatch):
    """Where parameters replicated over dp cannot fit (``must_shard_parameters``), the mesh is searched
    under ZeRO-1 first and then without, against ZeRO-1's step. Llama 3 8B's dims with 16 layers on 32 H100s
    at 14 GB: ZeRO-1 on dp=8 x tp=2 x pp=2 (dp=8 x tp=4 until sequence parallelism's gathers were priced
    again in backward, ``pricing.moved_again``). Searched the other way round, a mesh whose search without ZeRO the
    cutoff pruned was never tried under ZeRO-1, and the search missed that plan (17% slower); now such a
    mesh is tried under ZeRO-1 too (``search._distributed_optimizer_may_help``), and either order reaches the
    same plan, solving as many ILPs (24) here."""
    from autopar.planning import search

    bundle = build_model("llama3-8b", overrides={"layers": 16}, global_batch=128, seq=4096, device="meta")

    def planned():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.plan(bundle.model, bundle.example_inputs, "4x8xH100", bundle.loss_fn,
                                {"memory_gb": 14, "runtime": "dtensor"},
                                example_targets=bundle.example_targets)

    plan = planned()
    monkeypatch.setattr(search._MeshSearch, "must_shard_parameters", lambda self, mesh: False)
    monkeypatch.setattr(search._MeshSearch, "fewest_count_refused", lambda self, mesh: False)  # its twin rule
    plain_first = planned()
    assert plan.degrees.zero == 1 and (plan.degrees.dp, plan.degrees.tp, plan.degrees.pp) == (8, 2, 2)
    assert (plain_first.degrees, plain_first.checkpointing) == (plan.degrees, plan.checkpointing)
    assert plain_first.predicted["step_time_s"] == pytest.approx(plan.predicted["step_time_s"], rel=1e-12)


def _tight_pipeline_plan(monkeypatch) -> tuple[object, list[int]]:
    """tiny Llama, 8 layers at 1,024 tokens, pinned to pp=2 x dp=4 in 30 MB a device (the ZeRO stage, the
    schedule, the counts and checkpointing free): the plan and the microbatch count of every ILP solved."""
    from autopar.planning import search

    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "1")
    solved: list[int] = []
    solve_ = search.solve
    monkeypatch.setattr(search, "solve", lambda problem, *a, **k: (solved.append(problem.microbatches),
                                                                   solve_(problem, *a, **k))[1])
    bundle = build_model("tiny-llama", overrides={"layers": 8, "seq": 1024}, global_batch=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(bundle.model, bundle.example_inputs, "1x8xH100", bundle.loss_fn,
                            {"pp": 2, "dp": 4, "memory_gb": 0.03}, example_targets=bundle.example_targets)
    return plan, list(solved)


def test_a_mesh_whose_fewest_count_does_not_fit_is_searched_under_zero_one_first_to_the_same_step(monkeypatch):
    """With nothing to beat yet, a mesh whose fewest microbatch count does not fit without ZeRO
    (``_MeshSearch.fewest_count_refused``) is searched under ZeRO-1 first: both searches run in either
    order, so the plan's step time is the one the other order finds. (Which order solves fewer ILPs
    depends on which search wins: here both orders solve 15; on a pinned Llama 3 70B pipeline 9 and 8,
    ``test_a_pinned_pipeline_searched_under_zero_one_first_reaches_the_other_orders_plan``.)"""
    from autopar.planning import search

    refused: list[bool] = []
    check = search._MeshSearch.fewest_count_refused
    monkeypatch.setattr(search._MeshSearch, "fewest_count_refused",
                        lambda self, mesh: (refused.append(check(self, mesh)), refused[-1])[1])
    plan, _ = _tight_pipeline_plan(monkeypatch)
    assert refused == [True] and plan.degrees.zero == 1
    monkeypatch.setattr(search._MeshSearch, "fewest_count_refused", lambda self, mesh: False)
    other, _ = _tight_pipeline_plan(monkeypatch)
    assert (plan.degrees, plan.pipeline, plan.checkpointing) == (other.degrees, other.pipeline, other.checkpointing)
    assert plan.predicted["step_time_s"] == pytest.approx(other.predicted["step_time_s"], rel=1e-12)


def test_microbatch_counts_a_staging_cannot_win_with_are_pruned_by_one_relaxation_to_the_same_plan(monkeypatch):
    """``_MeshSearch._counts_cannot_win``: where the problem at a staging's fewest count, without memory
    rows, stretched by the least bubble of any count and paying the fewest count's stage transfers, cannot
    beat the cutoff, none of the counts is solved; each count's own ILP is pruned there too (checked by
    solving it as ``_best_microbatching`` would), and the plan is the one solving each count finds."""
    from autopar.core.errors import NoFeasiblePlanError
    from autopar.planning import search
    from autopar.planning.assemble import least_stage_transfers
    from autopar.planning.solver import Pruned

    verdicts: list[bool] = []
    check = search._MeshSearch._counts_cannot_win

    def noted(self, mesh, staging, per_m, counts, pricer, cutoff_s, least_bubble):
        verdicts.append(check(self, mesh, staging, per_m, counts, pricer, cutoff_s, least_bubble))
        for m in counts if verdicts[-1] else ():
            problem = self._staged(per_m[m], staging)
            bubble = min(staging.bubble_fraction(m), least_bubble)
            sends = least_stage_transfers(self.captured, problem, staging, pricer, mesh)
            with pytest.raises((Pruned, NoFeasiblePlanError)):
                solve(problem, cutoff_s=cutoff_s - (1 + bubble) * sends, bubble_fraction=bubble)
        return verdicts[-1]

    monkeypatch.setattr(search._MeshSearch, "_counts_cannot_win", noted)
    plan, bounded = _tight_pipeline_plan(monkeypatch)
    assert any(verdicts) and not all(verdicts), verdicts
    monkeypatch.setattr(search._MeshSearch, "_counts_cannot_win", lambda self, *args: False)
    solved, each = _tight_pipeline_plan(monkeypatch)
    assert len(bounded) < len(each)
    assert _without_timings(solved) == _without_timings(plan)


@pytest.mark.extended
def test_larger_cp_degrees_are_not_solved_once_activations_fit_whole(monkeypatch):
    """tiny-llama at 4,096 tokens in 16 MB a device: the best plan without cp recomputes, so cp meshes are
    searched. At cp=1 activations fit with no recomputation at tp=2 and tp=4 (those meshes lost on time),
    so of cp=2 only tp=1 is built; there they fit whole, so cp=4 and cp=8 (the same tokens a device, more
    keys and values gathered) are listed as pruned, never built, and the plan is the one a search of every
    degree finds, its pruned meshes listed in the same order."""
    from autopar.planning import search

    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "1")
    built = []
    build = search.problem_for
    monkeypatch.setattr(search, "problem_for", lambda captured, mesh, *a, **k: (built.append(mesh.describe()),
                                                                              build(captured, mesh, *a, **k))[1])
    bundle = build_model("tiny-llama", overrides={"seq": 4096}, global_batch=8)
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x8xH100", bundle.loss_fn, {"memory_gb": 0.016},
                        example_targets=bundle.example_targets)
    assert plan.checkpointing != "none" and plan.degrees.cp == 1
    assert {tuple(m.items()) for m in built if m.get("cp")} == {(("dp", 4), ("cp", 2))}  # with and without ZeRO-1
    pruned = plan.solver["pruned_meshes"]
    assert {"cp": 2, "tp": 4} in pruned and {"dp": 2, "cp": 2, "tp": 2} in pruned
    assert {"dp": 2, "cp": 4} in plan.solver["pruned_meshes"] and {"cp": 8} in plan.solver["pruned_meshes"]
    monkeypatch.setattr(search, "_dominated_by_less_cp", lambda mesh, fit_whole: False)
    every_degree = autopar.plan(bundle.model, bundle.example_inputs, "1x8xH100", bundle.loss_fn,
                                {"memory_gb": 0.016}, example_targets=bundle.example_targets)
    assert any(m.get("cp") == 8 for m in built)
    assert _without_timings(every_degree) == _without_timings(plan)


def _pinned_70b_solves(monkeypatch, cluster: str = "16x8xH100") -> tuple[object, list[int]]:
    """Llama 3 70B pinned to pp=4 x dp=4 x tp=8 on 128 H100s (its schedule and checkpointing free), 1,024
    sequences a step: the plan and the microbatch count of every ILP its search solved."""
    from autopar.planning import search

    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "1")
    solved: list[int] = []
    solve_ = search.solve
    monkeypatch.setattr(search, "solve", lambda problem, *a, **k: (solved.append(problem.microbatches),
                                                                   solve_(problem, *a, **k))[1])
    bundle = build_model("llama3-70b", global_batch=1024, seq=4096, device="meta")
    plan = autopar.plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn,
                        {"pp": 4, "dp": 4, "tp": 8}, example_targets=bundle.example_targets)
    return plan, list(solved)  # a copy: a later call's wrapper calls this one's


@pytest.mark.extended
def test_other_schedules_reuse_the_solution_of_the_counts_1f1b_solved(monkeypatch):
    """Interleaved and zero-bubble schedules hold more microbatches' activations than 1F1B at the same
    count and layers a device, and their ILP has the same objective: where 1F1B's optimum at a count fits
    their memory it is theirs, and where its bound cannot beat the cutoff neither can they. The pinned
    70B's free schedule search then solves fewer ILPs, to the step time solving every schedule gives.
    (The placements may differ where the ILP has several optima: a solve of the other schedule's memory
    row breaks their ties its own way.) On 100 GB devices: on 80 GB ones, since memory is checked stage by
    stage, more counts fit, 1F1B wins, and no 1F1B optimum fits the other schedules' memory (36 ILPs
    either way)."""
    from autopar.planning import search

    plan, reusing = _pinned_70b_solves(monkeypatch, "16x8xH100,mem=100GB")
    monkeypatch.setattr(search._MeshSearch, "_solved_before", lambda self, *args: None)
    solving_all, every = _pinned_70b_solves(monkeypatch, "16x8xH100,mem=100GB")
    assert plan.pipeline["schedule"] != "1f1b"  # another schedule won, on a reused solution
    assert len(reusing) < len(every)
    assert (plan.degrees, plan.pipeline) == (solving_all.degrees, solving_all.pipeline)
    assert plan.predicted["step_time_s"] == pytest.approx(solving_all.predicted["step_time_s"], rel=1e-12)


@pytest.mark.extended
def test_a_pinned_pipeline_searched_under_zero_one_first_reaches_the_other_orders_plan(monkeypatch):
    """The pinned 70B pipeline's fewest counts do not fit without ZeRO, and ZeRO-1's plan wins: searched
    first (``fewest_count_refused``), or second, the plan and its step time are the same. (ZeRO-1 first solved
    fewer ILPs while a mesh the cutoff pruned without ZeRO was not searched under it; now that it is, the
    order solves 9 ILPs here against 8.)"""
    from autopar.planning import search

    plan, zero_one_first = _pinned_70b_solves(monkeypatch)
    monkeypatch.setattr(search._MeshSearch, "fewest_count_refused", lambda self, mesh: False)
    other, plain_first = _pinned_70b_solves(monkeypatch)
    assert plan.degrees.zero == 1 and zero_one_first and plain_first
    assert (plan.degrees, plan.pipeline) == (other.degrees, other.pipeline)
    assert plan.predicted["step_time_s"] == pytest.approx(other.predicted["step_time_s"], rel=1e-12)


def test_a_cp_degree_the_model_cannot_split_fails_its_mesh_not_the_search():
    """A free search that tries a ``cp`` degree whose chunks are shorter than the model's routing groups
    (tiny-moe routed in groups of 8 tokens at 32 tokens: chunks of 8 at cp=2, of 4 at cp=4) records that
    mesh as one that does not fit, with the reason, and goes on; pinned, the same degree is refused."""
    from autopar.core.axes import MeshAxis
    from autopar.core.errors import BadInputError
    from autopar.planning.progress import SearchProgress
    from autopar.planning.search import _MeshSearch, context_parallel_meshes

    bundle = build_model("tiny-moe", overrides={"seq": 32, "group_size": 8}, global_batch=8)
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    cluster = parse_cluster("1x8xcpu")
    search = _MeshSearch(captured, cluster, "fp32", 1e9, 8, Constraints(), SearchProgress())
    meshes = context_parallel_meshes(captured, cluster, Constraints(), 8)
    cp4 = next(m for m in meshes if m.size(MeshAxis.CP) == 4)
    found = search.run(cp4, None)
    assert isinstance(found, str) and "consecutive tokens" in found
    with pytest.raises(BadInputError, match="consecutive tokens"):
        autopar.plan(bundle.model, bundle.example_inputs, "1x8xcpu", bundle.loss_fn, {"cp": 4},
                     example_targets=bundle.example_targets)


def _warns_for_odd_items(i: int) -> int:
    """A task that warns as a mesh's search does when it meets an op without a sharding rule: odd items
    warn twice (the same text and place), every third item raises a second warning of its own."""
    if i % 2:
        for _ in range(2):
            warnings.warn(f"item {i % 4} warned", UserWarning)
    if i % 3 == 0:
        warnings.warn("a third warned", RuntimeWarning)
    return i


@pytest.mark.parametrize("count", [1, 2])
def test_the_warnings_of_tasks_run_in_workers_reach_the_caller_once_and_in_order(count):
    """What the meshes' searches warn, in forked workers too, is raised in the caller's process as the
    results are taken (in item order), under its filters, each text and place once; the same with one
    worker or two."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        with Workers(_warns_for_odd_items, count) as workers:
            assert [result for _, result in workers.in_order(9, lambda i: i)] == list(range(9))
    assert [(str(w.message), w.category) for w in caught] == [
        ("a third warned", RuntimeWarning), ("item 1 warned", UserWarning), ("item 3 warned", UserWarning)]
    assert {w.filename for w in caught} == {__file__}
