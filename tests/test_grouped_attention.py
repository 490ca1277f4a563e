"""Grouped-query attention in the built-in Llama (issue 20): keys and values stay at their ``kv_heads``.

The attention reads each key-value head for its group of query heads (one fused op, ``enable_gqa``)
instead of copying k and v out to every query head, as Megatron-LM and NeMo run it. So:

* planning: a layer's activations are the multi-head model's less the key-value heads it does not have
  (hand-checked bytes), and attention's work is the same (every query head still attends);
* tensor parallelism splits k and v on their heads with the queries, and where there are fewer
  key-value heads than tp ranks attention is not split on heads at all;
* gloo parity (SGD, 3 steps) at tp=2 with one key-value head (multi-query) and with two under
  ``core_attention`` recomputation.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.models import build_model
from autopar.testing.parity import train_parallel_many, train_single

LAYERS, BATCH, SEQ, HEADS, HEAD_DIM = 2, 4, 64, 8, 16
FP32 = 4
STEPS = 3


def _llama(kv_heads: int, heads: int = HEADS) -> dict:
    return {"layers": LAYERS, "hidden": heads * HEAD_DIM, "heads": heads, "kv_heads": kv_heads,
            "ffn_hidden": 256, "vocab": 1024, "seq": SEQ}


def _plan(kv_heads: int, tp: int = 1) -> autopar.Plan:
    bundle = build_model("tiny-llama", overrides=_llama(kv_heads), global_batch=BATCH, device="meta")
    return autopar.plan(bundle.model, bundle.example_inputs, f"1x{tp}xcpu", bundle.loss_fn,
                        example_targets=bundle.example_targets,
                        constraints={"tp": tp, "dp": 1, "checkpointing": "none", "microbatches": 1})


def _attention_ops(plan: autopar.Plan) -> list[dict]:
    ops = [op for op in plan.ops.values() if op["op"] == "aten.scaled_dot_product_attention.default"]
    assert len(ops) == LAYERS
    return ops


def test_a_layer_saves_its_key_value_heads_and_attends_with_every_query_head() -> None:
    """2 key-value heads against 8 (multi-head attention): each layer holds its k and v, ``b x s x hd``
    per head in fp32, 6 heads fewer each; nothing else changes, the attention op's price included."""
    grouped, multi_head = _plan(kv_heads=2), _plan(kv_heads=HEADS)
    saved = multi_head.predicted["memory_bytes"]["activations"] - grouped.predicted["memory_bytes"]["activations"]
    assert saved == LAYERS * 2 * BATCH * SEQ * HEAD_DIM * (HEADS - 2) * FP32  # 393,216 B
    assert [op["cost"] for op in _attention_ops(grouped)] == [op["cost"] for op in _attention_ops(multi_head)]
    assert not any(op["op"] == "aten.expand.default" for op in grouped.ops.values())  # k, v never repeated


@pytest.mark.parametrize("kv_heads, split", [(2, True), (1, False)])
def test_tensor_parallel_splits_keys_and_values_with_their_query_heads(kv_heads: int, split: bool) -> None:
    """At tp=2, two key-value heads split one a rank with their query heads; one head cannot split, and
    the queries then stay whole too (a rank's query heads must find their key-value heads locally)."""
    for op in _attention_ops(_plan(kv_heads, tp=2)):
        query, key, value = op["inputs"][:3]
        assert key == value == query and (query == ["S(1)"]) == split


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_grouped_and_multi_query_llama_under_tp_match_single_process() -> None:
    """tp=2 with one key-value head (fewer than the ranks) and with two under ``core_attention``."""
    runs = [(_llama(1, heads=4), "none"), (_llama(2, heads=4), "core_attention")]
    results = train_parallel_many(2, [dict(name="tiny-llama", overrides=overrides, global_batch=BATCH, seq=None,
                                           steps=STEPS, plan=None,
                                           constraints={"tp": 2, "dp": 1, "checkpointing": checkpointing})
                                      for overrides, checkpointing in runs])
    for (overrides, checkpointing), result in zip(runs, results):
        assert result.plan["degrees"]["tp"] == 2 and result.plan["checkpointing"] == checkpointing
        result.assert_matches(train_single("tiny-llama", overrides, BATCH, None, STEPS))
