"""Closed-form costs (cost_models/symbolic.py): hand-computed values, the numeric functions built on
them, their rendering, and ``autopar explain`` showing a tensor-parallel all_reduce's formula."""

from __future__ import annotations

import json
import math

import pytest
import sympy
import torch
from torch.utils.flop_counter import flop_registry

from cli_runner import run_cli
from autopar.ir.capture import capture
from autopar.cost_models import COLLECTIVES, GroupTopology, collective_time, parse_cluster
from autopar.cost_models.pipeline import microbatches_in_flight, pipeline_bubble_fraction
from autopar.cost_models.symbolic import (
    ALGORITHMS,
    BUBBLE_FRACTION,
    HIERARCHICAL,
    MATMUL_FLOPS,
    MICROBATCHES_IN_FLIGHT,
    ONE_NODE,
    ONE_PER_NODE,
    RING_STEPS,
    RING_VOLUME,
    TIME_ARGUMENTS,
    B,
    alpha,
    ceil_log2,
    collective_time_expr,
    formula_text,
    layout_of,
    m,
    n,
    p,
    render_collective,
    ring_time,
    tensor_bytes_text,
    time_arguments,
    v,
)
from autopar.planning.assemble import model_dims
from autopar.planning.explanations import collective_terms
from autopar.models import build_model
from autopar.core.constraints import Constraints
from autopar.core.placement import strs_to_placements
from autopar.planning.search import make_plan
from autopar.planning.pricing import Pricer
from autopar.planning.strategies import Strategy

INTRA_BW, INTER_BW = 100e9, 10e9
INTRA_LAT, INTER_LAT, BASE = 1e-6, 5e-6, 10e-6


def topo(size: int, per_node: int) -> GroupTopology:
    return GroupTopology(size=size, per_node=per_node, nodes=math.ceil(size / per_node), intra_bw=INTRA_BW,
                         inter_bw=INTER_BW, intra_latency_s=INTRA_LAT, inter_latency_s=INTER_LAT,
                         base_latency_s=BASE)


# ---- formulas against hand-computed values --------------------------------------------------------

def test_all_reduce_ring_volume_is_2_p_minus_1_over_p() -> None:
    assert RING_VOLUME["all_reduce"] == 2 * (p - 1) / p * n
    assert RING_VOLUME["all_reduce"].subs({p: 8, n: 800}) == 1400  # 2 * 7/8 * 800
    assert formula_text(sympy.factor(RING_VOLUME["all_reduce"] / n)) == "2(p-1)/p"


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_gather_like_volume_is_p_minus_1_over_p(kind: str) -> None:
    assert RING_VOLUME[kind].subs({p: 4, n: 1000}) == 750


def test_broadcast_and_send_recv_move_the_whole_buffer() -> None:
    assert RING_VOLUME["broadcast"] == n and RING_VOLUME["send_recv"] == n
    assert RING_STEPS["broadcast"].subs(p, 8) == 7 and RING_STEPS["send_recv"] == 1


def test_ring_time_is_steps_times_alpha_plus_volume_over_bandwidth() -> None:
    assert ring_time("all_reduce") == 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / B
    # 4 ranks, 1 GB, 1 us steps, 100 GB/s: 6 us + 15 ms.
    assert float(ring_time("all_reduce").subs({p: 4, n: 1e9, alpha: 1e-6, B: 100e9})) == pytest.approx(6e-6 + 0.015)


def test_tree_depth_is_exact_for_powers_of_two() -> None:
    assert [ceil_log2(k) for k in (2, 3, 4, 5, 8, 2**29, 2**29 + 1)] == [1, 2, 2, 3, 3, 29, 30]


def test_pipeline_bubble_is_p_minus_1_over_m() -> None:
    assert BUBBLE_FRACTION["gpipe"] == BUBBLE_FRACTION["1f1b"] == (p - 1) / m
    assert BUBBLE_FRACTION["interleaved"] == (p - 1) / (v * m)
    assert pipeline_bubble_fraction("1f1b", stages=4, microbatches=8) == pytest.approx(3 / 8)
    assert pipeline_bubble_fraction("gpipe", stages=8, microbatches=32) == pytest.approx(7 / 32)
    assert pipeline_bubble_fraction("interleaved", stages=4, microbatches=8, chunks=2) == pytest.approx(3 / 16)
    assert pipeline_bubble_fraction("1f1b", stages=1, microbatches=4) == 0.0


def test_microbatches_in_flight_per_schedule() -> None:
    assert MICROBATCHES_IN_FLIGHT["gpipe"] == m
    assert microbatches_in_flight("gpipe", stages=4, microbatches=16) == 16
    assert microbatches_in_flight("1f1b", stages=4, microbatches=16) == 4
    assert microbatches_in_flight("1f1b", stages=8, microbatches=2) == 2
    assert microbatches_in_flight("interleaved", stages=4, microbatches=16, chunks=2) == pytest.approx(4 * (1 + 3 / 8))
    assert microbatches_in_flight("gpipe", stages=1, microbatches=16) == 1  # gradient accumulation


