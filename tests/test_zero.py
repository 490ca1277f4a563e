"""ZeRO-1/2 end to end: the plan's predicted gradient sync, then on 4 gloo ranks the sharded optimizer
(``passes/zero.py``): numerical parity with single-process training, optimizer state really sharded,
and the collectives of a step as predicted. FSDP x TP (ZeRO-3 on a 2-D mesh) parity is in the heavy
tier."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar.ir.capture import capture
from autopar.inspect.collectives import predicted_collectives
from autopar.cost_models import parse_cluster
from autopar.testing.launch import run_on_ranks
from autopar.models import build_model
from autopar.testing.parity import AutoparResult, build, train_counting, train_single
from autopar.core.constraints import Constraints
from autopar.planning.search import make_plan

STEPS = 3
BATCH = 8
WORLD = 4


@pytest.fixture(scope="module")
def llama():
    b = build_model("tiny-llama", global_batch=BATCH)
    return capture(b.model, b.example_inputs, b.example_targets, b.loss_fn)


def _plan(captured, constraints):
    return make_plan(captured, parse_cluster("1x4xcpu"), model_name="tiny-llama",
                     constraints=Constraints.from_mapping(constraints))


def test_zero_gradient_sync_is_reduce_scatter_then_all_gather(llama):
    ddp, zero1 = _plan(llama, {"dp": 4, "fsdp": 0}), _plan(llama, {"dp": 4, "fsdp": 1})
    ddp_sync = predicted_collectives(ddp.to_dict(), ["grad_sync"])
    zero_sync = predicted_collectives(zero1.to_dict(), ["grad_sync"])
    assert set(ddp_sync) == {"all_reduce"}
    assert zero_sync["reduce_scatter"] == zero_sync["all_gather"] == len(zero1.placements)  # one pair per parameter
    assert "all_reduce" not in zero_sync


def test_zero2_reduces_every_microbatch(llama):
    one = predicted_collectives(_plan(llama, {"dp": 4, "fsdp": 2, "microbatches": 1}).to_dict(), ["grad_sync"])
    two = predicted_collectives(_plan(llama, {"dp": 4, "fsdp": 2, "microbatches": 2}).to_dict(), ["grad_sync"])
    assert two["reduce_scatter"] == 2 * one["reduce_scatter"] and two["all_gather"] == one["all_gather"]


def test_zero_sync_costs_more_latency_but_less_memory_than_ddp(llama):
    ddp, zero2 = _plan(llama, {"dp": 4, "fsdp": 0}), _plan(llama, {"dp": 4, "fsdp": 2})
    assert zero2.predicted["grad_sync_s"] > ddp.predicted["grad_sync_s"]  # per-parameter pairs, not buckets
    # fp32: DDP's two moments (8 bytes a parameter) against a quarter of them and of the fp32 shard (12 / 4)
    assert zero2.predicted["memory_bytes"]["optimizer"] == pytest.approx(ddp.predicted["memory_bytes"]["optimizer"]
                                                                         * 12 / 8 / 4)


def test_free_search_shards_optimizer_state_when_memory_binds() -> None:
    """With room and bf16 gradient reductions, data parallelism keeps whole optimizer state (DDP's
    all_reduce moves what ZeRO-1's reduce_scatter and all_gather move, and hides behind backward); when
    it does not fit, the free search shards state, at least as fast as ZeRO-1 (Megatron-LM's distributed
    optimizer) and as sharding every parameter, each pinned: on the lowered runtime it shards the largest
    parameters, whose gathers are prefetched beside compute. With fp32 reductions (the default) ZeRO-1
    wins even with room: its parameter all_gather moves bf16, half of what DDP's all_reduce gathers."""
    b = build_model("llama3-8b", overrides={"layers": 2}, global_batch=8, seq=1024, device="meta")
    captured = capture(b.model, b.example_inputs, b.example_targets, b.loss_fn)
    plan = lambda c: make_plan(captured, parse_cluster("1x8xH100"), model_name="llama3-8b",  # noqa: E731
                               constraints=Constraints.from_mapping({"reduce_dtype": "bf16", **c}))
    roomy, tight = plan({"dp": 8}), plan({"dp": 8, "memory_gb": 15})
    zero1, fsdp = plan({"dp": 8, "memory_gb": 15, "fsdp": 1}), plan({"dp": 8, "memory_gb": 15, "fsdp": 3})
    assert plan({"dp": 8, "reduce_dtype": "fp32"}).degrees.zero == 1
    assert not roomy.degrees.zero and roomy.degrees.fsdp == 1
    assert roomy.predicted["peak_memory_bytes"] > 15e9  # so the tight plan could not be DDP
    assert zero1.degrees.zero == 1 and zero1.predicted["peak_memory_bytes"] <= 15e9
    assert tight.degrees.zero and tight.predicted["peak_memory_bytes"] <= 15e9
    assert tight.predicted["step_time_s"] <= min(zero1.predicted["step_time_s"], fsdp.predicted["step_time_s"])
    assert tight.predicted["step_time_s"] > roomy.predicted["step_time_s"]
    assert tight.predicted["memory_bytes"]["optimizer"] < roomy.predicted["memory_bytes"]["optimizer"]


RUNS = [("tiny-llama", {"dp": 4, "fsdp": 1}), ("tiny-llama", {"dp": 4, "fsdp": 2, "microbatches": 2}),
        ("tiny-gpt", {"dp": 2, "tp": 2, "fsdp": 1})]
FSDP_TP_RUNS = [("tiny-gpt", {"dp": 2, "tp": 2, "fsdp": 3}), ("tiny-llama", {"dp": 2, "tp": 2, "fsdp": 3})]
"""FSDP (ZeRO-3) on a 2-D mesh, weights sharded on both dims (heavy tier: one more spawn)."""


def _train_rank(rank: int, world: int, runs: list[tuple[str, dict]]) -> list[dict[str, Any]]:
    return [_train(name, constraints) for name, constraints in runs]


def _train(name: str, constraints: dict) -> dict[str, Any]:
    """Three SGD steps under the plan (as ``autopar.testing.parity.train_module``), counting the
    collectives of the last; what each rank holds, and the optimizer state AdamW keeps for the
    parameters ``pm.parameters()`` hands it."""
    import autopar

    bundle = build(name, None, BATCH, None, seed=0)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints=constraints,
                                 lowered=False)  # the collectives counted are the DTensor runtime's, one per redistribute
    return {**train_counting(pm, bundle, STEPS, seed=0), "state_numel": _adamw_state_numel(pm),
            "numel": sum(p.numel() for p in bundle.model.parameters())}


