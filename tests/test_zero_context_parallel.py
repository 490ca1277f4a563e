"""ZeRO-1/2 with context parallelism (issue 20): the optimizer's state sharded over dp x cp, as
Megatron-Core's distributed optimizer shards it over its data-parallel group with cp (``core.axes.ZERO_AXES``,
``passes/zero.py``).

* Planning: the predicted optimizer state per device is divided by dp x cp, not by dp alone; a plan with
  cp and no dp dim records the ZeRO stage it prices; the gradient's reduce_scatter and the parameter's
  all_gather are priced on each of the two dims, the inner one on the outer one's share
  (``Pricer.zero_share``).
* On 4 gloo ranks (SGD, 3 steps, tiny-llama at 256 tokens, keys and values gathered): ZeRO-1 at
  dp=2 x cp=2, ZeRO-2 with 2 microbatches at dp=2 x cp=2, ZeRO-1 at cp=4 without dp, and ZeRO-1 over cp=2
  inside pipeline stages (pp=2) match single-process training (gradients after the first backward,
  losses, final parameters); every parameter the optimizer is handed is ``Shard`` on every mesh dim,
  1 / (dp x cp) of the whole; and a one-stage step runs exactly the collectives the plan predicts.
* The AdamW state of a dp=2 x cp=2 ZeRO-1 run, saved with ``autopar.save_checkpoint``, loads whole under
  a plan without cp or ZeRO (dp=4).
"""

from __future__ import annotations

from typing import Any

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar.cost_models import parse_cluster
from autopar.inspect.collectives import predicted_collectives
from autopar.models import build_model
from autopar.planning.pricing import Pricer
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import AutoparResult, batches, build, gathered, train_counting, train_single

BATCH = 8
STEPS = 3
WORLD = 4
LONG = {"seq": 256}
"""tiny-llama at a few hundred tokens, so that cp=4 splits the sequence into chunks (as in
``tests/test_context_parallel.py``)."""
ALLGATHER = {"cp_attention": "allgather"}


def _plan(constraints: dict) -> dict:
    bundle = build_model("tiny-llama", overrides=LONG, global_batch=BATCH)
    return autopar.plan(bundle.model, bundle.example_inputs, "1x4xcpu", bundle.loss_fn, {**constraints, **ALLGATHER},
                        example_targets=bundle.example_targets).to_dict()


def _optimizer_bytes(plan: dict) -> float:
    return plan["predicted"]["memory_bytes"]["optimizer"]


def test_optimizer_state_is_divided_by_dp_times_cp() -> None:
    """tiny-llama's every weight has a dim of 4 or more, so ZeRO-1 over dp=2 x cp=2 keeps exactly a
    quarter of the state DDP keeps, and over cp=4 alone a quarter too; in fp32 that state is the two
    moments (8 bytes a parameter) and, under ZeRO, the fp32 shard the optimizer steps (4 more)."""
    ddp = _optimizer_bytes(_plan({"dp": 2, "cp": 2, "fsdp": 0}))
    zero1 = _plan({"dp": 2, "cp": 2, "fsdp": 1})
    assert zero1["degrees"]["zero"] == 1 and zero1["mesh"]["dim_names"] == ["dp", "cp"]
    assert _optimizer_bytes(zero1) == pytest.approx(ddp * 12 / 8 / 4)
    cp_only = _plan({"cp": 4, "fsdp": 1})
    assert cp_only["degrees"]["zero"] == 1 and cp_only["mesh"]["dim_names"] == ["cp"]
    assert _optimizer_bytes(cp_only) == pytest.approx(ddp * 12 / 8 / 4)


