"""Hugging Face mixture-of-experts families autopar has no factory for, built as a user's own
``module:factory`` would: a transformers config, ``HFModel`` around the model, and
``autopar.models.hf.use_permuted_experts`` so that an ``ep`` dim can split the experts. Tiny sizes, random
weights, nothing downloaded; loaded by spec ``hf_moe_models:NAME`` (``build_model`` imports it, in spawned
ranks too):

* ``qwen2_moe``: Qwen2-MoE, a shared expert beside 4 routed ones, 2 a token (``capacity_factor``: each
  expert's slots per sequence, as ``use_permuted_experts`` takes it; None: none dropped);
* ``deepseek_v3``: DeepSeek-V3, multi-head latent attention (its queries and keys written into buffers slice
  by slice) and grouped top-k routing over 4 experts beside a shared one, its first layer dense (``layers``:
  2, or 3 for two mixture-of-experts layers a pipeline cuts between);
* ``gpt_oss``: gpt-oss, experts stored transposed with biases and a clamped gate of its own, attention sinks
  (transformers runs it with eager attention only);
* ``jamba``: Jamba, four layers alternating a Mamba mixer with a dense MLP and attention with 4 experts, 2 a
  token (layers alike every other one: a pipeline cuts between pairs).
"""

from __future__ import annotations

import os

import torch

from autopar.models.hf import HFModel, token_loss, use_permuted_experts

VOCAB = 128


def _factory(config_name: str, global_batch: int, seq: int, attention: str = "sdpa", layers: int = 2,
             capacity_factor: float | None = None, **config: object):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    cfg = getattr(transformers, config_name)(
        num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB,
        max_position_embeddings=max(seq, 32), bos_token_id=0, eos_token_id=1, pad_token_id=None, **config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attention)
    use_permuted_experts(model, seq, capacity_factor=capacity_factor)
    ids, targets = torch.randint(0, VOCAB, (global_batch, seq)), torch.randint(0, VOCAB, (global_batch, seq))
    return HFModel(model, ["input_ids"], "logits", VOCAB), (ids,), targets, token_loss


def qwen2_moe(global_batch: int = 4, seq: int = 16, capacity_factor: float | None = None):
    return _factory("Qwen2MoeConfig", global_batch, seq, capacity_factor=capacity_factor, num_key_value_heads=2,
                    num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, shared_expert_intermediate_size=64)


def deepseek_v3(global_batch: int = 4, seq: int = 16, layers: int = 2):
    return _factory("DeepseekV3Config", global_batch, seq, layers=layers, n_routed_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)


def gpt_oss(global_batch: int = 4, seq: int = 16):
    return _factory("GptOssConfig", global_batch, seq, "eager", num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=8)


def jamba(global_batch: int = 4, seq: int = 16):
    return _factory("JambaConfig", global_batch, seq, layers=4, num_key_value_heads=2, num_experts=4,
                    num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                    expert_layer_offset=1, mamba_d_state=8, use_mamba_kernels=False)
