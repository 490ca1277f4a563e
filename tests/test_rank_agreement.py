"""Every rank trains one model, whatever each rank did before or between steps: the ranks start from rank 0's
weights (``runtime/mesh.start_from_rank_zero``: each rank used to keep its own shards of whatever it had built,
so ranks seeded apart trained replicas that never agreed), and a step draws its dropout masks from a stream
of its own that every rank of the plan holds alike (``runtime/randomness.StepRandomness``: the masks came from
each process's global generator, so one extra draw on one rank parted the replicas under tp). And ``pm.eval()``
turns the program's dropout off, as ``model.eval()`` does (``passes/dropout_mode.py``: a forward in eval mode
dropped as in training)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

import autopar
from autopar import BadInputError
from autopar.models import build_model
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import AutoparResult, batches, sgd, train_module, train_single

SEED = 1000
PER_RANK_RUNS = [("tiny-gpt", {"dp": 2}), ("tiny-llama", {"tp": 2})]


def _built_with_a_seed_per_rank(rank: int, world: int) -> list[dict[str, Any]]:
    """Each run's training, on a model each rank built from its own seed (rank 0's: ``SEED``) and the
    batches of ``SEED`` on every rank."""
    results = []
    for name, constraints in PER_RANK_RUNS:
        bundle = build_model(name, global_batch=4, seq=16, device="cpu", seed=SEED + rank)
        pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                     example_targets=bundle.example_targets, constraints=constraints)
        results.append(train_module(pm, bundle, 3, SEED, rank))
    return results


@pytest.mark.dist
def test_ranks_that_built_different_weights_train_rank_zeros_model_like_one_process() -> None:
    per_rank = run_on_ranks(_built_with_a_seed_per_rank, 2)
    for i, (name, constraints) in enumerate(PER_RANK_RUNS):
        result = AutoparResult.from_ranks([ranks[i] for ranks in per_rank])
        result.assert_matches(train_single(name, None, 4, 16, 3, seed=SEED), f"{name} under {constraints}")


def _replicas_after_uneven_draws(rank: int, world: int, lowered: bool) -> dict[str, Any]:
    """Three tp steps of a model with dropout, rank 0 drawing random numbers of its own between them: this
    rank's replicated parameters, and whether each step left the caller's generator as it found it."""
    bundle = build_model("edge_models:dropout_blocks", global_batch=4, seq=8, device="cpu", seed=0)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints={"tp": 2}, lowered=lowered)
    opt = sgd(pm.parameters())
    untouched = []
    for batch in batches(bundle, 3, 0):
        opt.zero_grad()
        before = torch.get_rng_state()
        pm.step(*batch)
        untouched.append(torch.equal(before, torch.get_rng_state()))
        opt.step()
        if rank == 0:
            torch.rand(7)  # the job's own draw, on one rank only
    replicated = {name: p.to_local().detach().clone() for name, p in pm.named_parameters()
                  if isinstance(p, DTensor) and all(isinstance(pl, Replicate) for pl in p.placements)}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, replicated)
    return {"untouched": untouched, "replicas": everyone}


@pytest.mark.dist
@pytest.mark.parametrize("lowered", [False, True], ids=["dtensor", "lowered"])
def test_dropout_masks_agree_on_replicas_whatever_each_rank_draws_between_steps(lowered: bool) -> None:
    got = run_on_ranks(_replicas_after_uneven_draws, 2, lowered)[0]
    mine, theirs = got["replicas"]
    assert {"blocks.0.fc2.bias", "blocks.1.norm.weight"} <= set(mine)  # the residual branch is replicated
    parted = [name for name in mine if not torch.equal(mine[name], theirs[name])]
    assert parted == []
    assert got["untouched"] == [True, True, True]  # a step draws nothing from the job's own generator


def test_init_weights_is_refused_for_a_model_with_its_weights_and_a_meta_model_is_planned(two_fake_ranks: None
                                                                                         ) -> None:
    """``init_weights`` initializes a model built on the meta device (``tests/test_deferred_init.py`` trains one);
    given for a model that has its weights, it would not run: refused, before anything is broadcast."""
    built = build_model("tiny-gpt", global_batch=4, seq=16, device="cpu")
    with pytest.raises(BadInputError, match=r"init_weights initializes a model built on the meta device"):
        autopar.autoparallelize(built.model, built.example_inputs, loss_fn=built.loss_fn,
                                example_targets=built.example_targets, cluster="1x2xcpu", init_weights=print)
    bundle = build_model("tiny-gpt", global_batch=4, seq=16, device="meta")
    assert autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn,
                        example_targets=bundle.example_targets).mesh.devices == 2


def _evaluated(rank: int, world: int, lowered: bool) -> dict[str, Any]:
    """A training step (no optimizer: the weights stay), then forwards in eval mode (the second under
    ``torch.inference_mode``, where DTensor's views failed: "Cannot set version_counter for inference tensor"),
    a step in eval mode, one under ``torch.no_grad``, and a step back in training mode."""
    bundle = build_model("edge_models:dropout_blocks", global_batch=4, seq=8, device="cpu", seed=0)
    ids, targets = bundle.example_inputs[0], bundle.example_targets
    pm = autopar.autoparallelize(bundle.model, (ids,), loss_fn=bundle.loss_fn, example_targets=targets,
                                 constraints={"tp": 2}, lowered=lowered)
    pm.step(ids, targets)  # the lowered graphs traced, in training mode
    pm.eval()
    evaluated = [pm(ids, targets).full_tensor().item()]
    with torch.inference_mode():
        evaluated.append(pm(ids, targets).full_tensor().item())
    refused = [_refusal(lambda: pm.step(ids, targets))]
    pm.train()
    with torch.no_grad():
        refused.append(_refusal(lambda: pm.step(ids, targets)))
    return {"evaluated": evaluated, "refused": refused, "trains": pm.step(ids, targets).item()}


def _refusal(call: Any) -> str:
    try:
        call()
    except BadInputError as exc:
        return str(exc)
    return ""


def _pipeline_forward(rank: int, world: int) -> str:
    bundle = build_model("tiny-gpt", global_batch=4, seq=16, device="cpu", seed=0)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints={"pp": 2})
    try:
        pm(*bundle.example_inputs, bundle.example_targets)
    except BadInputError as exc:
        return str(exc)
    return ""


@pytest.mark.dist
def test_eval_mode_turns_the_programs_dropout_off_as_model_eval_does() -> None:
    """A pipeline plan has no forward-only call, and says so (torch said the module "is missing the required
    forward function")."""
    bundle = build_model("edge_models:dropout_blocks", global_batch=4, seq=8, device="cpu", seed=0)
    with torch.no_grad():
        expected = bundle.loss_fn(bundle.model.eval()(*bundle.example_inputs), bundle.example_targets).item()
    for lowered in (False, True):
        got = run_on_ranks(_evaluated, 2, lowered)[0]
        assert got["evaluated"] == pytest.approx([expected, expected], rel=1e-6), lowered
        assert "step() trains, and this module is in eval mode" in got["refused"][0]
        assert "gradients are off here (torch.no_grad() or torch.inference_mode())" in got["refused"][1]
        assert got["trains"] > 0
    assert "a pipeline plan (pp=2) has no forward-only call" in run_on_ranks(_pipeline_forward, 2)[0]


def _resumed_losses(rank: int, world: int, root: str) -> dict[str, list[float]]:
    """Four tp steps of the dropout model, uninterrupted; and two, a checkpoint, a fresh module loading it, two."""
    def fresh() -> tuple[Any, Any, Any]:
        bundle = build_model("edge_models:dropout_blocks", global_batch=4, seq=8, device="cpu", seed=0)
        pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                     example_targets=bundle.example_targets, constraints={"tp": 2})
        return bundle, pm, sgd(pm.parameters())

    def train(pm: Any, opt: Any, data: list) -> list[float]:
        losses = []
        for batch in data:
            opt.zero_grad()
            losses.append(pm.step(*batch).item())
            opt.step()
        return losses

    bundle, pm, opt = fresh()
    data = batches(bundle, 4, 0)
    uninterrupted = train(pm, opt, data)
    bundle, pm, opt = fresh()
    first = train(pm, opt, data[:2])
    autopar.save_checkpoint(pm, opt, autopar.checkpoint_path(root, 2), 2)
    bundle, pm, opt = fresh()
    step = autopar.load_checkpoint(pm, opt, autopar.latest_checkpoint(root))
    return {"uninterrupted": uninterrupted, "resumed": first + train(pm, opt, data[step:])}


@pytest.mark.dist
def test_a_run_resumed_from_a_checkpoint_draws_the_dropout_masks_of_an_uninterrupted_one(tmp_path) -> None:
    got = run_on_ranks(_resumed_losses, 2, str(tmp_path))[0]
    assert got["resumed"] == got["uninterrupted"]
