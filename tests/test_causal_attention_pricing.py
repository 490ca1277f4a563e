"""Causal fused attention priced as flash attention runs it (issue 20).

A causal flash-attention kernel skips the key blocks above the diagonal, so it runs about half of the
products ``torch.utils.flop_counter`` counts for ``scaled_dot_product_attention``; its backward
recomputes the scores, five products against the forward's two. Model FLOPs (MFU) keep the full count,
the convention of Megatron-LM, PaLM and torchtitan. Checked by hand on the score matrix and through
``autopar.plan`` on one H100.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.cost_models import compute_time, parse_cluster
from autopar.ir.capture import FUSED_ATTENTION, capture
from autopar.models import build_model
from autopar.planning.pricing import MATMUL_BACKWARD_RATIO, backward_ratio, causal_share, global_flops, kernel_flops

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 256, 8, 2, 64
BF16 = 2


def _bundle():
    overrides = {"layers": 2, "hidden": HEADS * HEAD_DIM, "heads": HEADS, "kv_heads": KV_HEADS,
                 "ffn_hidden": 1024, "vocab": 1024, "seq": SEQ}
    return build_model("tiny-llama", overrides=overrides, global_batch=BATCH, device="meta")


def _attention_nodes():
    bundle = _bundle()
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    return [n for n in captured.graph.nodes if n.target is FUSED_ATTENTION]


@pytest.mark.parametrize("queries, keys, kept", [(4, 4, 10), (1, 8, 1), (8, 4, 10 + 4 * 4), (4, 8, 10)])
def test_causal_share_counts_the_lower_triangle(queries: int, keys: int, kept: int) -> None:
    """Query i sees keys 0..i (torch's top-left ``is_causal``): 1+2+3+4 = 10 of 16 for 4 x 4; with more
    queries than keys the later ones see every key."""
    assert causal_share(queries, keys) == kept / (queries * keys)


def test_a_causal_attention_kernel_runs_half_the_products_and_its_backward_two_and_a_half_times() -> None:
    """Per layer, full attention is two products of b x H x s x s x d multiply-adds, 4 b H s^2 d =
    268,435,456 FLOPs here; the causal kernel runs (s + 1) / 2s of it, and its backward 5 / 2 of that."""
    full = 4 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM
    for node in _attention_nodes():
        assert global_flops(node) == full  # the model-FLOPs count stays the full one
        assert kernel_flops(node) == pytest.approx(full * (SEQ + 1) / (2 * SEQ))
        assert backward_ratio(node, ["activation"] * 3) == 2.5  # q, k and v all get gradients
    assert MATMUL_BACKWARD_RATIO == 2.0


def test_the_plan_prices_causal_attention_at_its_kernel_flops() -> None:
    """Through ``autopar.plan`` on one H100: the attention op costs its causal kernel's forward (q, k, v
    read and the output written in bf16, at fused attention's forward efficiency) and 2.5 times that
    kernel backward, at the backward kernel's (Hopper's 0.53 of peak against 0.61), where the full count
    with a 2x backward would cost (3 x 2s / (s + 1)) / 3.5 = 1.71x more; the plan's model FLOPs still
    count full attention."""
    bundle = _bundle()
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x1xH100", bundle.loss_fn,
                        example_targets=bundle.example_targets,
                        constraints={"dtype": "bf16", "checkpointing": "none", "microbatches": 1})
    flops = 4 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM * (SEQ + 1) / (2 * SEQ)
    moved = BF16 * BATCH * SEQ * HEAD_DIM * (HEADS + 2 * KV_HEADS + HEADS)
    device = parse_cluster("1x1xH100").device
    forward = compute_time(flops, moved, device, "bf16", "attention")
    backward = compute_time(flops, moved, device, "bf16", "attention_backward")
    assert backward > forward
    attention = [op for op in plan.ops.values() if op["op"] == "aten.scaled_dot_product_attention.default"]
    assert len(attention) == 2
    for op in attention:
        assert op["cost"]["compute_s"] == pytest.approx(forward + 2.5 * backward)
    full_attention_flops = 3 * 2 * 4 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM  # two layers, forward + backward
    assert plan.model["flops_per_step"] > full_attention_flops


def test_grouped_attention_is_counted_where_torchs_flop_counter_wants_equal_heads(monkeypatch) -> None:
    """torch's ``sdpa_flop_count`` takes key-value heads fewer than the query's only from torch 2.13 on;
    2.11's raised on them, so no GQA model could be planned with it (Llama on the H200, 2026-12-04).
    Counted as the kernel broadcasts the key-value heads, with a counter that refuses unequal heads."""
    from autopar.planning import pricing

    def equal_heads_only(q, k, v, *rest):
        assert q[1] == k[1] == v[1], "shapes are incompatible"
        return counter(q, k, v, *rest)

    counter = pricing.sdpa_flop_count
    monkeypatch.setattr(pricing, "sdpa_flop_count", equal_heads_only)
    full = 4 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM
    for node in _attention_nodes():
        assert global_flops(node) == full
        assert backward_ratio(node, ["activation"] * 3) == 2.5
