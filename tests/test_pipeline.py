"""Pipeline stages, schedules and activation checkpointing in the planner (autopar/planning/stages.py), without
processes: the staging arithmetic by hand, then plans of a GPT on meta tensors with pinned degrees."""

from __future__ import annotations

import dataclasses
import math

import pytest

import autopar
from autopar.core.plan import CHECKPOINTING
from autopar import BadInputError
from autopar.ir.capture import capture
from autopar.cost_models import parse_cluster
from autopar.models import build_model
from autopar.core.constraints import Constraints
from autopar.planning.search import make_plan
from autopar.core.axes import MeshAxis
from autopar.planning.meshes import MeshChoice
from autopar.planning.roles import pricer_for, problem_for
from autopar.planning.stages import FewestHeld, Staging, device_layers, layer_roles, stage_problem, staged_alike
from autopar.cost_models.pipeline import (Action, held_activations, last_chunk_in_flight, least_bubble_fraction,
                                          microbatches_in_flight, pipeline_bubble_fraction, simulate,
                                          torch_schedule_order)
from autopar.api import reprice

CLUSTER = "4x8xA100-80GB"


# ---- staging arithmetic -------------------------------------------------------------------------

def test_in_flight_microbatches_per_schedule():
    assert Staging(1, 8).in_flight(16) == 1
    assert Staging(4, 8, "gpipe").in_flight(16) == 16  # GPipe holds every microbatch
    assert Staging(4, 8, "1f1b").in_flight(16) == 4  # 1F1B: at most p on the first stage
    assert Staging(4, 8, "1f1b").in_flight(2) == 2
    # interleaved: p (1 + (p - 1) / (p v)) (Korthikanti et al. 2022)
    assert Staging(4, 8, "interleaved", chunks=2).in_flight(16) == pytest.approx(4 * (1 + 3 / 8))
    # the last chunk (head, loss): every microbatch under GPipe, one under 1F1B and interleaved
    assert Staging(4, 8, "gpipe").last_chunk_in_flight(16) == 16
    assert Staging(4, 8, "1f1b").last_chunk_in_flight(16) == 1
    assert Staging(4, 8, "interleaved", chunks=2).last_chunk_in_flight(16) == 1
    assert Staging(1, 8).last_chunk_in_flight(16) == 1


def test_bubble_fraction_is_p_minus_1_over_v_m():
    assert Staging(4, 8, "1f1b").bubble_fraction(12) == pytest.approx(3 / 12)
    assert Staging(4, 8, "interleaved", chunks=2).bubble_fraction(12) == pytest.approx(3 / 24)
    assert Staging(1, 8).bubble_fraction(5) == 0


# ---- schedules simulated from torch's action tables ---------------------------------------------

@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8), (4, 12), (8, 16), (2, 2), (3, 8), (4, 6), (8, 12)])
def test_the_closed_forms_match_a_simulation_of_torchs_schedules(stages, microbatches):
    """``cost_models/pipeline.py``'s formulas against ``simulate`` of torch's own tables: GPipe (torch's
    looped BFS over one chunk a device), 1F1B (its interleaved schedule at one chunk, whose bubble is
    1F1B's) and interleaved 1F1B over two chunks, whose activations in flight are Korthikanti et al.'s."""
    def simulated(torch_class: str, chunks: int):
        return simulate(torch_schedule_order(torch_class, stages, microbatches, chunks), chunks)
    gpipe, one_f_one_b = simulated("ScheduleLoopedBFS", 1), simulated("ScheduleInterleaved1F1B", 1)
    interleaved = simulated("ScheduleInterleaved1F1B", 2)
    assert gpipe.bubble_fraction == pytest.approx(pipeline_bubble_fraction("gpipe", stages, microbatches))
    assert gpipe.in_flight == microbatches_in_flight("gpipe", stages, microbatches) == microbatches
    assert gpipe.last_in_flight == last_chunk_in_flight("gpipe", stages, microbatches)
    assert one_f_one_b.bubble_fraction == pytest.approx(pipeline_bubble_fraction("1f1b", stages, microbatches))
    assert interleaved.bubble_fraction == pytest.approx(pipeline_bubble_fraction("interleaved", stages, microbatches, 2))
    assert interleaved.in_flight == pytest.approx(microbatches_in_flight("interleaved", stages, microbatches, 2))
    assert interleaved.last_in_flight == last_chunk_in_flight("interleaved", stages, microbatches, 2) == 1


