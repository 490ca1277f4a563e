"""One memory row per end stage of a pipeline (planning/stages.py ``StageRows``, solver.py constraint (4)):
the first stage's device holds its layers and the embedding, the last's its layers (for fewer microbatches)
and the final norm, head and loss; a plan's peak is the larger of the two. Issue 20: pricing both ends on
one device over-counted every pipelined plan with a large vocabulary by the embedding's (or head's) share.

The plans are of ``tiny-llama`` with a vocabulary of 16,384 (its embedding and its head 1M parameters each,
beside 41K a layer), two layers on two stages of one device each (no sharding to choose), so that every
row is a sum of the plan's own op memory numbers and a count of parameters."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
import autopar.cli
from autopar import NoFeasiblePlanError
from autopar.core.units import fmt_bytes
from autopar.cost_models import parse_cluster, usable_bytes
from autopar.cost_models.pipeline import last_stage_in_flight, microbatches_in_flight, simulate, torch_schedule_order
from autopar.ir.capture import capture
from autopar.models import build_model
from autopar.planning.meshes import MeshChoice
from autopar.core.axes import MeshAxis
from autopar.core.constraints import Constraints
from autopar.planning.roles import pricer_for, problem_for
from autopar.planning.pricing import Cost
from autopar.planning.problem import StageRows
from autopar.planning.solver import evaluate, least_memory, solve
from autopar.planning.stages import Staging, layer_roles, stage_problem

VOCAB = 16384
PINNED = {"pp": 2, "microbatches": 4, "schedule": "1f1b", "checkpointing": "none"}
BYTES_PER_PARAM = 2 + 4 + 12  # bf16 parameter, fp32 gradient on the master, fp32 master and AdamW moments
SEQ, TOKEN_BYTES = 32, 8  # tiny-llama's sequence; int64 tokens and labels


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", global_batch=8, overrides={"vocab": VOCAB}, device="meta")


def _plan(bundle, cluster: str = "2x1xH100"):
    return autopar.plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn, PINNED,
                        example_targets=bundle.example_targets)


@pytest.fixture(scope="module")
def pp2(llama):
    return _plan(llama)


def _rows_by_hand(bundle, plan) -> dict[str, float]:
    """Each end stage's bytes from the plan's op memory numbers (per occurrence, held for the first stage's
    ``min(p, m) = 2`` microbatches in flight) and parameter counts: one layer per stage, the last holding
    its layer's activations for one microbatch (1F1B) of the first's two; the tokens held on the first,
    the labels on the last (for two microbatches: only ops after the layers count the last chunk's one);
    the rotary tables (bf16, the compute dtype) on both."""
    params = dict(bundle.model.named_parameters())
    numel = lambda prefix: sum(t.numel() for n, t in params.items() if n.startswith(prefix))  # noqa: E731
    held = lambda *modules: sum(op["cost"]["memory_bytes"] for op in plan.ops.values()  # noqa: E731
                                if op["module"] in modules or op["module"].startswith(tuple(m + "." for m in modules)))
    layer = held("blocks.0")
    assert layer == held("blocks.1") > 0
    inputs = plan.pipeline["microbatch_size"] * SEQ * TOKEN_BYTES * 2
    tables = sum(t.numel() * 2 for t in bundle.model.buffers())
    first = BYTES_PER_PARAM * (numel("blocks.0.") + numel("tok_emb.")) + layer + held("tok_emb") + inputs + tables
    last = (BYTES_PER_PARAM * (numel("blocks.1.") + numel("norm_f.") + numel("lm_head.")) + layer / 2
            + held("norm_f", "lm_head", "") + inputs + tables)
    return {"first": first, "last": last,
            "both ends on one device": first + last - layer / 2 - tables
            - BYTES_PER_PARAM * numel("blocks.1.")}


def test_the_peak_is_the_larger_end_stage_counted_by_hand(llama, pp2):
    rows = _rows_by_hand(llama, pp2)
    predicted = pp2.predicted
    assert predicted["stage_peak_memory_bytes"]["first"] == pytest.approx(rows["first"], abs=1)
    assert predicted["stage_peak_memory_bytes"]["last"] == pytest.approx(rows["last"], abs=1)
    assert predicted["peak_memory_bytes"] == pytest.approx(max(rows["first"], rows["last"]), abs=1)
    # the head and its logits outweigh the embedding: the last stage binds, and its parts are the breakdown
    assert predicted["memory_stage"] == "last"
    assert sum(predicted["memory_bytes"].values()) == pytest.approx(predicted["peak_memory_bytes"], abs=4)
    embedding = BYTES_PER_PARAM * VOCAB * 64
    assert predicted["memory_bytes"]["params"] == pytest.approx(
        2 * sum(t.numel() for n, t in llama.model.named_parameters() if not n.startswith(("tok_emb", "blocks.0"))))
    # the old count held both ends on one device: at least the embedding's parameters more
    assert rows["both ends on one device"] - predicted["peak_memory_bytes"] > embedding


def test_a_pipeline_that_fits_only_stage_by_stage_is_planned(llama, pp2):
    """A capacity between the larger end stage and both ends together: planned now, refused before."""
    rows = _rows_by_hand(llama, pp2)
    target = (pp2.predicted["peak_memory_bytes"] + rows["both ends on one device"]) / 2
    device = parse_cluster("2x1xH100").device
    gb = target / usable_bytes(device) * device.hbm_bytes / 1e9
    plan = _plan(llama, f"2x1xH100,mem={gb:.6f}GB")
    assert plan.predicted["peak_memory_bytes"] == pp2.predicted["peak_memory_bytes"]
    assert plan.predicted["peak_memory_bytes"] <= plan.predicted["memory_capacity_bytes"] < rows["both ends on one device"]
    with pytest.raises(NoFeasiblePlanError):  # below the larger stage: no plan
        _plan(llama, f"2x1xH100,mem={gb * 0.6:.6f}GB")


def test_one_stage_keeps_one_memory_row(llama):
    plan = autopar.plan(llama.model, llama.example_inputs, "1x1xH100", llama.loss_fn, {"microbatches": 4},
                        example_targets=llama.example_targets)
    assert "memory_stage" not in plan.predicted and "stage_peak_memory_bytes" not in plan.predicted
    assert plan.predicted["memory_bytes"]["params"] == pytest.approx(
        2 * sum(t.numel() for t in llama.model.parameters()))


def _staged(bundle, staging: Staging):
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    mesh = MeshChoice(((MeshAxis.DP_SHARD, 1),), stages=staging.stages)
    constraints = Constraints.from_mapping({"pp": staging.stages})
    pricer = pricer_for(parse_cluster(f"{staging.stages}x1xH100"), mesh, "bf16", constraints)
    problem = problem_for(captured, mesh, pricer, 80e9, constraints).with_microbatches(4, pricer)
    return captured, problem, stage_problem(problem, captured, staging)


def test_the_solvers_rows_and_its_evaluation_agree(llama):
    """The ILP's two rows, ``evaluate`` (the larger) and ``least_memory`` (a bound of it) read the same
    prices; with a capacity just under the plan's peak the solver finds nothing."""
    _, _, staged = _staged(llama, Staging(2, 2, "1f1b"))
    solution = solve(staged)
    rows = staged.memory_by_stage(solution.choice)
    assert set(rows) == {"first", "last"}
    assert evaluate(staged, solution.choice)[1] == max(rows.values())
    assert least_memory(staged) <= max(rows.values())
    with pytest.raises(NoFeasiblePlanError):
        solve(dataclasses.replace(staged, memory_capacity_bytes=max(rows.values()) * 0.999))


@pytest.mark.parametrize("tie", [False, True])
def test_a_weight_both_ends_read_counts_on_both(tie):
    """An untied embedding is the first stage's and the head the last's; tied, the one weight is on both
    (``passes/tied_parameters.py`` gives each end stage a copy)."""
    bundle = build_model("tiny-gpt", global_batch=8, overrides={"tie_embeddings": tie}, device="meta")
    captured, problem, staged = _staged(bundle, Staging(2, 2, "1f1b"))
    roles = layer_roles(captured, problem)
    if tie:
        assert "param:lm_head.weight" not in problem.decisions  # one weight, read by the embedding and the head
        assert "param:tok_emb.weight" not in roles.first_stage_only | roles.last_stage_only
    else:
        assert "param:tok_emb.weight" in roles.first_stage_only and "param:lm_head.weight" in roles.last_stage_only
    assert "tok_emb|aten.embedding.default|1" in staged.stage_rows.first_only
    assert {"lm_head|aten.mm.default|1", "|aten._log_softmax.default|1"} <= staged.stage_rows.last_only


@pytest.mark.parametrize("stages,microbatches,chunks", [(2, 4, 2), (4, 8, 2), (4, 4, 2), (4, 6, 2), (4, 12, 3),
                                                         (8, 16, 12), (8, 8, 12)])
def test_the_last_stage_holds_what_torchs_interleaved_table_holds_there(stages, microbatches, chunks):
    """The last device's layers are held for its warmup forwards plus one, ``(v - 1) r + 1`` chunk-microbatches
    (Megatron-LM's count for rank ``p - 1`` where ``r = p``), fewer than the first's ``2 (p - 1)`` more."""
    table = torch_schedule_order("ScheduleInterleaved1F1B", stages, microbatches, chunks)
    held = simulate(table, chunks).last_stage_in_flight
    assert last_stage_in_flight("interleaved", stages, microbatches, chunks) == pytest.approx(held)
    if microbatches % stages == 0:
        assert held * chunks == (chunks - 1) * stages + 1
    assert held < microbatches_in_flight("interleaved", stages, microbatches, chunks)


def test_last_stage_in_flight_per_schedule():
    assert last_stage_in_flight("1f1b", 4, 8) == 1  # stage s holds min(p - s, m)
    assert last_stage_in_flight("gpipe", 4, 8) == 8
    assert last_stage_in_flight("zero_bubble", 4, 8) == simulate(
        torch_schedule_order("ScheduleInterleavedZeroBubble", 4, 8, 1), 1).last_stage_in_flight
    assert Staging(4, 8, "1f1b").last_stage_in_flight(8) == 1 and Staging(1, 8).last_stage_in_flight(8) == 1


def test_the_last_stage_holds_a_layers_activations_for_its_share_and_a_recomputed_layer_once():
    """A layer op's held activations scale by the last stage's share of the first's microbatches in flight;
    the working set of a recomputed layer (live once, ``Option.working_set_bytes``) does not; each end's
    ops are nothing to the other end; parameters are the same on both."""
    rows = StageRows(frozenset({"embedding"}), frozenset({"head"}), frozenset({"layer", "param:layer"}), 0.25)
    activations = Cost(memory_bytes=100.0, batch_memory=True)
    assert rows.held_bytes("first", "layer", activations, 20.0) == 100.0
    assert rows.held_bytes("last", "layer", activations, 20.0) == 0.25 * 80.0 + 20.0
    assert rows.held_bytes("last", "param:layer", Cost(memory_bytes=100.0), 0.0) == 100.0
    assert rows.held_bytes("last", "embedding", activations, 0.0) == rows.held_bytes("first", "head", activations, 0.0) == 0
    assert rows.held_bytes("first", "embedding", activations, 0.0) == rows.held_bytes("last", "head", activations, 0.0) == 100


def test_the_largest_working_set_is_held_once_not_per_microbatch_in_flight():
    """The largest op's working set (``Cost.transient_bytes``: the loss's logits, their log-softmax and its
    gradient) is live only while that op runs on one microbatch; its saved activations are held for every
    microbatch in flight. GPipe's last chunk holds all ``m``: counting the working set ``m`` times put
    tiny-llama's pp=2 GPipe stage 262 KB (21% of its activations) above what it is now."""
    from autopar.planning.stages import _held

    loss = Cost(memory_bytes=100.0, transient_bytes=30.0, batch_memory=True)
    assert _held(loss, 3).memory_bytes == 70.0 * 3 + 30.0
    assert _held(Cost(memory_bytes=100.0), 3).memory_bytes == 100.0  # not activations: held as priced
    rows = StageRows(frozenset(), frozenset(), frozenset({"layer"}), 0.25)
    assert rows.held_bytes("last", "layer", loss, 20.0) == 0.25 * (100.0 - 50.0) + 50.0


def test_show_states_each_end_stages_memory_and_which_binds(llama, pp2, tmp_path, capsys):
    """``autopar show`` of a pipeline plan gives both end stages' memory, the binding one first."""
    path = tmp_path / "pp2.json"
    path.write_text(pp2.to_json())
    assert autopar.cli.main(["show", str(path)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("by stage:"))
    stages = pp2.predicted["stage_peak_memory_bytes"]
    assert line.strip().startswith(f"by stage: last {fmt_bytes(stages['last'])} (binds), first {fmt_bytes(stages['first'])}")
