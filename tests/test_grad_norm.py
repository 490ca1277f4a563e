"""Gradient clipping on any plan (``pm.clip_grad_norm_``, ``runtime/grad_norm.py``): the model's total norm is
the one-process norm, so clipping by it trains like one process clipping by ``torch.nn.utils.clip_grad_norm_``:
under tp and FSDP (DTensor reduces each shard's part), and under a pipeline, whose stages' parts are added over
the pipeline (torch's clipping of a stage's own ``parameters()`` clipped each stage by its own norm), a weight
tied across stages counted once."""

from __future__ import annotations

import math

import pytest

from autopar.testing.parity import train_parallel_many, train_single

MAX_NORM = 0.05  # well under the tiny models' gradient norms (about 2): every step clips
RUNS = [("tiny-gpt", None, {"tp": 2}, 2.0), ("tiny-llama", None, {"dp": 2, "fsdp": 3}, 2.0),
        ("tiny-gpt", {"tie_embeddings": True}, {"pp": 2, "microbatches": 2}, 2.0),
        ("tiny-gpt", None, {"pp": 2}, math.inf)]


@pytest.mark.dist
def test_clipping_by_the_models_norm_trains_like_one_process_on_any_plan() -> None:
    runs = [dict(name=name, overrides=overrides, global_batch=4, seq=16, steps=3, plan=None, constraints=constraints,
                 lowered=None, clip=(MAX_NORM, norm_type)) for name, overrides, constraints, norm_type in RUNS]
    for run, result in zip(runs, train_parallel_many(2, runs)):
        reference = train_single(run["name"], run["overrides"], 4, 16, 3, clip=run["clip"])
        result.assert_matches(reference, f"{run['name']} under {run['constraints']} clipped to {run['clip']}")