@pytest.mark.parametrize("stages, microbatches, chunks", [(2, 4, 1), (4, 8, 1), (8, 16, 1), (4, 8, 2), (8, 32, 2)])
def test_zero_bubble_is_priced_from_torchs_table(stages, microbatches, chunks):
    """torch's ``ScheduleInterleavedZeroBubble`` (ZB-1p) simulated with equal F, B and W: the bubble of
    Qi et al. (2024, §3.1), ``(p - 1)(T_F + T_B - T_W)`` against 1F1B's ``(p - 1)(T_F + T_B + T_W)``, a
    third of 1F1B's at as many chunks; ``p`` microbatches in flight as under 1F1B, and the last chunk's
    held until their deferred weight gradients run."""
    one_f_one_b = pipeline_bubble_fraction("interleaved" if chunks > 1 else "1f1b", stages, microbatches, chunks)
    assert Staging(stages, 8, "zero_bubble", chunks).bubble_fraction(microbatches) == pytest.approx(one_f_one_b / 3)
    assert microbatches_in_flight("zero_bubble", stages, microbatches, chunks) == stages
    assert last_chunk_in_flight("zero_bubble", stages, microbatches, chunks) == stages


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_the_least_bubble_bounds_the_simulated_one_and_meets_it_with_a_microbatch_per_stage(stages):
    """``least_bubble_fraction`` (what the search prunes pipelines by, simulating nothing) is at most
    the simulated bubble of torch's zero-bubble table at every size it runs, equal to it once there are
    at least as many microbatches as stages, and the formula itself for the schedules that have one."""
    for chunks in (1, 2, 3):
        for microbatches in (1, 2, 4, 8, 16):
            if microbatches % max(1, microbatches // stages):
                continue  # torch runs them in rounds of equal size
            simulated = pipeline_bubble_fraction("zero_bubble", stages, microbatches, chunks)
            least = least_bubble_fraction("zero_bubble", stages, microbatches, chunks)
            assert least <= simulated + 1e-12
            if microbatches >= stages:
                assert least == pytest.approx(simulated)
    assert least_bubble_fraction("interleaved", stages, 8, 2) == pipeline_bubble_fraction("interleaved", stages, 8, 2)
    assert Staging(1, 8, "zero_bubble", 2).least_bubble_fraction(8) == 0.0


def test_zero_bubble_depends_on_the_split_of_the_backward():
    """Weight-gradient steps fill the bubble only as far as they last: with none (W = 0) the zero-bubble
    table is as slow as 1F1B; with a backward of B = 2 and W = 1 the bubble is Qi et al.'s
    ``(p - 1)(F + B - W) / (m (F + B + W))``."""
    order = torch_schedule_order("ScheduleInterleavedZeroBubble", 4, 8, 1)
    assert simulate(order, 1, (1.0, 1.0, 0.0)).bubble_fraction == pytest.approx(3 / 8)
    assert simulate(order, 1, (1.0, 2.0, 1.0)).bubble_fraction == pytest.approx(3 * 2 / (8 * 4))


@pytest.mark.parametrize("stages, microbatches, chunks", [(2, 2, 1), (4, 2, 1), (4, 8, 2), (4, 3, 3), (8, 16, 2)])
def test_the_table_is_torchs_order_of_each_devices_actions_without_its_idle_slots(stages, microbatches, chunks):
    """``torch_schedule_order`` skips the pass torch's zero-bubble schedule pads each device's order with
    (``_add_bubbles_to_actions``); built with it, the installed torch's table has the same actions in the
    same order on every device, with idle slots (None) between them where fewer microbatches than stages
    leave devices waiting."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    stand_ins = [SimpleNamespace(num_stages=stages * chunks, group_size=stages, group_rank=0,
                                 stage_index=i * stages, submod=None) for i in range(chunks)]
    padded = type("Padded", (ScheduleInterleavedZeroBubble,),
                  {"_prepare_schedule_with_comms": lambda self, *args: None})(stand_ins, microbatches,
                                                                                 loss_fn=lambda y, target: y)
    table = torch_schedule_order("ScheduleInterleavedZeroBubble", stages, microbatches, chunks)
    assert sorted(table) == sorted(padded.pipeline_order)
    for device, actions in padded.pipeline_order.items():
        kept = [(a.stage_index, a.microbatch_index) for a in actions if a is not None]
        assert kept == [(a.stage, a.microbatch) for a in table[device]]
    if microbatches < stages:
        assert any(a is None for actions in padded.pipeline_order.values() for a in actions)


def test_the_activations_held_follow_from_each_devices_order_of_actions(monkeypatch):
    """``held_activations`` by hand: two devices, two chunks of one layer each (no interleaving). Device 0
    runs F0 F1 BW0 F2 BW1 BW2: two microbatches held at most; device 1 (the last chunk's) runs F0 F1 B0
    F2 W0 B1 B2 W1 W2: its W frees, its B does not, so three at most, and the last chunk holds three. The
    planner reads them without simulating a table (``microbatches_in_flight`` of zero bubble), which
    ``simulate`` reports alike."""
    from autopar.cost_models import pipeline

    order = {0: [Action(0, k, mb) for k, mb in (("F", 0), ("F", 1), ("BW", 0), ("F", 2), ("BW", 1), ("BW", 2))],
             1: [Action(1, k, mb) for k, mb in (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("W", 0), ("B", 1),
                                                ("B", 2), ("W", 1), ("W", 2))]}
    held = held_activations(order, 1)
    assert (held.in_flight, held.last_in_flight, held.last_stage_in_flight) == (3, 3, 3)
    assert held_activations({0: order[0]}, 1).in_flight == 2
    simulated = simulate(order, 1)
    assert (simulated.in_flight, simulated.last_in_flight, simulated.last_stage_in_flight) == (3, 3, 3)
    expected = simulate(torch_schedule_order("ScheduleInterleavedZeroBubble", 4, 16, 2), 2).in_flight
    monkeypatch.setattr(pipeline, "simulate", None)  # not called
    pipeline.held_in_schedule.cache_clear()
    assert microbatches_in_flight("zero_bubble", 4, 16, 2) == expected


def test_a_table_whose_actions_wait_on_each_other_is_refused():
    backward_first = {0: [Action(0, "B", 0), Action(0, "F", 0)], 1: [Action(1, "F", 0), Action(1, "B", 0)]}
    with pytest.raises(ValueError, match="wait on each other"):
        simulate(backward_first, 1)
    with pytest.raises(ValueError, match="microbatches to be a multiple"):
        pipeline_bubble_fraction("zero_bubble", 4, 9)  # torch runs 9 microbatches on 4 stages in 2 rounds: refused
    with pytest.raises(ValueError, match="chunks=2 needs a schedule of several chunks"):
        pipeline_bubble_fraction("1f1b", 4, 8, 2)


def test_layers_per_stage_round_up():
    assert Staging(4, 8).layers_per_stage == 2
    assert Staging(4, 10).layers_per_stage == 3  # the slowest stage bounds the pipeline
    assert Staging(2, 8, "interleaved", chunks=2).layers_per_stage == 4
    assert Staging(2, 10, "interleaved", chunks=2).layers_per_stage == 6  # 2 chunks of ceil(10 / 4)


# ---- plans --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt8():
    """An 8-layer GPT (about 0.4B parameters) at global batch 64, captured once."""
    b = build_model("gpt-megatron", global_batch=64, overrides={"layers": 8, "hidden": 2048, "heads": 16, "seq": 1024})
    return capture(b.model, b.example_inputs, b.example_targets, b.loss_fn)


def _plan(captured, constraints, cluster=CLUSTER):
    return make_plan(captured, parse_cluster(cluster), model_name="gpt8",
                     constraints=Constraints.from_mapping(constraints))


@pytest.fixture(scope="module")
def pp2(gpt8):
    return _plan(gpt8, {"pp": 2, "tp": 8, "microbatches": 8, "schedule": "1f1b"})


@pytest.fixture(scope="module")
def interleaved2(gpt8):
    return _plan(gpt8, {"pp": 2, "tp": 8, "microbatches": 8, "schedule": "interleaved", "virtual_stages": 2})


@pytest.fixture(scope="module")
def zero_bubble(gpt8):
    return _plan(gpt8, {"pp": 2, "tp": 8, "microbatches": 8, "schedule": "zero_bubble"})


def test_a_free_schedule_takes_the_fastest_schedule_priced(gpt8, pp2, interleaved2, zero_bubble):
    """With the schedule free, the search tries interleaved 1F1B with 2, 4, ... chunks per device after
    1F1B, then torch's zero-bubble schedule with 1, 2, ... chunks: on this pipeline the bubble costs
    more than the sends more chunks add, and zero bubble's is a third of 1F1B's at as many chunks."""
    free = _plan(gpt8, {"pp": 2, "tp": 8, "microbatches": 8})
    assert free.pipeline["schedule"] == "zero_bubble" and free.pipeline["virtual_stages"] == 2
    assert free.predicted["step_time_s"] < min(p.predicted["step_time_s"] for p in (pp2, interleaved2, zero_bubble))
    assert free.predicted["bubble_s"] == pytest.approx(interleaved2.predicted["bubble_s"] / 3, rel=0.05)
    assert free.pipeline["stages"] == [[0, 2], [2, 4], [4, 6], [6, 8]]  # chunk i on stage i mod 2


def test_interleaved_pinned_without_chunks_searches_them(gpt8):
    """``schedule=interleaved`` with no ``virtual_stages`` (a published run whose chunks are unstated) is
    searched from 2 chunks up as the free search does, never leaving interleaved 1F1B: at 2 microbatches
    the bubble is large, and 4 chunks of one layer beat 2 (half the bubble for twice the sends)."""
    fixed = {"pp": 2, "tp": 8, "microbatches": 2, "schedule": "interleaved"}
    searched = _plan(gpt8, fixed)
    two, four = (_plan(gpt8, {**fixed, "virtual_stages": v}) for v in (2, 4))
    assert four.predicted["step_time_s"] < two.predicted["step_time_s"]
    assert searched.pipeline["schedule"] == "interleaved" and searched.pipeline["virtual_stages"] == 4
    assert searched.predicted["step_time_s"] == pytest.approx(four.predicted["step_time_s"], rel=1e-12)


def test_a_pinned_zero_bubble_schedule_prices_a_smaller_bubble_than_1f1b(pp2, zero_bubble):
    """The same degrees and microbatches: torch's zero-bubble schedule (ZB-1p, Qi et al. 2024) fills
    1F1B's bubble with weight-gradient steps, leaving a third of it with forward, input- and
    weight-gradient steps equally long (``cost_models.pipeline.F_B_W``), for the head's activations
    held until its deferred weight gradients run: more memory than 1F1B."""
    assert zero_bubble.degrees == pp2.degrees and zero_bubble.pipeline["stages"] == pp2.pipeline["stages"]
    assert zero_bubble.pipeline["schedule"] == "zero_bubble" and zero_bubble.pipeline["virtual_stages"] == 1
    assert zero_bubble.predicted["bubble_s"] == pytest.approx(pp2.predicted["bubble_s"] / 3, rel=0.05)
    assert zero_bubble.predicted["step_time_s"] < pp2.predicted["step_time_s"]
    assert zero_bubble.predicted["peak_memory_bytes"] > pp2.predicted["peak_memory_bytes"]
    assert "pp=2 zero_bubble" in zero_bubble.summary()


def test_a_pipeline_is_pruned_only_where_no_schedule_the_search_may_pick_could_win(gpt8):
    """The search skips a pipeline mesh unsolved, and stretches 1F1B's cutoff, by the least bubble of
    the schedules it may still pick there: at the most microbatches (64 / dp 2 = 32) and chunks (4),
    interleaved 1F1B's (p - 1) / (v m) and zero bubble's simulated one (about a third of that), not
    1F1B's (p - 1) / m. A mesh whose best rival exposes less than 1F1B's bubble but more than zero
    bubble's is searched (``make_plan`` once skipped it: Llama 3 70B on 1,024 H100s then missed a
    zero-bubble plan 9.5% faster, benchmarks/README.md)."""
    from types import SimpleNamespace

    from autopar.planning.progress import SearchProgress
    from autopar.planning.search import _MeshSearch, _pipeline_cannot_win

    def search(constraints):
        return _MeshSearch(gpt8, parse_cluster(CLUSTER), "bf16", 80e9, 64, Constraints.from_mapping(constraints),
                           SearchProgress())
    mesh = MeshChoice(((MeshAxis.DP_SHARD, 2), (MeshAxis.TP, 8)), stages=2)
    one_f_one_b = search({"schedule": "1f1b"}).least_bubble(mesh)
    free = search({}).least_bubble(mesh)
    assert one_f_one_b == pytest.approx(1 / 32)
    assert free == pytest.approx(pipeline_bubble_fraction("zero_bubble", 2, 32, 4))
    assert free < pipeline_bubble_fraction("interleaved", 2, 32, 4) == pytest.approx(1 / 128)
    assert search({"schedule": "1f1b"}).least_bubble(mesh, after_first=True) == math.inf  # nothing after 1F1B
    assert search({}).least_bubble(mesh, after_first=True) == free
    rival = SimpleNamespace(compute_s=1.0, step_s=1.0 + 1 / 64)  # exposes half of 1F1B's bubble
    assert _pipeline_cannot_win(mesh, rival, one_f_one_b) and not _pipeline_cannot_win(mesh, rival, free)


def test_interleaving_chunks_leave_no_chunk_empty_and_no_device_more_layers():
    from autopar.planning.search import interleaving_chunks, runs_interleaved

    assert interleaving_chunks(8, 2) == [2, 4]
    assert interleaving_chunks(80, 4) == [2, 4, 5, 10, 20]
    assert interleaving_chunks(6, 4) == []
    # uneven: Llama 3 405B's 126 layers on 16 stages, 32 chunks of 3-4 or 64 of 1-2 (8 layers a device,
    # as 1F1B); 48 chunks are priced at 3 layers each, 9 a device
    assert interleaving_chunks(126, 16) == [2, 4]
    assert interleaving_chunks(7, 2) == [2]  # chunks of 2, 2, 2, 1: 4 and 3 layers a device
    assert runs_interleaved(8, 2) and runs_interleaved(3, 4) and not runs_interleaved(9, 4)  # rounds of 4 and 5


def test_pinned_pipeline_degree(pp2):
    assert pp2.degrees["pp"] == 2 and pp2.degrees["tp"] == 8 and pp2.degrees["dp"] == 2
    assert pp2.mesh == {"shape": [2, 8], "dim_names": ["dp", "tp"]}  # one stage's submesh
    assert pp2.pipeline["stages"] == [[0, 4], [4, 8]]
    assert pp2.pipeline["schedule"] == "1f1b" and pp2.pipeline["microbatches"] == 8
    assert pp2.pipeline["microbatch_size"] == 64 // (8 * 2)


def test_pipeline_step_time_is_microbatches_plus_bubble(pp2):
    """step = (work per microbatch) x (m + p - 1) + exposed gradient sync: the bubble is (p - 1) / m
    of the pipelined work less the exposed sync (at most the whole sync, and the compute it slows), and
    stage-to-stage transfers are priced as p2p."""
    p = pp2.predicted
    m, stages = 8, 2
    assert p["bubble_s"] > 0 and p["comm_s"]["p2p"] > 0
    pipelined = p["step_time_s"] - p["bubble_s"]  # = m x per-microbatch + exposed sync
    assert 0 < p["grad_sync_s"] < pipelined / 10
    assert (pipelined - p["grad_sync_s"]) * (stages - 1) / m - 1e-12 <= p["bubble_s"]
    assert p["bubble_s"] <= pipelined * (stages - 1) / m + 1e-12


def test_a_stage_holds_its_share_of_the_layers(gpt8, pp2):
    """Parameter bytes per device: half of the repeated layers plus its end's parameters outside them (the
    stage whose memory binds: the embeddings on the first, the final norm and the head on the last)."""
    one = _plan(gpt8, {"pp": 1, "tp": 8, "dp": 4, "microbatches": 4})
    numel = {}  # elements of each parameter's local shard
    for fqn, shape in gpt8.param_shapes().items():
        numel[fqn] = math.prod(shape) / math.prod(
            size for size, pl in zip(pp2.mesh["shape"], pp2.placements[fqn]) if pl.startswith("S("))
    in_layers = sum(n for fqn, n in numel.items() if fqn.startswith("blocks."))
    ends = {"first": ("tok_emb.", "pos_emb."), "last": ("ln_f.", "lm_head.")}
    own_end = sum(n for fqn, n in numel.items() if fqn.startswith(ends[pp2.predicted["memory_stage"]]))
    ratio = pp2.predicted["memory_bytes"]["params"] / one.predicted["memory_bytes"]["params"]
    # the same tp=8 placements in both plans: the ratio is the share of parameters a stage holds
    assert pp2.placements == one.placements
    assert ratio == pytest.approx((in_layers / 2 + own_end) / sum(numel.values()), rel=1e-6)


def test_interleaving_shrinks_the_bubble(pp2, interleaved2):
    inter = interleaved2
    assert inter.pipeline["schedule"] == "interleaved" and inter.pipeline["virtual_stages"] == 2
    assert inter.pipeline["stages"] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert inter.predicted["bubble_s"] == pytest.approx(pp2.predicted["bubble_s"] / 2, rel=0.05)
    assert inter.predicted["comm_s"]["p2p"] == pytest.approx(2 * pp2.predicted["comm_s"]["p2p"], rel=0.01)


def test_gpipe_holds_more_activations_than_1f1b(gpt8, pp2):
    gpipe = _plan(gpt8, {"pp": 2, "tp": 8, "microbatches": 8, "schedule": "gpipe", "checkpointing": "none"})
    ofob = _plan(gpt8, {"pp": 2, "tp": 8, "microbatches": 8, "schedule": "1f1b", "checkpointing": "none"})
    act = lambda plan: plan.predicted["memory_bytes"]["activations"]  # noqa: E731
    assert act(gpipe) > 3 * act(ofob)  # m = 8 microbatches in flight vs p = 2


def test_head_and_loss_activations_are_held_for_the_last_chunks_microbatches(gpt8):
    """Under 1F1B the first stage holds p microbatches of its layers' and the embedding's activations,
    the last chunk one of the head's and the loss's: the logits are not charged p times."""
    mesh = MeshChoice(((MeshAxis.DP_SHARD, 2), (MeshAxis.TP, 8)), stages=2)
    pricer = pricer_for(parse_cluster(CLUSTER), mesh, "bf16", Constraints())
    problem = problem_for(gpt8, mesh, pricer, 80e9, Constraints()).with_microbatches(8, pricer)
    staged = stage_problem(problem, gpt8, Staging(2, 8, "1f1b"))
    roles = layer_roles(gpt8, problem)
    outside = [k for k in problem.decisions if k not in roles.in_layer and problem.decisions[k].options[0].cost.batch_memory
               and problem.decisions[k].options[0].cost.memory_bytes > 0]
    held = {k: staged.decisions[k].options[0].cost.memory_bytes / problem.decisions[k].options[0].cost.memory_bytes
            for k in outside}
    after = [k for k in outside if k in roles.after_layers]
    before = [k for k in outside if k not in roles.after_layers]
    assert after and before
    assert all(held[k] == pytest.approx(1.0) for k in after)  # head, loss: one microbatch in flight
    assert all(held[k] == pytest.approx(2.0) for k in before)  # embedding: min(p, m) = 2
    assert {"lm_head|aten.mm.default|1", "|aten._log_softmax.default|1"} <= roles.after_layers
    assert "tok_emb|aten.embedding.default|1" not in roles.after_layers


@pytest.fixture(scope="module")
def by_checkpointing(gpt8):
    # bf16 gradient reductions: with fp32 ones the solver trades compute for the sync differently per
    # mode, and the compute bounds below are about recomputation alone
    return {mode: _plan(gpt8, {"dp": 4, "tp": 8, "microbatches": 2, "checkpointing": mode, "reduce_dtype": "bf16"})
            for mode in ("none", "selective", "full")}


def test_checkpointing_trades_memory_for_recompute(by_checkpointing):
    none, selective, full = (by_checkpointing[k].predicted for k in ("none", "selective", "full"))
    assert full["memory_bytes"]["activations"] < none["memory_bytes"]["activations"] / 2
    assert full["memory_bytes"]["activations"] < selective["memory_bytes"]["activations"]
    assert none["compute_s"] < selective["compute_s"] < full["compute_s"]
    # full recomputation runs the layers' forward again (fwd + 2 fwd -> 4 fwd): a third more compute
    # for the layers, nothing more for the embedding, head and loss (a fifth of this model's work)
    assert none["compute_s"] * 1.2 < full["compute_s"] < none["compute_s"] * 4 / 3
    for mode, plan in by_checkpointing.items():
        assert plan.checkpointing == mode


def test_selective_checkpointing_keeps_linear_outputs_whole(gpt8):
    """Selective keeps every linear-layer output, saved by autograd or not: under data parallelism
    that is less than what the cheap ops it recomputes would save; under tensor parallelism the
    row-parallel outputs are partial sums (full size on every rank), and selective costs more memory
    than no checkpointing, so the search never picks it there."""
    modes = ("none", "selective")
    dp = {m: _plan(gpt8, {"dp": 32, "microbatches": 2, "checkpointing": m}).predicted for m in modes}
    assert dp["selective"]["memory_bytes"]["activations"] < dp["none"]["memory_bytes"]["activations"]
    assert dp["none"]["compute_s"] < dp["selective"]["compute_s"]


def test_free_search_checkpoints_only_when_memory_needs_it(gpt8):
    free = _plan(gpt8, {"dp": 4, "tp": 8})
    assert free.checkpointing == "none"  # 80 GB is plenty: recomputation would only cost time
    tight = _plan(gpt8, {"dp": 4, "tp": 8, "microbatches": 1, "memory_gb": 2.2})  # none needs 2.46 GB at least
    assert tight.checkpointing in (*CHECKPOINTING[1:], "mixed")
    assert tight.predicted["peak_memory_bytes"] <= 2.2e9


def test_fixed_pipeline_through_the_cli(tmp_path):
    from autopar.cli import main

    out = tmp_path / "plan.json"
    code = main(["plan", "tiny-gpt", "--cluster", "2x4xH100", "--global-batch", "16",
                 "--fix", "pp=2,schedule=1F1B,checkpointing=full", "-o", str(out)])
    assert code == 0
    plan = autopar.Plan.load(str(out))
    assert plan.degrees["pp"] == 2 and plan.pipeline["schedule"] == "1f1b" and plan.checkpointing == "full"
    assert plan.predicted["bubble_s"] > 0


@pytest.mark.parametrize("constraints, match", [
    ({"pp": 16}, r"pp=16: the model has only 8 repeated layers"),
    ({"pp": 3}, r"pp=3 does not divide the 32 devices"),
    ({"schedule": "zigzag"}, r"schedule must be one of gpipe, 1f1b, interleaved, zero_bubble, got 'zigzag'"),
])
def test_bad_pipeline_constraints(gpt8, constraints, match):
    with pytest.raises(BadInputError, match=match):
        _plan(gpt8, constraints)


# ---- per-layer checkpointing, chosen by the ILP -------------------------------------------------

@pytest.fixture(scope="module")
def gpt4_uniform():
    """tiny-gpt with 4 layers on 4 CPUs (dp=4, DDP, one microbatch), and its plan in each pinned mode."""
    bundle = build_model("tiny-gpt", global_batch=8, device="meta", overrides={"layers": 4})
    constraints = {"dp": 4, "fsdp": 0, "microbatches": 1}
    plans = {mode: autopar.plan(bundle.model, bundle.example_inputs, "1x4xcpu", bundle.loss_fn,
                                {**constraints, "checkpointing": mode}, example_targets=bundle.example_targets)
             for mode in CHECKPOINTING}
    return bundle, constraints, plans


@pytest.mark.parametrize("share", [0.5, 0.75])
def test_per_layer_checkpointing_recomputes_only_what_memory_needs(gpt4_uniform, share):
    """With memory between what no recomputation needs and what the recomputing mode that keeps the most
    needs (every mode that recomputes fits, none does not), the ILP recomputes some layers, not all: faster
    than every uniform mode that fits, within memory."""
    bundle, constraints, uniform = gpt4_uniform
    need = {mode: p.predicted["peak_memory_bytes"] for mode, p in uniform.items()}
    keeps_most = max(need[mode] for mode in CHECKPOINTING if mode != "none")
    capacity = keeps_most + share * (need["none"] - keeps_most)
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x4xcpu", bundle.loss_fn,
                        {**constraints, "memory_gb": capacity / 1e9}, example_targets=bundle.example_targets)
    assert plan.checkpointing == "mixed"
    assert 0 < len(plan.recomputed_layers) < 4 and set(plan.recomputed_layers) <= {f"blocks.{i}" for i in range(4)}
    assert plan.predicted["peak_memory_bytes"] <= capacity
    fitting = [p.predicted["step_time_s"] for mode, p in uniform.items() if need[mode] <= capacity]
    assert fitting and plan.predicted["step_time_s"] < min(fitting)
    assert plan.predicted["step_time_s"] > uniform["none"].predicted["step_time_s"]  # recomputation costs time
    assert "mixed (" in plan.summary() and plan.candidates[0]["layer_modes"]["none"] == 4 - len(plan.recomputed_layers)
    again = autopar.Plan.from_dict(plan.to_dict())
    assert again.checkpointing_of("blocks.3") == plan.recomputed_layers.get("blocks.3", "none")
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    repriced = reprice(again, captured, "1x4xcpu")  # the what-if path reads the layers' modes back
    assert repriced.recomputed_layers == plan.recomputed_layers
    assert repriced.predicted["step_time_s"] == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)
    assert repriced.predicted["peak_memory_bytes"] == plan.predicted["peak_memory_bytes"]


def test_pinned_checkpointing_keeps_one_mode_for_every_layer(gpt4_uniform):
    _, _, uniform = gpt4_uniform
    for mode, plan in uniform.items():
        assert plan.checkpointing == mode and plan.recomputed_layers == {}


def test_a_weight_tied_across_stages_pays_the_sum_of_its_gradients():
    """The embedding tied to the head sits on the first and the last stage; the runtime sums the two
    copies' gradients after the schedule (``passes/tied_parameters.py``), and the plan prices it."""
    def plan(tie: bool):
        b = build_model("tiny-gpt", global_batch=8, overrides={"tie_embeddings": tie}, device="meta")
        return autopar.plan(b.model, b.example_inputs, "2x1xH100", b.loss_fn, {"pp": 2, "microbatches": 2},
                            example_targets=b.example_targets)
    tied, untied = plan(True), plan(False)
    extra = tied.predicted["comm_s"]["all_reduce"] - untied.predicted["comm_s"]["all_reduce"]
    pair = parse_cluster("2x1xH100").group((2, 1), 0)  # the two stages' ranks, across the nodes
    embedding = 256 * 64 * 4  # tiny-gpt's vocabulary x hidden, its gradient reduced in fp32 (precision.reduce)
    from autopar.cost_models import collective_time
    assert extra == pytest.approx(collective_time("all_reduce", embedding, pair), rel=1e-6)
    assert tied.predicted["step_time_s"] > untied.predicted["step_time_s"]