def test_pricer_divides_state_by_every_zero_dim() -> None:
    """A 4,096 x 4,096 weight replicated on a dp=4 x cp=2 mesh: AdamW's two fp32 moments and the fp32
    shard they update (a tensor of its own under ZeRO) split 8 ways."""
    val = torch.empty(4096, 4096, device="meta")
    placements = (torch.distributed.tensor.Replicate(),) * 2
    pricer = Pricer(parse_cluster("1x8xH100"), (4, 2), "fp32", zero_stage=1, zero_dims=(0, 1))
    ddp = Pricer(parse_cluster("1x8xH100"), (4, 2), "fp32", zero_stage=0, zero_dims=(0, 1))
    assert pricer.optimizer_shards(val, placements) == 8
    assert pricer.parameter_memory(val, placements)["optimizer"] == ddp.parameter_memory(val, placements)["optimizer"] \
        * 12 / 8 / 8
    assert (pricer.zero_share(0, (0, 1)), pricer.zero_share(1, (0, 1))) == (1.0, 0.25)


def test_zero_collectives_on_cp_move_the_dp_share() -> None:
    """Each parameter's gradient is reduce-scattered and the parameter all-gathered on dp and on cp (one
    pair on each), where before cp's gradient was all-reduced; the pair on cp moves half of dp's bytes."""
    plan = _plan({"dp": 2, "cp": 2, "fsdp": 1})
    synced = predicted_collectives(plan, ["grad_sync"])
    params = len(plan["placements"])
    assert synced == {"reduce_scatter": 2 * params, "all_gather": 2 * params}
    dp, cp = plan["mesh"]["dim_names"].index("dp"), plan["mesh"]["dim_names"].index("cp")
    pairs = 0
    for op in plan["ops"].values():
        zero = [c for c in op.get("collectives", []) if c["grad_sync"] and c["kind"] != "all_reduce"]
        for kind in ("reduce_scatter", "all_gather"):
            nbytes = {c["mesh_dim"]: c["nbytes"] for c in zero if c["kind"] == kind}
            if nbytes:
                assert nbytes[cp] == pytest.approx(nbytes[dp] / 2), (kind, nbytes)
                pairs += 1
    assert pairs == 2 * params
    ddp = predicted_collectives(_plan({"dp": 2, "cp": 2, "fsdp": 0}), ["grad_sync"])
    assert set(ddp) == {"all_reduce"}


RUNS = [{"dp": 2, "cp": 2, "fsdp": 1}, {"dp": 2, "cp": 2, "fsdp": 2, "microbatches": 2}, {"cp": 4, "fsdp": 1},
        {"cp": 2, "pp": 2, "fsdp": 1, "microbatches": 2}]
ONE_STAGE = [i for i, run in enumerate(RUNS) if "pp" not in run]
"""The runs whose collectives are counted (a pipeline's stage transfers are not ``predicted_collectives``')."""


def _train_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    return {"runs": [_train(constraints) for constraints in RUNS], "checkpoint": _checkpoint_round_trip(root)}


def _parallel(constraints: dict, seed: int) -> tuple[Any, Any]:
    bundle = build("tiny-llama", LONG, BATCH, None, seed=seed)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints={**constraints, **ALLGATHER},
                                 lowered=False)  # its collectives are counted as DTensor's, one per redistribute
    return pm, bundle


