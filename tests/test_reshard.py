"""Reshard after forward (``passes/reshard.py``): FSDP's gathered parameters are not held for backward,
they are gathered again there, and pricing charges exactly those gathers and the reduce_scatters that
bring the gathered parameters' gradients back to their shards."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.cost_models import parse_cluster
from autopar.testing.launch import run_on_ranks
from autopar.planning.pricing import Pricer, redistribute_steps
from autopar.passes.reshard import geometry_of, view_again


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


def _dtensor_plan(src: tuple, dst: tuple, mesh_shape: tuple[int, ...]) -> list[tuple]:
    """DTensor's own moves for ``src -> dst`` (its greedy planner, on a mesh with no process group)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    world = 1
    for size in mesh_shape:
        world *= size
    mesh = DeviceMesh("cpu", torch.arange(world).view(*mesh_shape), _init_backend=False, _rank=0)
    meta = TensorMeta(torch.Size([16, 16]), (16, 1), torch.float32)
    infos = _gen_transform_infos_non_cached(DTensorSpec(mesh, src, tensor_meta=meta),
                                            DTensorSpec(mesh, dst, tensor_meta=meta), False)
    return [(i.mesh_dim, *i.src_dst_placements) for i in infos]


def test_redistribute_steps_are_dtensors_own_moves_on_a_two_dim_mesh():
    pytest.importorskip("torch.distributed.tensor._redistribute")
    options = (Replicate(), Shard(0), Shard(1), Partial())
    compared = 0
    for src, dst in itertools.product(itertools.product(options, repeat=2), itertools.product(options[:3], repeat=2)):
        ours = [(dim, a, b) for dim, a, b, _ in redistribute_steps(src, dst, (2, 4))]
        assert ours == _dtensor_plan(src, dst, (2, 4)), (src, dst)
        compared += 1
    assert compared == 144


def test_fsdp_outside_tp_on_one_tensor_dim_is_priced_as_dtensor_gathers_it():
    """(S(1), S(1)) read as (R, S(1)) (FSDP's shard outside row-parallel TP's): DTensor gathers the tp shard,
    then the whole tensor over dp, and slices: tp's all_gather of 1/dp and dp's of all of it, where
    (S(0), S(1)) is gathered on dp alone, 1/tp of it. The gradient, partial over dp, goes back the same
    way: gathered on tp, the whole of it reduce-scattered over dp."""
    pricer = Pricer(parse_cluster("1x8xH100"), (2, 4), "bf16")
    weight = torch.empty(4096, 4096, device="meta", dtype=torch.bfloat16)
    whole = 4096 * 4096 * 2
    read = (Replicate(), Shard(1))
    nested = [(c.kind, c.phase, c.mesh_dim, c.nbytes) for c in
              pricer.edge_collectives(weight, (Shard(1), Shard(1)), read, grad_partial=(0,))]
    assert sorted(nested) == sorted([("reduce_scatter", "backward", 0, whole), ("all_gather", "forward", 1, whole / 2),
                                     ("all_gather", "forward", 0, whole), ("all_gather", "backward", 1, whole)])
    apart = [(c.kind, c.phase, c.mesh_dim, c.nbytes) for c in
             pricer.edge_collectives(weight, (Shard(0), Shard(1)), read, grad_partial=(0,))]
    assert sorted(apart) == sorted([("reduce_scatter", "backward", 0, whole / 4),
                                    ("all_gather", "forward", 0, whole / 4)])
    assert (pricer.edge(weight, (Shard(1), Shard(1)), read, grad_partial=(0,)).comm_s["all_gather"]
            > 4 * pricer.edge(weight, (Shard(0), Shard(1)), read, grad_partial=(0,)).comm_s["all_gather"])


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


def test_a_saved_view_is_made_again_against_the_layout_of_what_it_viewed() -> None:
    """A gather run again in backward may return its tensor in another memory layout than forward's (DTensor's
    outside autograd returned a [4, 2] weight column-major): the saved view's geometry is read against the
    layout forward's had, not the new one, which would hand backward a scrambled weight."""
    gathered = torch.arange(8.0).reshape(4, 2)  # as forward's gather returned it, row-major
    saved = gathered[1:]  # what an op kept: a view of it
    again = gathered.t().contiguous().t()  # the same values, gathered again column-major
    assert not torch.equal(again.as_strided(*geometry_of(saved)), saved)
    assert torch.equal(view_again(again, geometry_of(saved), laid_out=geometry_of(gathered)), saved)
