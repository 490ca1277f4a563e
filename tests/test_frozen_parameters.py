"""Frozen parameters (``requires_grad=False``, as fine-tuning sets them) stay frozen in autopar's module: no
gradient, so the optimizer leaves them as they are, on every runtime and parallelism. autopar's parameters were
all trainable whatever the model's said, so an optimizer over ``pm.parameters()`` trained the frozen ones too
(tiny-gpt with three frozen, dp=2: final parameters 7e-3 from single-process training's)."""

from __future__ import annotations

import pytest

from autopar.testing.parity import train_parallel_many, train_single

MODEL = "edge_models:frozen_blocks"
RUNS = [({"dp": 2}, True), ({"tp": 2}, False), ({"pp": 2, "microbatches": 2, "schedule": "1f1b"}, True),
        ({"pp": 2, "microbatches": 2, "schedule": "zero_bubble"}, None), ({"dp": 2, "fsdp": 1}, True),
        ({"dp": 2, "fsdp": 3}, True)]


@pytest.mark.dist
def test_frozen_parameters_get_no_gradient_and_keep_their_values_like_one_process() -> None:
    runs = [dict(name=MODEL, overrides=None, global_batch=8, seq=8, steps=3, plan=None, constraints=constraints,
                 lowered=lowered) for constraints, lowered in RUNS]
    reference = train_single(MODEL, None, 8, 8, 3)
    assert not any(name.startswith(("emb.", "blocks.0.")) for name in reference.grads)  # frozen: no gradient
    for (constraints, _), result in zip(RUNS, train_parallel_many(2, runs)):
        result.assert_matches(reference, f"{MODEL} under {constraints}")