def test_the_least_stage_transfers_bound_every_plans_sends_and_grow_with_the_chunks(gpt8, pp2):
    """``assemble.least_stage_transfers`` (each boundary tensor at its placement cheapest to send), which
    the search takes off a pipeline ILP's cutoff: at most the sends of the pinned pp=2 plan and of the
    plan with every boundary tensor at its largest placement, and twice as much with two chunks a
    device (each microbatch crosses twice as many stage boundaries)."""
    from autopar.planning.assemble import least_stage_transfers, with_pipeline_time
    from autopar.planning.solver import solve

    cluster = parse_cluster(CLUSTER)
    mesh = MeshChoice(((MeshAxis.DP_SHARD, 2), (MeshAxis.TP, 8)), stages=2)
    constraints = Constraints.from_mapping({"pp": 2, "tp": 8, "microbatches": 8, "schedule": "1f1b"})
    pricer = pricer_for(cluster, mesh, "bf16", constraints)
    whole = problem_for(gpt8, mesh, pricer, 80e9, constraints).with_microbatches(8, pricer)
    one_chunk = Staging(2, 8, "1f1b", 1)
    problem = stage_problem(whole, gpt8, one_chunk)
    least = least_stage_transfers(gpt8, problem, one_chunk, pricer, mesh)
    solved = with_pipeline_time(gpt8, mesh, one_chunk, problem, solve(problem), pricer)
    assert 0.0 < least <= solved.p2p_s * (1 + 1e-9)
    assert least <= pp2.predicted["comm_s"]["p2p"] * (1 + 1e-9)
    heaviest = dict(solved.solution.choice)
    for key in layer_roles(gpt8, problem).boundary:
        d = problem.decisions[key]
        val = gpt8.node(d.nodes[0]).meta["val"]
        heaviest[key] = max(range(len(d.options)), key=lambda k: pricer.local_bytes(val, d.options[k].strategy.outputs[0]))
    most = with_pipeline_time(gpt8, mesh, one_chunk, problem, dataclasses.replace(solved.solution, choice=heaviest), pricer)
    assert least < most.p2p_s
    two_chunks = Staging(2, 8, "interleaved", 2)
    assert least_stage_transfers(gpt8, stage_problem(whole, gpt8, two_chunks), two_chunks, pricer, mesh) == \
        pytest.approx(2 * least)