def _adamw_state(pm: Any, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = autopar.optimizer_state_dict(pm, optimizer)
    return gathered({k: v for k, v in flat.items() if k.startswith("state.") and isinstance(v, torch.Tensor)})


def _checkpoint_round_trip(root: str) -> dict[str, dict[str, torch.Tensor]]:
    """Two AdamW steps under ZeRO-1 over dp x cp, saved; loaded by a dp=4 plan built from another seed:
    both optimizer states, gathered whole."""
    pm, bundle = _parallel(RUNS[0], seed=0)
    optimizer = torch.optim.AdamW(pm.parameters())
    for batch in batches(bundle, 2, seed=0):
        optimizer.zero_grad()
        pm.step(*batch)
        optimizer.step()
    autopar.save_checkpoint(pm, optimizer, Path(root) / "zero1-dp2xcp2", step=2)
    other, _ = _parallel({"dp": 4, "fsdp": 0}, seed=1)
    loaded = torch.optim.AdamW(other.parameters())
    autopar.load_checkpoint(other, loaded, Path(root) / "zero1-dp2xcp2")
    return {"saved": _adamw_state(pm, optimizer), "loaded": _adamw_state(other, loaded)}


def _train(constraints: dict) -> dict[str, Any]:
    """Three SGD steps under the plan (as ``autopar.testing.parity.train_module``), counting the
    collectives of the last; how each parameter the optimizer steps is placed, and its share of the whole."""
    pm, bundle = _parallel(constraints, seed=0)
    shards = {name: (tuple(str(p) for p in param.placements), param.to_local().numel() / param.numel())
              for name, param in pm.named_parameters() if isinstance(param, DTensor)}
    return {**train_counting(pm, bundle, STEPS, seed=0), "shards": shards}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return run_on_ranks(_train_rank, WORLD, str(tmp_path_factory.mktemp("checkpoints")))


@pytest.fixture(scope="module")
def trained(ranks) -> list[list[dict[str, Any]]]:
    return [rank["runs"] for rank in ranks]


@pytest.fixture(scope="module")
def reference():
    return train_single("tiny-llama", LONG, BATCH, None, STEPS)


IDS = [",".join(f"{k}={v}" for k, v in c.items()) for c in RUNS]


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RUNS)), ids=IDS)
def test_matches_single_process(trained, reference, index: int) -> None:
    AutoparResult.from_ranks([per_rank[index] for per_rank in trained]).assert_matches(reference)


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RUNS)), ids=IDS)
def test_optimizer_parameters_are_shards_over_dp_and_cp(trained, index: int) -> None:
    """Every parameter the optimizer steps is ``Shard`` on every mesh dim (dp and cp, or cp alone):
    1 / (dp x cp) of the whole on each rank (tiny-llama's dims split evenly); a pipeline rank holds its
    stage's."""
    for per_rank in trained:
        result = per_rank[index]
        degrees = result["plan"]["degrees"]
        assert degrees["zero"] == RUNS[index]["fsdp"] and degrees["dp"] * degrees["cp"] == 4 // degrees["pp"]
        assert result["shards"] and len(result["shards"]) <= len(result["plan"]["placements"])
        for name, (placements, share) in result["shards"].items():
            assert all(p.startswith("S(") for p in placements), (name, placements)
            assert share == 1 / (degrees["dp"] * degrees["cp"]), (name, share)


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("index", ONE_STAGE, ids=[IDS[i] for i in ONE_STAGE])
def test_step_runs_the_predicted_collectives(trained, index: int) -> None:
    """The keys' and values' gathers and their gradients' reduce_scatters, and ZeRO's reduce_scatter and
    all_gather of each parameter on each of its dims, are the plan's."""
    for per_rank in trained:
        result = per_rank[index]
        assert result["counted"] == predicted_collectives(result["plan"]), result["counted"]


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_sharded_state_loads_under_a_plan_without_zero(ranks) -> None:
    saved, loaded = ranks[0]["checkpoint"]["saved"], ranks[0]["checkpoint"]["loaded"]
    assert saved and set(saved) == set(loaded)
    for key, value in saved.items():
        assert torch.equal(value, loaded[key]), key


def test_a_cp_mesh_without_dp_is_searched_again_under_zero1() -> None:
    """Where memory shaped a mesh's plan, the free ZeRO stage is tried again at 1 on any mesh with a ZeRO
    dim (dp or cp), a cp-only mesh included; never on one with neither, nor where the stage is pinned."""
    from types import SimpleNamespace

    from autopar.core.axes import MeshAxis
    from autopar.core.constraints import Constraints
    from autopar.planning.meshes import MeshChoice
    from autopar.planning.search import _distributed_optimizer_may_help

    free = SimpleNamespace(constraints=Constraints())
    pinned = SimpleNamespace(constraints=Constraints.from_mapping({"fsdp": 0}))
    cp_only, tp_only = MeshChoice(((MeshAxis.CP, 4),)), MeshChoice(((MeshAxis.TP, 4),))
    assert _distributed_optimizer_may_help(free, cp_only, "nothing fit")
    assert not _distributed_optimizer_may_help(free, tp_only, "nothing fit")
    assert not _distributed_optimizer_may_help(pinned, cp_only, "nothing fit")
