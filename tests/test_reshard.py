"""Reshard after forward (``passes/reshard.py``): FSDP's gathered parameters are not held for backward,
they are gathered again there, and pricing charges exactly those gathers and the reduce_scatters that
bring the gathered parameters' gradients back to their shards."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.cost_models import parse_cluster
from autopar.testing.launch import run_on_ranks
from autopar.planning.pricing import Pricer


def test_a_regathered_parameter_edge_runs_its_gather_again_in_backward_and_not_again_under_recompute():
    pricer = Pricer(parse_cluster("1x8xH100"), (8,), "bf16")
    weight = torch.empty(4096, 4096, device="meta", dtype=torch.bfloat16)
    sharded, whole = (Shard(0),), (Replicate(),)
    held = pricer.edge(weight, sharded, whole, per_microbatch=True)
    regathered = pricer.edge(weight, sharded, whole, per_microbatch=True, regathered=True)
    assert regathered.comm_s["all_gather"] == pytest.approx(2 * held.comm_s["all_gather"])
    assert held.forward_comm_s and not regathered.forward_comm_s  # a recompute adds no third gather
    kinds = [(c.kind, c.phase, c.regather) for c in pricer.edge_collectives(weight, sharded, whole, (), True)]
    assert kinds == [("all_gather", "forward", False), ("all_gather", "backward", True)]


def _fsdp_step(rank: int, world: int) -> dict:
    import gc

    import autopar
    from autopar.inspect.collectives import predicted_collectives
    from autopar.testing.counters import CollectiveCounter
    from autopar.models import build_model
    from autopar.testing.parity import batches

    bundle = build_model("tiny-gpt", overrides={"layers": 4}, global_batch=8, device="cpu")
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets,
                                 constraints={"dp": world, "fsdp": 3, "runtime": "dtensor"},
                                 lowered=False)  # reads the DTensor program's regather hooks
    (batch,) = batches(bundle, 1, seed=0)
    with CollectiveCounter() as forward:
        loss = pm(*batch)
    gc.collect()
    held_after_forward = pm.program.last.held()
    with CollectiveCounter() as backward:
        loss.to_local().backward()
    plan = pm.plan.to_dict()
    regathers = sum(1 for op in plan["ops"].values() for t in op.get("collectives", [])
                    if t["phase"] == "backward" and "again in backward" in t["why"])
    return {"held_after_forward": held_after_forward, "regathered": pm.program.last.regathered,
            "forward": forward.counts, "backward": backward.counts, "predicted_regathers": regathers,
            "predicted_forward": predicted_collectives(plan, ["forward"]),
            "predicted_backward": predicted_collectives(plan, ["backward"]),
            "gathered_weights": sum(1 for pl in plan["placements"].values() if any(p.startswith("S(") for p in pl))}


@pytest.mark.slow
@pytest.mark.dist
def test_fsdp_holds_no_gathered_parameter_after_forward_and_gathers_what_the_plan_prices():
    result = run_on_ranks(_fsdp_step, 2)[0]
    assert result["gathered_weights"] > 0, "the plan shards parameters (FSDP)"
    assert result["forward"] == result["predicted_forward"]
    assert result["held_after_forward"] == 0
    assert result["regathered"] == result["predicted_regathers"] > 0
    assert result["backward"].get("all_gather", 0) == result["predicted_regathers"]
    # each gathered parameter's gradient is reduce-scattered by its gather's backward, also where the
    # runtime restores a permuted shard's memory order after the gather (``layout.in_memory_order``)
    assert result["backward"].get("reduce_scatter", 0) > 0
    assert result["backward"] == result["predicted_backward"]