@pytest.mark.parametrize("schedule, among", [("zero_bubble", (1, 2, 4)), ("interleaved", (2, 4))])
def test_a_schedules_fewest_held_staging_bounds_each_chunk_count(gpt8, schedule, among):
    """``FewestHeld`` (what ``search._ChunkBound`` prunes a schedule's chunk counts by): at every count,
    no more microbatches in flight on any row and no more bubble than any of ``among``; its staged
    problem prices a plan as each chunk count's does and needs no more memory on any row."""
    from autopar.planning.solver import evaluate, solve

    mesh = MeshChoice(((MeshAxis.DP_SHARD, 2), (MeshAxis.TP, 8)), stages=2)
    pricer = pricer_for(parse_cluster(CLUSTER), mesh, "bf16", Constraints())
    whole = problem_for(gpt8, mesh, pricer, 80e9, Constraints())
    fewest = FewestHeld(2, 8, schedule, min(among), ("none",), among)
    each = [Staging(2, 8, schedule, v) for v in among]
    assert {s.layers_per_stage for s in each} == {fewest.layers_per_stage}
    for m in (2, 4, 8):
        for held in ("in_flight", "last_stage_in_flight", "last_chunk_in_flight", "least_bubble_fraction"):
            assert getattr(fewest, held)(m) == min(getattr(s, held)(m) for s in each)
        problem = whole.with_microbatches(m, pricer)
        bound = stage_problem(problem, gpt8, fewest)
        choice = solve(dataclasses.replace(bound, memory_capacity_bytes=math.inf)).choice
        step, rows = evaluate(bound, choice)[0], bound.memory_by_stage(choice)
        for staging in each:
            staged = stage_problem(problem, gpt8, staging)
            assert evaluate(staged, choice)[0] == pytest.approx(step, rel=1e-12)
            assert all(rows[row] <= held * (1 + 1e-12) for row, held in staged.memory_by_stage(choice).items())