def _adamw_state_numel(pm: Any) -> int:
    """Elements of AdamW's first moment on this rank once it has updated ``pm.parameters()`` (with their
    last gradients): AdamW keeps state shaped like the tensors it is given, which ZeRO shards."""
    adamw = torch.optim.AdamW(pm.parameters())
    adamw.step()
    return sum(state["exp_avg"].to_local().numel() for state in adamw.state.values())


@pytest.fixture(scope="module")
def trained() -> list[list[dict[str, Any]]]:
    return run_on_ranks(_train_rank, WORLD, RUNS)


@pytest.fixture(scope="module")
def trained_fsdp_tp() -> list[list[dict[str, Any]]]:
    return run_on_ranks(_train_rank, WORLD, FSDP_TP_RUNS)


def _check_parity(name: str, per_rank_results: list[dict[str, Any]]) -> None:
    AutoparResult.from_ranks(per_rank_results).assert_matches(train_single(name, None, BATCH, None, STEPS))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RUNS)), ids=[f"{n}-{c}" for n, c in RUNS])
def test_matches_single_process(trained, index: int) -> None:
    _check_parity(RUNS[index][0], [per_rank[index] for per_rank in trained])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("index", range(len(FSDP_TP_RUNS)), ids=[f"{n}-{c}" for n, c in FSDP_TP_RUNS])
def test_fsdp_times_tp_matches_single_process(trained_fsdp_tp, index: int) -> None:
    _check_parity(FSDP_TP_RUNS[index][0], [per_rank[index] for per_rank in trained_fsdp_tp])
    assert trained_fsdp_tp[0][index]["plan"]["degrees"]["fsdp"] == 2


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1, 2], ids=[f"{n}-{c}" for n, c in RUNS[:3]])
def test_optimizer_state_is_sharded_over_data_parallel_ranks(trained, index: int) -> None:
    result = trained[0][index]
    assert result["plan"]["degrees"]["zero"] == RUNS[index][1]["fsdp"]
    dp = result["plan"]["degrees"]["dp"]
    # every parameter with a free dim is split dp ways (tp shards the rest of the 2-D plan's weights)
    assert result["state_numel"] <= result["numel"] / dp * 1.05


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1], ids=[f"{n}-{c}" for n, c in RUNS[:2]])
def test_data_parallel_zero_step_runs_the_predicted_collectives(trained, index: int) -> None:
    """Under pure data parallelism the forward runs none, and the step exactly the plan's gradient
    reduce_scatters (per microbatch under ZeRO-2) and parameter all_gathers."""
    result = trained[0][index]
    assert result["counted"] == predicted_collectives(result["plan"])


