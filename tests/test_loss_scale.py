"""fp16 plans scale the loss (``runtime/loss_scale.py``): without it an fp16 backward flushed the small gradients
(``faint_gradients``: every gradient off, most by 10x or more, single-process fp32 training the reference); with
it they match to fp16's precision. A step whose gradients overflow is skipped (no gradients left, so the
optimizer's step changes nothing) and the scale backs off."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import autopar
from autopar.models import build_model
from autopar.runtime.loss_scale import BACKOFF_FACTOR, GROWTH_INTERVAL, LARGEST_SCALE, DynamicLossScale
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import Tolerances, train_parallel_many, train_single

FP16 = Tolerances(grad_rtol=2e-2, grad_atol=0.0, param_atol=2e-7, loss_rtol=1e-2, grad_scale_rtol=2e-2)
"""Relative tolerances: the gradients are about 1e-7 (an absolute tolerance would let zeros through)."""


def _parameter(grad: list[float] | None) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(2))
    p.grad = None if grad is None else torch.tensor(grad)
    return p


def test_a_step_unscales_its_gradients_and_keeps_those_held_from_before() -> None:
    scale = DynamicLossScale()
    held, fresh = _parameter([1.0, -2.0]), _parameter(None)
    assert scale.before_backward([held, fresh]) == LARGEST_SCALE < 65504  # fp16's largest number
    assert held.grad.tolist() == [LARGEST_SCALE, -2 * LARGEST_SCALE]
    held.grad += 3 * LARGEST_SCALE  # backward adds the scaled gradients of this step
    fresh.grad = torch.tensor([0.5, 0.25]) * LARGEST_SCALE
    assert scale.after_backward([held, fresh], torch.device("cpu"))
    assert held.grad.tolist() == [4.0, 1.0] and fresh.grad.tolist() == [0.5, 0.25]


def test_an_overflow_drops_the_steps_gradients_and_backs_the_scale_off_which_grows_back_to_its_largest() -> None:
    scale = DynamicLossScale()
    finite, overflowed = _parameter([1.0, 1.0]), _parameter([math.inf, 0.0])
    assert not scale.after_backward([finite, overflowed], torch.device("cpu"))
    assert finite.grad is None and overflowed.grad is None  # the optimizer's step changes nothing
    assert (scale.scale, scale.skipped) == (LARGEST_SCALE * BACKOFF_FACTOR, 1)
    for _ in range(2 * GROWTH_INTERVAL):
        assert scale.after_backward([_parameter([1.0, 1.0])], torch.device("cpu"))
    assert scale.scale == LARGEST_SCALE


RUNS = [({"dp": 2, "dtype": "fp16"}, True), ({"tp": 2, "dtype": "fp16"}, False),
        ({"pp": 2, "dtype": "fp16", "microbatches": 2}, None)]


@pytest.mark.dist
def test_fp16_plans_keep_gradients_fp16_would_flush_as_one_process_in_fp32_computes_them() -> None:
    name = "edge_models:faint_gradients"
    reference = train_single(name, None, 8, 8, 3)
    results = train_parallel_many(2, [dict(name=name, overrides=None, global_batch=8, seq=8, steps=3, plan=None,
                                           constraints=constraints, lowered=lowered) for constraints, lowered in RUNS])
    for (constraints, _), result in zip(RUNS, results):
        assert result.mismatches(reference, FP16) == [], constraints


def _scale_through_a_checkpoint(rank: int, world: int, root: str) -> list[float]:
    """An fp16 module's loss scale backed off, saved; a fresh module's before and after loading it."""
    scales = []
    for load in (False, True):
        bundle = build_model("tiny-gpt", global_batch=4, seq=16, device="cpu", seed=0)
        pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                     example_targets=bundle.example_targets, constraints={"dp": 2, "dtype": "fp16"})
        if load:
            scales.append(pm.loss_scale.scale)
            autopar.load_checkpoint(pm, None, root)
        else:
            pm.loss_scale.scale /= 8  # as after three overflows
            autopar.save_checkpoint(pm, None, root)
        scales.append(pm.loss_scale.scale)
    return scales


@pytest.mark.dist
def test_a_checkpoint_keeps_the_loss_scale(tmp_path) -> None:
    assert run_on_ranks(_scale_through_a_checkpoint, 2, str(tmp_path / "ckpt"))[0] == [
        LARGEST_SCALE / 8, LARGEST_SCALE, LARGEST_SCALE / 8]