def test_stagings_alike_stage_a_problem_alike(gpt8):
    """``staged_alike`` (what the search shares a staged problem by) lists all ``stage_problem`` reads of a
    staging: torch's zero-bubble schedule at 1, 2 and 4 chunks a device holds ``p`` microbatches in flight
    on every row, so the three stage one problem into the same one, ILP for ILP; interleaved 1F1B at 2 and 4
    chunks holds different counts, and its two problems differ."""
    from autopar.planning.solver import build_model

    mesh = MeshChoice(((MeshAxis.DP_SHARD, 2), (MeshAxis.TP, 8)), stages=2)
    pricer = pricer_for(parse_cluster(CLUSTER), mesh, "bf16", Constraints())
    problem = problem_for(gpt8, mesh, pricer, 80e9, Constraints()).with_microbatches(4, pricer)
    for schedule, chunks, alike in (("zero_bubble", (1, 2, 4), True), ("interleaved", (2, 4), False)):
        stagings = [Staging(2, 8, schedule, v, ("none", "full")) for v in chunks]
        keys = {staged_alike(s, problem.microbatches) for s in stagings}
        models = {build_model(stage_problem(problem, gpt8, s), 1.0, 0.1)[0].to_proto().SerializeToString()
                  for s in stagings}
        assert (len(keys), len(models)) == ((1, 1) if alike else (len(chunks), len(chunks)))


