"""The data-parallel family without processes: DDP, ZeRO-1/2 (sharded optimizer state and gradients),
FSDP (ZeRO-3) and HSDP (shard inside a node, replicate across nodes), priced by the planner."""

from __future__ import annotations

import pytest

from autopar import BadInputError
from autopar.ir.capture import capture
from autopar.cost_models import parse_cluster
from autopar.models import build_model
from autopar.core.constraints import Constraints
from autopar.planning.search import make_plan

CLUSTER = "4x8xH100"


@pytest.fixture(scope="module")
def gpt():
    b = build_model("tiny-gpt", global_batch=64)
    return capture(b.model, b.example_inputs, b.example_targets, b.loss_fn)


def _plan(captured, constraints, cluster=CLUSTER):
    return make_plan(captured, parse_cluster(cluster), model_name="tiny-gpt",
                     constraints=Constraints.from_mapping(constraints))


@pytest.fixture(scope="module")
def by_stage(gpt):
    return {stage: _plan(gpt, {"dp": 32, "fsdp": stage}) for stage in (0, 1, 2, 3)}


def test_zero_stages_shard_optimizer_then_gradients_then_parameters(by_stage):
    mem = {stage: plan.predicted["memory_bytes"] for stage, plan in by_stage.items()}
    ddp = mem[0]
    assert mem[1]["optimizer"] == pytest.approx(ddp["optimizer"] / 32, rel=1e-3)  # ZeRO-1
    # bf16 plan: ZeRO-1 accumulates the whole gradient in bf16, DDP on the fp32 master weights
    assert mem[1]["grads"] == ddp["grads"] / 2 and mem[1]["params"] == ddp["params"]
    assert mem[2]["grads"] == pytest.approx(ddp["grads"] / 32, rel=1e-3)  # ZeRO-2
    assert mem[2]["optimizer"] == mem[1]["optimizer"]
    assert mem[3]["params"] < ddp["params"] / 4  # ZeRO-3 (FSDP): the weight matrices are sharded too
    for stage, plan in by_stage.items():
        assert plan.degrees.get("zero", 0) == stage  # absent for DDP: every degree is >= 1
    # fsdp=3 may shard over all 32 ranks or, as HSDP, inside each node of 8 (whichever is faster)
    assert by_stage[3].degrees["fsdp"] in (8, 32) and by_stage[1].degrees["fsdp"] == 1


def test_zero_1_and_2_move_what_ddp_moves(by_stage):
    """reduce_scatter + all_gather move the bytes of one all_reduce (per parameter, so each pays its
    latency, where DDP's buckets pay it once per 25 MB): about DDP's step, less memory."""
    ddp = by_stage[0].predicted
    for stage in (1, 2):
        assert by_stage[stage].predicted["step_time_s"] >= ddp["step_time_s"]
        assert by_stage[stage].placements == by_stage[0].placements
        assert by_stage[stage].predicted["peak_memory_bytes"] < ddp["peak_memory_bytes"]


@pytest.mark.parametrize("runtime, pipeline", [("lowered", {}), ("dtensor", {}),
                                               (None, {"pp": 2, "microbatches": 2})])
def test_fsdp_plans_hold_their_largest_gathered_unit(runtime, pipeline):
    """An FSDP plan's memory holds, beside the shards, the largest unit of its sharded parameters gathered
    whole, twice (the unit running and the next gathered ahead; bf16 on H100: 4 bytes an element). The
    lowered runtime gathers a layer (outside layers a module) at a time, DTensor each parameter alone; a
    pipeline, priced for DTensor but run lowered by default, is held to layers. A DDP plan gathers
    nothing. Worked out here from the plan's own placements (no tensor parallelism: every split is over
    data parallelism), through the public API."""
    from collections import defaultdict

    import autopar
    from autopar.ir.layers import gather_unit

    bundle = build_model("tiny-gpt", global_batch=64)
    numel = {name: p.numel() for name, p in bundle.model.named_parameters()}

    def planned(constraints):
        pinned = {**constraints, **pipeline, **({"runtime": runtime} if runtime else {})}
        return autopar.plan(bundle.model, bundle.example_inputs, cluster=CLUSTER, loss_fn=bundle.loss_fn,
                            example_targets=bundle.example_targets, constraints=pinned)

    fsdp = planned({"dp": 16 if pipeline else 32, "fsdp": 3})
    units: dict[str, int] = defaultdict(int)
    for name, placements in fsdp.to_dict()["placements"].items():
        if name in numel and any(p.startswith("S") for p in placements):  # FSDP, or HSDP's shard dim
            units[name if runtime == "dtensor" else gather_unit(name)] += 4 * numel[name]
    assert "blocks.0.mlp.fc_in.weight" in units if runtime == "dtensor" else "blocks.0" in units
    memory = fsdp.predicted["memory_bytes"]
    assert memory["gathered"] == max(units.values())
    assert fsdp.predicted["peak_memory_bytes"] == pytest.approx(sum(memory.values()), abs=8)
    assert "gathered" not in planned({"dp": 16 if pipeline else 32, "fsdp": 0}).predicted["memory_bytes"]


def test_pinned_hsdp_shards_inside_a_node_and_replicates_across(gpt):
    plan = _plan(gpt, {"dp": 32, "dp_shard": 8})
    assert plan.mesh == {"shape": [4, 8], "dim_names": ["dp_replicate", "dp"]}
    assert plan.degrees["dp"] == 32 and plan.degrees["fsdp"] == 8 and plan.degrees["dp_replicate"] == 4
    assert all(p[0] == "R" for p in plan.placements.values())
    matrices = [fqn for fqn in plan.placements if fqn.endswith("proj.weight") or "fc_" in fqn and "weight" in fqn]
    assert matrices and all(plan.placements[fqn][1].startswith("S(") for fqn in matrices)
    for name in plan.inputs:  # the batch is split over both data-parallel dims
        assert plan.inputs[name]["placements"] == ["S(0)", "S(0)"]


def test_free_search_tries_hsdp_when_data_parallelism_leaves_the_node(gpt):
    plan = _plan(gpt, {"tp": 1, "pp": 1})
    meshes = [c["mesh"]["dim_names"] for c in plan.candidates]
    pruned = [list(d) for d in plan.solver["pruned_meshes"]]
    assert ["dp_replicate", "dp"] in meshes + pruned


@pytest.mark.parametrize("constraints, match", [
    ({"dp": 32, "dp_shard": 8, "fsdp": 0}, r"dp_shard=8 \(HSDP\) shards parameters: it needs fsdp=3"),
    ({"fsdp": 4}, r"fsdp must be a ZeRO stage.*got 4"),
])
def test_bad_data_parallel_constraints(gpt, constraints, match):
    with pytest.raises(BadInputError, match=match):
        _plan(gpt, constraints)