def test_pipeline_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="zero-bubble"):
        pipeline_bubble_fraction("zero-bubble", 4, 8)
    with pytest.raises(ValueError, match="microbatches"):
        pipeline_bubble_fraction("1f1b", 4, 0)
    with pytest.raises(ValueError, match="interleaved"):
        microbatches_in_flight("1f1b", 4, 8, chunks=2)


def test_matmul_flops_is_2mnk_as_torch_counts_them() -> None:
    a, b = torch.empty(64, 32, device="meta"), torch.empty(32, 16, device="meta")
    counted = flop_registry[torch.ops.aten.mm](a, b, out_val=None)
    assert float(MATMUL_FLOPS.subs({"m": 64, "k": 32, "n": 16})) == counted == 2 * 64 * 32 * 16


# ---- comm.py evaluates these formulas -----------------------------------------------------------

GROUPS = {ONE_NODE: topo(8, 8), ONE_PER_NODE: topo(64, 1), HIERARCHICAL: topo(16, 8)}


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("layout", list(GROUPS))
@pytest.mark.parametrize("nbytes", [1e3, 1e9])
def test_collective_time_is_the_symbolic_formula(kind: str, layout: str, nbytes: float) -> None:
    group = GROUPS[layout]
    assert layout_of(group) == layout
    values = dict(zip(TIME_ARGUMENTS, time_arguments(group, nbytes)))
    expected = float(collective_time_expr(kind, layout).subs(values))
    assert collective_time(kind, nbytes, group) == pytest.approx(expected, rel=1e-12)


def test_every_collective_has_an_algorithm_per_layout() -> None:
    assert set(ALGORITHMS) == set(COLLECTIVES)
    assert all(set(by_layout) == set(GROUPS) for by_layout in ALGORITHMS.values())


def test_hierarchical_all_reduce_by_hand() -> None:
    nbytes, group = 8e9, topo(16, 8)
    local = 2 * (7 * INTRA_LAT + 7 / 8 * nbytes / INTRA_BW)  # reduce_scatter + all_gather over 8 local ranks
    across = 2 * INTER_LAT + 2 * (1 / 2) * (nbytes / 8) / INTER_BW  # ring all_reduce of n/8 over 2 nodes
    assert collective_time("all_reduce", nbytes, group) == pytest.approx(local + across + BASE)


def test_tree_wins_for_small_buffers_on_many_nodes() -> None:
    shown = render_collective("all_reduce", topo(64, 1), "n", 1024.0)
    assert shown.algorithm == "tree" and "⌈log2 p⌉" in shown.formula
    assert collective_time("all_reduce", 1024.0, topo(64, 1)) == pytest.approx(
        12 * INTER_LAT + 2 * 1024 / INTER_BW + BASE)


# ---- rendering ----------------------------------------------------------------------------------

def test_render_tp_all_reduce_of_a_bf16_activation_on_nvlink() -> None:
    group = parse_cluster("1x8xH100").group((8,), 0)
    text, values = tensor_bytes_text((4, 2048, 8192), 2, {"b": 4, "s": 2048, "h": 8192})
    assert (text, values) == ("2·b·s·h", {"b": 4, "s": 2048, "h": 8192})
    shown = render_collective("all_reduce", group, text, 2 * 4 * 2048 * 8192)
    assert (shown.algorithm, shown.layout, shown.topology) == ("ring", ONE_NODE, {"p": 8})
    assert shown.formula == "2(p-1)/p · 2·b·s·h bytes / 370 GB/s + 2(p-1) · 0.6 us + 6.6 us"


def test_render_hierarchical_all_gather_names_both_links() -> None:
    group = parse_cluster("2x8xH100").group((16,), 0)
    shown = render_collective("all_gather", group, "n", 1e9)
    assert shown.topology == {"q": 8, "N": 2}
    assert "(q-1)/q · n bytes / 370 GB/s" in shown.formula and "(N-1)/(N·q) · n bytes / 46 GB/s" in shown.formula


def test_tensor_bytes_text_falls_back_to_sizes_and_divides_by_sharded_mesh_dims() -> None:
    text, values = tensor_bytes_text((8, 32, 100), 4, {"b": 8, "s": 32}, {"dp": 4})
    assert (text, values) == ("4·b·s·100/dp", {"b": 8, "s": 32, "dp": 4})
    assert tensor_bytes_text((1, 64), 1, {}, {"dp": 2, "tp": 2})[0] == "64/(dp·tp)"
    flat = tensor_bytes_text((256, 64), 2, {"b": 8, "s": 32, "b·s": 256, "h": 64})
    assert flat == ("2·b·s·h", {"b": 8, "s": 32, "h": 64})