@pytest.mark.parametrize("mode", [m for m in CHECKPOINTING if m != "none"])
def test_a_problem_staged_in_one_mode_is_the_general_staging_with_every_layer_in_it(gpt8, mode):
    """``stage_problem`` prices a staging of one checkpointing mode in one pass (``_settled_in_one_mode``):
    the same ILP as staging it with none beside it and then running every layer in the mode
    (``Problem.with_layer_modes``), on one stage and on the first of two."""
    from autopar.planning.solver import build_model

    for stages, mesh in ((1, MeshChoice(((MeshAxis.DP_SHARD, 4), (MeshAxis.TP, 8)))),
                         (2, MeshChoice(((MeshAxis.DP_SHARD, 2), (MeshAxis.TP, 8)), stages=2))):
        pricer = pricer_for(parse_cluster(CLUSTER), mesh, "bf16", Constraints())
        problem = problem_for(gpt8, mesh, pricer, 80e9, Constraints()).with_microbatches(4, pricer)
        one = stage_problem(problem, gpt8, Staging(stages, 8, "1f1b" if stages > 1 else "none", 1, (mode,)))
        both = stage_problem(problem, gpt8, Staging(stages, 8, "1f1b" if stages > 1 else "none", 1, ("none", mode)))
        layers = both.layer_modes.layers
        general = both.with_layer_modes({mode: layers})
        assert build_model(one, 1.0, 0.1)[0].to_proto() == build_model(general, 1.0, 0.1)[0].to_proto()


