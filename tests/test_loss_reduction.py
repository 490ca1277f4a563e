"""Microbatches add up to the global batch's loss and gradients however the loss reduces the batch
(``ir/loss_reduction.py``): a count-divided sum (cross-entropy over the targets it counts, padding left out)
weighs each microbatch by its share of the count, a sum by one. Each microbatch used to be weighted 1/m: with
padding spread unevenly the microbatches' means were averaged (tiny-gpt's parameters 2.6e-2 off after three
SGD steps), and a summed loss came out m times too small."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import BadInputError
from autopar.ir.capture import capture
from autopar.ir.loss_reduction import AVERAGED, DIVIDED, SUMMED, loss_reduction
from autopar.models import build_model
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import batches, sgd, train_parallel_many, train_single


def _reduction(loss_fn, targets: torch.Tensor):
    """The loss reduction of an embedding and a linear layer under ``loss_fn``, captured at ``targets``' shape (as
    the runtime captures a step: one microbatch)."""
    model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))
    return loss_reduction(capture(model, (torch.randint(0, 32, tuple(targets.shape)),), targets, loss_fn))


def _masked_mean(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A mean of per-token losses over a mask of the targets, its count clamped against an empty batch."""
    mask = (targets != 0).float().flatten()
    losses = F.cross_entropy(out.flatten(0, 1), targets.flatten(), reduction="none")
    return (losses * mask).sum() / mask.sum().clamp(min=1)


def test_a_masked_mean_divides_by_its_count_clamped_or_not() -> None:
    targets = torch.randint(0, 32, (2, 6))
    assert _reduction(_masked_mean, targets).kind == DIVIDED
    capped = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="sum") / (  # noqa: E731
        (t != 0).sum().clamp(max=4))
    assert _reduction(capped, targets).kind == AVERAGED  # a clamp from above changes large counts


def test_cross_entropy_divides_by_the_targets_it_counts_and_weighs_microbatches_by_their_share() -> None:
    targets = torch.randint(0, 32, (4, 6))
    ce = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    reduction = _reduction(ce, targets[:2])
    assert reduction.kind == DIVIDED and reduction.reads == (1,)  # the targets: the second user input
    padded = targets.clone()
    padded[0, 1:] = -100  # the first microbatch counts 1 + 6 targets, the second 12
    pieces = [(None, padded[:2]), (None, padded[2:])]
    assert reduction.weights(pieces) == pytest.approx([7 / 19, 12 / 19])
    assert reduction.weights(pieces[:1]) == [1.0]


@pytest.mark.parametrize("loss_fn, kind", [
    (lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="sum"), SUMMED),
    (lambda out, t: out.float().pow(2).mean(), AVERAGED),  # a mean: every microbatch holds as many elements
    (lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()) + out.mean(), AVERAGED),  # two terms
    (lambda out, t: out.sum() / torch.tensor(3.0), AVERAGED),  # a constant divisor is not a count of the batch
], ids=["sum", "mean", "two-terms", "constant-divisor"])
def test_other_losses_are_weighed_as_they_reduce_the_batch(loss_fn, kind) -> None:
    reduction = _reduction(loss_fn, torch.randint(0, 32, (4, 6)))
    assert reduction.kind == kind
    assert reduction.weights([()] * 4) == [1.0] * 4 if kind == SUMMED else [0.25] * 4


def test_a_mixture_of_experts_loss_with_its_auxiliary_term_is_averaged() -> None:
    bundle = build_model("tiny-moe", global_batch=4, seq=16, device="meta")
    assert loss_reduction(capture(bundle.model, bundle.example_inputs, bundle.example_targets,
                                  bundle.loss_fn)).kind == AVERAGED


def test_label_smoothing_adds_two_quotients_by_one_count_and_weighs_as_that_count() -> None:
    smoothed = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), label_smoothing=0.1)  # noqa: E731
    targets = torch.randint(1, 32, (4, 6))
    reduction = _reduction(smoothed, targets[:2])
    assert reduction.kind == DIVIDED
    targets[2:, 3:] = -100  # 12 counted targets, then 6
    assert reduction.weights([(None, targets[:2]), (None, targets[2:])]) == pytest.approx([12 / 18, 6 / 18])