# ---- autopar explain ----------------------------------------------------------------------------

def _strategies_from(plan, captured):
    """Node name -> chosen Strategy, read back from a Plan (what the planner's by_node holds)."""
    fqn_of = {**captured.params, **captured.buffers}

    def strategy_of(name: str) -> Strategy:
        if name in plan.ops:
            op = plan.ops[name]
            return Strategy(tuple(strs_to_placements(x) for x in op["inputs"]),
                            tuple(strs_to_placements(x) if x is not None else None for x in op["outputs"]))
        placed = plan.placements.get(fqn_of.get(name)) or plan.buffers.get(fqn_of.get(name)) \
            or plan.inputs.get(name, {}).get("placements") or ["R"] * len(plan.mesh["shape"])
        return Strategy((), (strs_to_placements(placed),))

    return strategy_of


@pytest.fixture(scope="module")
def tp_plan(tmp_path_factory):
    """tiny-gpt with tp=2 on 1x2xcpu, with the collectives (and model dims) the planner is to record."""
    bundle = build_model("tiny-gpt", global_batch=8, device="meta")
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    cluster = parse_cluster("1x2xcpu")
    plan = make_plan(captured, cluster, model_name="tiny-gpt", constraints=Constraints(tp=2))
    pricer = Pricer(cluster, plan.mesh["shape"], plan.model["dtype"], runtime=plan.predicted["runtime"])
    strategy_of = _strategies_from(plan, captured)
    data = plan.to_dict()
    for name, op in data["ops"].items():
        op["collectives"] = collective_terms(captured.node(name), captured, strategy_of, pricer)
    data["model"]["dims"] = model_dims(bundle.config)
    path = tmp_path_factory.mktemp("symbolic") / "plan.json"
    path.write_text(json.dumps(data))
    return data, path


def test_recorded_collectives_add_up_to_the_priced_communication(tp_plan) -> None:
    """Per decision (the plan spreads a tied decision's resharding evenly over its nodes), the recorded
    collectives' seconds are what pricing charged, by kind, and apart the gradient sync (a prefetched
    regather in it) and the forward gathers prefetched beside compute."""
    data, _ = tp_plan
    assert data["pipeline"]["microbatches"] == 1
    recorded: dict[str, dict[str, float]] = {}
    priced: dict[str, dict[str, float]] = {}
    for op in data["ops"].values():
        mine, theirs = recorded.setdefault(op["decision"], {}), priced.setdefault(op["decision"], {})
        for t in op["collectives"]:
            prefetched = t.get("prefetched", False)
            key = ("grad_sync" if t["grad_sync"] or prefetched and t["phase"] == "backward" else
                   "prefetched" if prefetched else t["kind"])
            mine[key] = mine.get(key, 0.0) + t["seconds"]
        for key, seconds in (*op["cost"]["comm_s"].items(), ("grad_sync", op["cost"]["grad_sync_s"]),
                             ("prefetched", op["cost"].get("prefetched_s", 0.0))):
            if seconds > 0:
                theirs[key] = theirs.get(key, 0.0) + seconds
    assert any("all_reduce" in r for r in recorded.values())
    for decision, comm in recorded.items():
        assert comm == pytest.approx(priced[decision]), decision


def test_explain_cli_shows_the_tp_all_reduce_formula(tp_plan) -> None:
    data, path = tp_plan
    name = next(n for n, op in data["ops"].items()
                if any(t["kind"] == "all_reduce" and not t["grad_sync"] for t in op["collectives"]))
    run = run_cli("explain", str(path), name)
    assert run.returncode == 0, run.stderr
    assert "collectives, in closed form" in run.stdout
    assert "all_reduce over tp" in run.stdout and "ring, one node" in run.stdout
    assert "2(p-1)/p · 4·b·s·h bytes / 5 GB/s + 2(p-1) · 50 us + 20 us  with b=8, s=32, h=64, p=2 ->" \
        in run.stdout


def test_explain_a_parameter_shows_its_collectives(tp_plan) -> None:
    from autopar.inspect.explain import render

    data, _ = tp_plan
    text = render(data, "lm_head.weight")
    assert "collectives" in text and "lm_head.weight" in text


def test_plans_without_recorded_collectives_show_no_formulas(tp_plan) -> None:
    from autopar.inspect.explain import render

    data, _ = tp_plan
    old = {**data, "ops": {k: {f: x for f, x in op.items() if f != "collectives"} for k, op in data["ops"].items()}}
    name = next(iter(data["ops"]))
    assert "closed form" not in render(old, name)