def test_problems_derived_from_one_mesh_share_their_edge_rows_and_build_the_same_ilp(gpt8):
    """``Problem.edge_rows``: the rows (2) the solver works out for one problem of a mesh serve the problems
    re-priced and staged from it, and the model built with them is the one built from scratch."""
    from autopar.planning.solver import build_model

    mesh = MeshChoice(((MeshAxis.DP_SHARD, 2), (MeshAxis.TP, 8)), stages=2)
    pricer = pricer_for(parse_cluster(CLUSTER), mesh, "bf16", Constraints())
    whole = problem_for(gpt8, mesh, pricer, 80e9, Constraints())
    build_model(stage_problem(whole.with_microbatches(2, pricer), gpt8, Staging(2, 8, "1f1b")), None, 0.0)
    assert len(whole.edge_rows) == len(whole.edges)
    for m, staging in ((4, Staging(2, 8, "interleaved", 2, ("none", "full"))), (8, Staging(2, 8, "zero_bubble"))):
        staged = stage_problem(whole.with_microbatches(m, pricer), gpt8, staging)
        assert staged.edge_rows is whole.edge_rows
        alone = dataclasses.replace(staged, edge_rows=None)
        assert build_model(staged, 1.0, 0.1)[0].to_proto() == build_model(alone, 1.0, 0.1)[0].to_proto()
    held = whole.with_choice({key: 0 for key in whole.decisions})
    assert held.edge_rows is None


def test_layers_of_two_kinds_alternating_are_cut_between_pairs():
    """Layers alike every other one (Jamba's mixture-of-experts layers between dense ones) repeat in
    pairs: stages are cut between pairs (each stage holds as many of each kind, so one pair's price scales to a
    stage's), a stage hands the next one tensor per boundary (the pair's output, not each layer's: the same as a
    stack of one kind of layer with the same boundary), and a pipeline deeper than the pairs is refused."""
    bundle = build_model("edge_models:alternating_blocks", global_batch=8, device="meta")
    alike = build_model("edge_models:reshaped_blocks", global_batch=8, device="meta")

    def plan(b, constraints, cluster="2x1xH100"):
        return autopar.plan(b.model, b.example_inputs, cluster, b.loss_fn, constraints,
                            example_targets=b.example_targets)

    pipeline = {"pp": 2, "microbatches": 2, "schedule": "1f1b"}
    alternating = plan(bundle, pipeline)
    assert alternating.pipeline.stages == [[0, 4], [4, 8]] and alternating.model["layers"] == 8
    assert alternating.predicted["exposed_comm_s"] == plan(alike, pipeline).predicted["exposed_comm_s"]
    assert plan(bundle, {"pp": 4}, "4x1xH100").pipeline.stages == [[0, 2], [2, 4], [4, 6], [6, 8]]
    with pytest.raises(BadInputError, match=r"pp=8: the model has only 4 repeated layers .* groups of consecutive "
                                            r"layers that repeat alike"):
        plan(bundle, {"pp": 8}, "8x1xH100")


