"""The built-in Llama's MLP and norm options (``mlp``, ``norm``; ``autopar/models/llama.py``): Nemotron-4's
two-matrix squared-ReLU MLP and bias-free LayerNorm beside Llama's SwiGLU and RMSNorm.

* reachable through ``--set`` text like the other dims, and a wrong choice names the valid ones;
* the modules compute what their formulas say (``w2(relu(w1 x)^2)``, LayerNorm without bias) and hold
  two matrices an MLP, no biases;
* what a layer saves for backward, in 16-bit floats, is the closed form counted by hand below: the MLP's
  two ``f``-wide tensors (the ReLU's output and its square) in place of SwiGLU's four;
* the planner splits the new MLP Megatron's way under a pinned tensor-parallel degree (the up-projection
  by columns, the down-projection by rows) with sequence parallelism and each recomputation mode;
* on gloo (slow, dist), training under tensor and sequence parallelism with ``core_attention``
  recomputation matches single-process training (``autopar.testing.parity``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.core.plan import CHECKPOINTING
from autopar.ir.capture import capture
from autopar.ir.layers import layer_of, output_vals
from autopar.models import build_model, parse_overrides
from autopar.models.llama import SquaredReLUMLP, SwiGLU

NEMOTRON_STYLE = "mlp=squared-relu,norm=layernorm"


def _nemotron_style(**dims) -> dict:
    return {**parse_overrides(NEMOTRON_STYLE), **dims}


def test_set_text_builds_squared_relu_mlp_and_layernorm_without_bias() -> None:
    bundle = build_model("tiny-llama", overrides=parse_overrides(NEMOTRON_STYLE), device="cpu")
    block = bundle.model.blocks[0]
    assert isinstance(block.mlp, SquaredReLUMLP)
    assert all(isinstance(norm, nn.LayerNorm) for norm in (block.attn_norm, block.mlp_norm, bundle.model.norm_f))
    names = [name for name, _ in bundle.model.named_parameters()]
    assert not any(name.endswith("bias") for name in names)
    assert [n for n in names if n.startswith("blocks.0.mlp.")] == ["blocks.0.mlp.w1.weight", "blocks.0.mlp.w2.weight"]
    default = build_model("tiny-llama", device="cpu")
    assert isinstance(default.model.blocks[0].mlp, SwiGLU)
    cfg = bundle.config
    assert default.num_params() - bundle.num_params() == cfg.layers * cfg.hidden * cfg.ffn_hidden  # one matrix less


@pytest.mark.parametrize("text, message", [
    ("mlp=gelu", r"mlp='gelu': expected one of swiglu, squared-relu"),
    ("norm=batchnorm", r"norm='batchnorm': expected one of rmsnorm, layernorm"),
])
def test_a_wrong_choice_names_the_valid_ones(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model("tiny-llama", overrides=parse_overrides(text))


def test_the_modules_compute_their_formulas() -> None:
    bundle = build_model("tiny-llama", overrides=parse_overrides(NEMOTRON_STYLE), device="cpu")
    block, cfg = bundle.model.blocks[0], bundle.config
    x = torch.randn(2, 3, cfg.hidden)
    w1, w2 = block.mlp.w1.weight, block.mlp.w2.weight
    torch.testing.assert_close(block.mlp(x), (F.relu(x @ w1.T) ** 2) @ w2.T)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    normed = (x - mean) / torch.sqrt(var + cfg.norm_eps) * block.attn_norm.weight
    torch.testing.assert_close(block.attn_norm(x), normed)
    logits = bundle.model(*bundle.example_inputs)
    bundle.loss_fn(logits, bundle.example_targets).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in bundle.model.parameters())


S, B, H, A, KV, FFN = 128, 2, 256, 4, 2, 1024


def test_a_layer_saves_the_closed_form() -> None:
    """Per layer, 16-bit floats: ``14 sbh`` (the two residual sums and the two LayerNorm outputs, which the
    next ops read; rotated q; the attention output and its merged copy), ``4 sb kv`` (rotated k and v, ``kv``
    the key-value width), ``2 sbf`` (the ReLU's output: its square, which the down projection reads, is made
    again from it in backward, ``ir/rematerialize.py``), the two LayerNorms' mean and rstd (``4 sb`` floats)
    and fused attention's log-sum-exp (``a s b`` floats). SwiGLU at the same width saves ``4 sbf`` in its MLP
    (both projections; the SiLU, captured whole, and the product are made again), 2 sbf more."""
    dims = dict(layers=1, hidden=H, heads=A, kv_heads=KV, seq=S, ffn_hidden=FFN, vocab=256)
    sbh, kv_sb = S * B * H, S * B * (H // A) * KV
    expected = 14 * sbh + 4 * kv_sb + 2 * S * B * FFN + 2 * 4 * S * B + 2 * A * S * B
    assert _layer_saved_bytes(_nemotron_style(**dims)) == expected
    swiglu_layernorm = _layer_saved_bytes({**dims, "norm": "layernorm"})
    assert swiglu_layernorm - expected == 2 * S * B * FFN


def _layer_saved_bytes(overrides: dict) -> float:
    """What ``blocks.0`` saves for backward, every float at 2 bytes."""
    bundle = build_model("tiny-llama", overrides=overrides, global_batch=B, seq=S)
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    saved = captured.saved_for_backward()
    total = 0.0
    for node in captured.graph.nodes:
        if node.op == "call_function" and layer_of(node) == "blocks.0":
            for val, share in zip(output_vals(node), saved.of(node)):
                if isinstance(val, torch.Tensor):
                    total += share * val.numel() * (2 if val.dtype.is_floating_point else val.element_size())
    return total


PUBLISHED_MODE = "core_attention"
"""Nemotron-4's published recomputation (NeMo's "selective"): the mode the default tier plans with."""


@pytest.mark.parametrize("checkpointing", [
    mode if mode == PUBLISHED_MODE else pytest.param(mode, marks=pytest.mark.slow) for mode in CHECKPOINTING])
def test_pinned_tensor_parallel_plan_splits_the_mlp_by_columns_then_rows(checkpointing: str) -> None:
    bundle = build_model("tiny-llama", overrides=_nemotron_style(layers=1, hidden=64, heads=4, kv_heads=2,
                                                                 ffn_hidden=256, vocab=256, seq=32))
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xH100", bundle.loss_fn,
                        example_targets=bundle.example_targets,
                        constraints={"tp": 2, "dp": 1, "sp": 1, "checkpointing": checkpointing, "dtype": "bf16"})
    assert plan.degrees["tp"] == 2 and plan.checkpointing == checkpointing
    assert plan.placements["blocks.0.mlp.w1.weight"] == ["S(0)"]  # [ffn, hidden]: output columns split
    assert plan.placements["blocks.0.mlp.w2.weight"] == ["S(1)"]  # [hidden, ffn]: input rows split
    assert plan.placements["blocks.0.mlp_norm.weight"] == ["R"]


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_tensor_and_sequence_parallel_training_matches_single_process() -> None:
    from autopar.testing.parity import train_parallel_many, train_single

    overrides = _nemotron_style(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256, seq=32)
    constraint_sets = [{"tp": 2, "sp": 1, "checkpointing": PUBLISHED_MODE}, {"dp": 2, "fsdp": 3}]
    results = train_parallel_many(2, [dict(name="tiny-llama", overrides=overrides, global_batch=8, seq=None,
                                           steps=3, plan=None, constraints=c) for c in constraint_sets])
    reference = train_single("tiny-llama", overrides, 8, None, 3)
    for result in results:
        result.assert_matches(reference)
    assert results[0].plan["placements"]["blocks.0.mlp.w2.weight"] == ["S(1)"]
    assert results[0].plan["checkpointing"] == PUBLISHED_MODE and results[1].plan["degrees"]["fsdp"] == 2