def test_a_resharding_costs_the_same_under_zero_one_so_a_meshs_two_searches_share_its_price(llama) -> None:
    """The search of a mesh under ZeRO-1 after its search without (``_MeshSearch.search_mesh``) reuses the
    first one's strategies and resharding prices (``Pricer.share_edge_prices``): every edge the two
    problems have in common is priced the same, pair by pair, built apart; and only a pricer of the same
    mesh, dtype and runtime may share them."""
    from autopar.planning.meshes import MeshChoice
    from autopar.core.axes import MeshAxis
    from autopar.planning.roles import pricer_for, problem_for

    cluster = parse_cluster("1x4xH100")
    mesh = MeshChoice(((MeshAxis.DP_SHARD, 2), (MeshAxis.TP, 2)), 1)
    plain, zero_one = Constraints(), Constraints(zero_stage=1)
    problems = [problem_for(llama, mesh, pricer_for(cluster, mesh, "bf16", c), 80e9, c) for c in (plain, zero_one)]
    prices = [{(e.src, e.src_out, e.dst, e.slot, pair): cost.exposed_s for e in p.edges for pair, cost in e.price.items()}
              for p in problems]
    common = prices[0].keys() & prices[1].keys()
    assert len(common) > 100
    assert all(prices[0][k] == prices[1][k] for k in common)
    other = MeshChoice(((MeshAxis.DP_SHARD, 4),), 1)
    with pytest.raises(ValueError, match="one mesh, dtype and runtime"):
        pricer_for(cluster, other, "bf16", plain).share_edge_prices(pricer_for(cluster, mesh, "bf16", plain).edge_prices())


def _options_and_edges(problem) -> tuple[dict, dict]:
    options = {key: [(o.strategy, o.cost, o.grad_partial, o.gathered_bytes) for o in d.options]
               for key, d in problem.decisions.items()}
    edges = {(e.src, e.src_out, e.dst, e.slot): (e.count, e.price) for e in problem.edges}
    return options, edges


def test_a_meshs_second_problem_reads_what_reads_no_weight_from_its_first_as_if_built_apart(llama) -> None:
    """The problem of a mesh under ZeRO-1 built after the one without, on the same ``MeshTrace``, takes the
    options of the ops that read no weight and the prices of the edges from what is no weight from the first
    (``problem.PricedAlike``): it equals, option by option and edge by edge, the problem built apart, whose
    weights' options and prices differ from the first's; the first is untouched; and a pricer of another
    dtype may not read those prices."""
    from autopar.core.axes import MeshAxis
    from autopar.planning.meshes import MeshChoice
    from autopar.planning.roles import mesh_cp_attention, mesh_trace, pricer_for, problem_for

    cluster = parse_cluster("1x4xH100")
    mesh = MeshChoice(((MeshAxis.DP_SHARD, 2), (MeshAxis.TP, 2)), 1)
    plain, zero_one = Constraints(), Constraints(zero_stage=1)
    trace = mesh_trace(llama, mesh, mesh_cp_attention(pricer_for(cluster, mesh, "bf16", plain), plain))
    built = {}
    for name, c, shared in (("first", plain, trace), ("second", zero_one, trace), ("apart", zero_one, None)):
        built[name] = _options_and_edges(problem_for(llama, mesh, pricer_for(cluster, mesh, "bf16", c), 80e9, c,
                                                     shared))
    assert trace.priced.options and trace.priced.edges
    assert built["second"] == built["apart"]
    assert built["second"][0] != built["first"][0]  # ZeRO-1 pins and prices the weights otherwise
    assert built["first"] == _options_and_edges(problem_for(llama, mesh, pricer_for(cluster, mesh, "bf16", plain),
                                                            80e9, plain))
    with pytest.raises(ValueError, match="one mesh, dtype and runtime"):
        problem_for(llama, mesh, pricer_for(cluster, mesh, "fp32", plain), 80e9, plain, trace)


def test_a_plan_sharding_parameters_over_cp_may_be_searched_again_under_zero_one() -> None:
    """A plan that shards parameters over a context-parallel dim (FSDP over ``cp``) is one ZeRO-1 may
    replace: its optimizer state split over the same ranks (``ZERO_AXES``). The rule that sends a mesh's
    search again under ZeRO-1 (``_MeshSearch.shards_parameters_over_data_dims``) counts ``cp`` as it counts
    ``dp``; it looked at data-parallel dims alone, so a cp-only mesh never qualified."""
    from autopar.core.axes import MeshAxis
    from autopar.planning.meshes import MeshChoice
    from autopar.planning.progress import SearchProgress
    from autopar.planning.search import Candidate, _MeshSearch

    b = build_model("llama3-8b", overrides={"layers": 2}, global_batch=1, seq=8192, device="meta")
    captured = capture(b.model, b.example_inputs, b.example_targets, b.loss_fn)

    def searched(dims: tuple, fsdp: int) -> tuple[_MeshSearch, Candidate]:
        search = _MeshSearch(captured, parse_cluster("1x8xH100"), "bf16", 80e9, 1,
                             Constraints.from_mapping({"fsdp": fsdp}), SearchProgress())
        found = search.run(MeshChoice(dims, 1), None)
        assert isinstance(found, Candidate)
        return search, found

    for dims in (((MeshAxis.CP, 8),), ((MeshAxis.CP, 4), (MeshAxis.TP, 2))):
        search, sharded = searched(dims, fsdp=3)
        assert search.shards_parameters_over_data_dims(sharded)
        search, whole = searched(dims, fsdp=0)
        assert not search.shards_parameters_over_data_dims(whole)