def test_a_unit_of_layers_runs_in_one_checkpointing_mode():
    """Mixed checkpointing counts units of ``layer_period`` layers: both layers of a pair get the pair's mode, and
    reading the modes back counts the pairs."""
    from autopar.planning.stages import assign_layer_modes, count_layer_modes

    device = [f"blocks.{i}" for i in range(6)]
    modes = assign_layer_modes([device], {"full": 1, "selective": 1, "none": 1}, period=2)
    assert modes == {"blocks.0": "full", "blocks.1": "full", "blocks.2": "selective", "blocks.3": "selective",
                     "blocks.4": "none", "blocks.5": "none"}
    assert count_layer_modes(device, modes.get, 3, period=2) == {"full": 1, "selective": 1, "none": 1}
    assert assign_layer_modes([device], {"full": 2}) == {"blocks.0": "full", "blocks.1": "full"}


def test_leading_layers_that_do_not_repeat_run_on_the_first_stage():
    """Alike layers after a first one that is not (DeepSeek-V3's dense first layers before its mixture-of-experts
    ones, refused before): stages are cut between the layers that repeat, the first stage holding the leading one
    too, as it holds the embedding: its parameters on that stage's row (the first stage of two holds the embedding,
    the leading layer and two of the four others), its ops priced whole and never recomputed (full checkpointing
    recomputes the repeating layers' linear layers, one more forward, and leaves the leading layer's as they
    are); mixed checkpointing assigns modes to the repeating layers alone, and re-pricing prices the plan alike."""
    bundle = build_model("edge_models:dense_first_blocks", global_batch=8, device="meta")

    def plan(constraints, cluster="1x2xcpu"):
        return autopar.plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn,
                            {"microbatches": 2, "schedule": "1f1b", **constraints},
                            example_targets=bundle.example_targets)

    uniform = {mode: plan({"pp": 2, "checkpointing": mode}) for mode in ("none", "selective", "full")}
    assert uniform["none"].pipeline.stages == [[0, 3], [3, 5]] and uniform["none"].model["layers"] == 5
    assert uniform["full"].pipeline.leading_layers == 1 and "pipeline" in uniform["full"].to_dict()
    assert ("[[0, 3], [3, 5]] (the first also holds the 1 leading layer, which does not repeat and is never "
            "recomputed)") in uniform["full"].summary()
    first_stage = ("emb.", "blocks.0.", "blocks.1.", "blocks.2.")
    held = sum(p.numel() for name, p in bundle.model.named_parameters() if name.startswith(first_stage))
    assert uniform["none"].predicted["memory_stage"] == "first"
    assert uniform["none"].predicted["memory_bytes"]["params"] == 4 * held
    ops = {mode: {op["module"]: op["cost"]["compute_s"] for op in p.to_dict()["ops"].values()
                  if op["op"] in ("aten.mm.default", "aten.addmm.default")} for mode, p in uniform.items()}
    assert ops["full"]["blocks.0.gate"] == ops["none"]["blocks.0.gate"] > 0
    assert ops["full"]["blocks.1.left"] == pytest.approx(4 / 3 * ops["none"]["blocks.1.left"], rel=1e-9)
    assert plan({"pp": 4}, "1x4xcpu").pipeline.stages == [[0, 2], [2, 3], [3, 4], [4, 5]]
    with pytest.raises(BadInputError, match=r"pp=8: the model has only 4 repeated layers"):
        plan({"pp": 8}, "1x8xcpu")
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    assert captured.leading_layers == ("blocks.0",)
    assert device_layers(captured, [[0, 3], [3, 5]], 2) == [["blocks.1", "blocks.2"], ["blocks.3", "blocks.4"]]
    repriced = reprice(autopar.Plan.from_dict(uniform["full"].to_dict()), captured, "1x2xcpu")
    assert repriced.predicted["step_time_s"] == pytest.approx(uniform["full"].predicted["step_time_s"], rel=1e-9)


def test_stages_pass_on_what_later_layers_read_from_before_them():
    """Every stage hands the next what later stages read: a decoder layer's output, and the encoder's output (made
    on the first stage, read by every decoder layer, as cross-attention reads it), so a pipeline of an
    encoder-decoder sends twice the bytes of a stack of the same width handing one tensor; a post-norm layer (BERT's,
    ending in ``native_layer_norm``) hands its normalized values, as many bytes as a pre-norm one (GPT-2's: it was
    priced as handing nothing)."""
    def plan(spec, **sizes):
        b = build_model(spec, device="meta", **sizes)
        return autopar.plan(b.model, b.example_inputs, "1x2xcpu", b.loss_fn,
                            {"pp": 2, "microbatches": 2, "schedule": "1f1b"}, example_targets=b.example_targets)

    def p2p(spec, **sizes):
        return plan(spec, **sizes).predicted["comm_s"]["p2p"]

    encoder_decoder = plan("edge_models:encoder_decoder_blocks", global_batch=8)
    assert encoder_decoder.pipeline.stages == [[0, 3], [3, 4]]
    assert encoder_decoder.predicted["comm_s"]["p2p"] == pytest.approx(2 * p2p("edge_models:reshaped_blocks",
                                                                               global_batch=8), rel=1e-12)
    pytest.importorskip("transformers")
    post_norm = p2p("autopar.models.hf:bert", global_batch=4)
    assert post_norm > 0 and post_norm == pytest.approx(p2p("autopar.models.hf:gpt2", global_batch=4), rel=1e-12)
