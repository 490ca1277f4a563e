"""Context parallelism with expert parallelism (issue 16): ``--fix cp=2,ep=2``.

As Megatron-Core composes them, the expert dim is carved from the data-parallel ranks beside ``cp``: a
mesh ``ep x cp`` whose ``ep`` splits the batch (and every expert weight on its expert dim) and whose
``cp`` splits the sequence. A rank's tokens, a sequence shard under cp, are grouped for routing on the
rank (``models/moe.py`` cuts its rows into groups, which ``roles.check_groups_within_a_chunk`` keeps
inside a rank's chunks of ``seq / 2 cp`` consecutive tokens) and dispatched to their experts with
all_to_alls over ``ep``, exactly as under dp.

* The planner: the mesh, the expert split, the two all_to_alls a layer forward and two backward;
  refused: routing groups larger than a chunk, or a whole sequence routed as one group (its prefix sum).
* Parity on gloo (SGD, 3 steps, tiny-moe at 32 tokens in groups of 4, 4 ranks, cp=2 x ep=2): gradients
  after the first backward, per-step losses and final parameters equal single-process training, with no
  token dropped (keys and values all-gathered, or ringed) and with tokens dropped at the default capacity;
  the collectives of one step are the plan's.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.core.errors import BadInputError
from autopar.inspect.collectives import predicted_collectives
from autopar.models import build_model
from autopar.testing.counters import counted_step
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import train_parallel_many, train_single
from autopar.testing.counters import as_run_on_gloo

BATCH = 8
STEPS = 3
GROUPED = {"seq": 32, "group_size": 4}
"""tiny-moe at 32 tokens, routed in groups of 4: a cp=2 rank's chunks are 8 tokens, two groups each."""
NO_DROP = {**GROUPED, "drop_tokens": False}
CP_EP = {"cp": 2, "ep": 2, "cp_attention": "allgather"}


def _plan(overrides: dict, constraints: dict = CP_EP) -> dict:
    bundle = build_model("tiny-moe", overrides=overrides, global_batch=BATCH)
    return autopar.plan(bundle.model, bundle.example_inputs, "1x4xcpu", bundle.loss_fn, constraints,
                        example_targets=bundle.example_targets).to_dict()


def test_cp_by_ep_splits_the_sequence_and_the_experts() -> None:
    plan = _plan(NO_DROP)
    assert plan["mesh"] == {"shape": [2, 2], "dim_names": ["cp", "ep"]}
    assert plan["degrees"]["cp"] == 2 and plan["degrees"]["ep"] == 2
    assert all(spec["placements"] == ["S(1)", "S(0)"] for spec in plan["inputs"].values())
    experts = {name: p for name, p in plan["placements"].items() if ".experts." in name}
    assert experts and all(p == ["R", "S(0)"] for p in experts.values())
    assert all(p == ["R", "R"] for name, p in plan["placements"].items() if name not in experts)
    layers = plan["model"]["layers"]
    assert predicted_collectives(plan, ["forward"])["all_to_all"] == 2 * layers
    assert predicted_collectives(plan)["all_to_all"] == 4 * layers


def test_cp_refuses_routing_groups_larger_than_a_chunk() -> None:
    with pytest.raises(BadInputError, match=r"cp=2 gives each rank chunks of seq / \(2 x cp\) = 8 consecutive tokens, "
                                            r"and view\w* groups 16 consecutive tokens"):
        _plan({**NO_DROP, "group_size": 16})


def test_cp_refuses_a_whole_sequence_routed_as_one_group() -> None:
    with pytest.raises(BadInputError, match=r"cp=2 splits the sequence, and cumsum\w* sums along all of it"):
        _plan({**NO_DROP, "group_size": 0})


def _run(overrides: dict, constraints: dict = CP_EP) -> dict:
    return dict(name="tiny-moe", overrides=overrides, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                constraints=constraints)


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_cp2_by_ep2_matches_single_process() -> None:
    """With keys and values all-gathered and with ring attention; and with tokens dropped (3 slots per
    expert for a group's 4 tokens x 2 choices over 4 experts): the capacity is per group, inside a rank's
    chunk, so each rank drops what one process drops."""
    ring = {**CP_EP, "cp_attention": "ring"}
    dropless, ringed, dropping = train_parallel_many(4, [_run(NO_DROP), _run(NO_DROP, ring), _run(GROUPED)])
    assert dropless.plan["mesh"]["dim_names"] == ["cp", "ep"] and dropping.plan["model"]["moe"]["slots_per_expert"] == 3
    assert ringed.plan["cp_attention"] == "ring"
    single = train_single("tiny-moe", NO_DROP, BATCH, None, STEPS)
    dropless.assert_matches(single)
    ringed.assert_matches(single)
    dropping.assert_matches(train_single("tiny-moe", GROUPED, BATCH, None, STEPS))


def _counted_step(rank: int, world: int) -> dict:
    return counted_step("tiny-moe", NO_DROP, BATCH, CP_EP)


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_cp2_by_ep2_runs_the_predicted_collectives() -> None:
    """The forward's and the step's collectives are the plan's: the keys' and values' all_gathers over
    cp, the dispatch and combine all_to_alls over ep (on gloo an all_gather and a chunk each), their
    backward, and the gradient sync."""
    counted = run_on_ranks(_counted_step, 4)
    plan = counted[0]["plan"]
    forward, step = predicted_collectives(plan, ["forward"]), predicted_collectives(plan)
    for c in counted:
        assert c["forward"] == as_run_on_gloo(forward), (c["forward"], forward)
        assert c["step"] == as_run_on_gloo(step), (c["step"], step)