def test_quotients_by_different_counts_are_weighted_one_mth_with_a_warning() -> None:
    def two_masks(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits, t = out.flatten(0, 1), t.flatten()
        return F.cross_entropy(logits, t) + F.cross_entropy(logits, torch.where(t < 16, -100, t))

    targets = torch.arange(24).reshape(4, 6)  # 0 to 23: the second loss counts 8 of the 24 targets, all in one half
    reduction = _reduction(two_masks, targets[:2])
    assert reduction.kind == DIVIDED
    with pytest.warns(UserWarning, match="divisors differ on a microbatch"):
        assert reduction.weights([(None, targets[:2]), (None, targets[2:])]) == [0.5, 0.5]


RUNS = [("edge_models:padded_tokens", {"dp": 2, "microbatches": 2}, True),
        ("edge_models:smoothed_tokens", {"dp": 2, "microbatches": 2}, True),
        ("edge_models:padded_tokens", {"tp": 2, "microbatches": 4}, False),
        ("edge_models:padded_tokens", {"pp": 2, "microbatches": 4}, None),
        ("edge_models:summed_regression", {"dp": 2, "microbatches": 2}, True),
        ("edge_models:summed_regression", {"pp": 1, "microbatches": 4}, None),
        # lowered, its forward under eager autograd: the head's bias read as a partial sum (row-parallel), whose
        # gradient DTensor keeps whole (``lower_eager._refusing_partitioned_sums``; it came out halved)
        ("edge_models:summed_regression", {"tp": 2, "microbatches": 2}, None)]


@pytest.mark.dist
def test_microbatches_add_up_to_the_batchs_loss_and_gradients_like_one_process() -> None:
    results = train_parallel_many(2, [dict(name=name, overrides=None, global_batch=8, seq=8, steps=3, plan=None,
                                           constraints=constraints, lowered=lowered)
                                      for name, constraints, lowered in RUNS])
    reference = {name: train_single(name, None, 8, 8, 3) for name, _, _ in RUNS}
    for (name, constraints, _), result in zip(RUNS, results):
        result.assert_matches(reference[name], f"{name} under {constraints}")


def _with_an_empty_microbatch(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``batch`` with the targets of its first half all ignored (``padded_tokens`` ignores 0)."""
    tokens, targets = batch
    targets = targets.clone()
    targets[: targets.shape[0] // 2] = 0
    return tokens, targets


def _trained_with_an_empty_microbatch(rank: int, world: int, constraints: dict) -> Any:
    """Three SGD steps whose first of two microbatches counts no target: the losses and final parameters, or the
    refusal."""
    bundle = build_model("edge_models:padded_tokens", global_batch=8, seq=8, device="cpu", seed=0)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints=constraints)
    opt = sgd(pm.parameters())
    losses = []
    try:
        for batch in batches(bundle, 3, 0):
            opt.zero_grad()
            losses.append(pm.step(*_with_an_empty_microbatch(batch)).item())
            opt.step()
    except BadInputError as exc:
        return str(exc)
    return losses, pm.full_state_dict()


@pytest.mark.dist
def test_a_microbatch_counting_no_target_adds_nothing_and_a_pipeline_refuses_it() -> None:
    """Its loss is 0/0: one process, dividing by the whole batch's count, trains on; ``step`` leaves such a
    microbatch out, and a pipeline, which runs every microbatch, refuses the step (every gradient was NaN)."""
    bundle = build_model("edge_models:padded_tokens", global_batch=8, seq=8, device="cpu", seed=0)
    opt = sgd(bundle.model.parameters())
    expected = []
    for batch in batches(bundle, 3, 0):
        tokens, targets = _with_an_empty_microbatch(batch)
        opt.zero_grad()
        loss = bundle.loss_fn(bundle.model(tokens), targets)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    losses, params = run_on_ranks(_trained_with_an_empty_microbatch, 2, {"dp": 2, "microbatches": 2})[0]
    assert losses == pytest.approx(expected, rel=1e-5)
    for name, p in bundle.model.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=0, atol=1e-6)
    refused = run_on_ranks(_trained_with_an_empty_microbatch, 2, {"pp": 2, "microbatches": 2})[0]
    assert "microbatch 0 of this step (1 of 2) counts none of the targets" in refused
