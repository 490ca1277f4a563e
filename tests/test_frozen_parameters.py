"""Frozen parameters (``requires_grad=False``, as fine-tuning sets them) stay frozen in autopar's module: no
gradient, so the optimizer leaves them as they are, on every runtime and parallelism. autopar's parameters were
all trainable whatever the model's said, so an optimizer over ``pm.parameters()`` trained the frozen ones too
(tiny-gpt with three frozen, dp=2: final parameters 7e-3 from single-process training's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import autopar
from autopar.models import build_model
from autopar.testing.parity import train_parallel_many, train_single

MODEL = "edge_models:frozen_blocks"
RUNS = [({"dp": 2}, True), ({"tp": 2}, False), ({"pp": 2, "microbatches": 2, "schedule": "1f1b"}, True),
        ({"pp": 2, "microbatches": 2, "schedule": "zero_bubble"}, None), ({"dp": 2, "fsdp": 1}, True),
        ({"dp": 2, "fsdp": 3}, True)]


ADAPTED = "edge_models:lora_blocks"
ADAPTED_RUNS = [({"tp": 2}, True), ({"dp": 2, "fsdp": 3}, True)]


@pytest.mark.dist
def test_frozen_parameters_get_no_gradient_and_keep_their_values_like_one_process() -> None:
    runs = [(MODEL, constraints, lowered) for constraints, lowered in RUNS]
    runs += [(ADAPTED, constraints, lowered) for constraints, lowered in ADAPTED_RUNS]
    results = train_parallel_many(2, [dict(name=name, overrides=None, global_batch=8, seq=8, steps=3, plan=None,
                                           constraints=constraints, lowered=lowered)
                                      for name, constraints, lowered in runs])
    reference = {name: train_single(name, None, 8, 8, 3) for name in (MODEL, ADAPTED)}
    assert not any(name.startswith(("emb.", "blocks.0.")) for name in reference[MODEL].grads)  # frozen: no gradient
    assert sorted({name.rsplit(".", 1)[1] for name in reference[ADAPTED].grads}) == ["a", "b"]  # the adapters'
    for (name, constraints, _), result in zip(runs, results):
        result.assert_matches(reference[name], f"{name} under {constraints}")


def _adapter_tuned_llama(frozen: bool) -> tuple[Any, ...]:
    """Llama 3 8B on the meta device, every weight but the final norm's and the head's frozen where ``frozen``
    (a stand-in for adapter fine-tuning, where the base model gets no gradient)."""
    bundle = build_model("llama3-8b", global_batch=8, seq=4096, device="meta")
    for name, p in bundle.model.named_parameters():
        p.requires_grad_(not frozen or name in ("norm_f.weight", "lm_head.weight"))
    return bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn


def test_the_planner_prices_frozen_parameters_without_gradient_state_or_sync(tmp_path) -> None:
    plans = {}
    for frozen in (False, True):
        model, inputs, targets, loss_fn = _adapter_tuned_llama(frozen)
        plans[frozen] = autopar.plan(model, inputs, "1x8xH100", loss_fn, example_targets=targets,
                                     save_problem=tmp_path / f"{frozen}.json")
    whole, tuned = plans[False], plans[True]
    memory, whole_memory = tuned.predicted["memory_bytes"], whole.predicted["memory_bytes"]
    head = 128256 * 4096 + 4096  # the trainable parameters: the head and the final norm
    assert 0 < memory["grads"] <= 4 * head * 1.01  # fp32 gradients of these alone, on a device
    assert 0 < memory["optimizer"] <= 12 * head * 1.01  # AdamW's state of these alone
    assert whole_memory["optimizer"] > 12 * 8.0e9 / 8  # the whole model's, sharded over the 8 devices at most
    assert memory["params"] <= 2 * 8.04e9  # the frozen weights in bf16, with no fp32 master copy
    assert sum(memory.values()) < sum(whole_memory.values())
    assert tuned.predicted["comm_s"]["reduce_scatter"] == 0  # nothing frozen is sharded for its gradients
    assert tuned.predicted["comm_s"]["all_reduce"] < 0.2 * whole.predicted["comm_s"]["all_reduce"]
    # no gradient reaches the frozen blocks: their backward is not run, the head's is
    assert tuned.predicted["compute_s"] < 0.5 * whole.predicted["compute_s"]
    assert 0.3 * whole.model["flops_per_step"] < tuned.model["flops_per_step"] < 0.5 * whole.model["flops_per_step"]
    assert tuned.model["graph_fingerprint"] != whole.model["graph_fingerprint"]  # a plan for one is not the other's
    again = autopar.plan(autopar.load_problem(tmp_path / "True.json"), cluster="1x8xH100")
    assert (again.predicted, again.placements) == (tuned.predicted, tuned.placements)  # it remembers what is frozen


def test_under_mixed_precision_frozen_parameters_are_kept_in_the_compute_dtype(two_fake_ranks: None) -> None:
    """No optimizer steps a frozen parameter, so it has no fp32 master: it is kept in bf16, the dtype the program
    reads (``mixed_precision.as_master``), as the planner prices it."""
    bundle = build_model(MODEL, global_batch=8, seq=8, device="cpu")
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints={"dp": 2, "dtype": "bf16"})
    dtypes = {name: (p.dtype, p.requires_grad) for name, p in pm.named_parameters()}
    assert dtypes["emb.weight"] == dtypes["blocks.0.fc1.weight"] == (torch.bfloat16, False)
    assert dtypes["blocks.1.fc2.weight"] == dtypes["head.weight"] == (torch.float32, True)
