"""Published models at their own size, built from transformers' configs on the meta device, for planning
from the command line (``package.module:factory``, this folder on ``PYTHONPATH``):

    PYTHONPATH=benchmarks autopar plan published_models:deepseek_v3 --set layers=7 \\
        --cluster 16x8xH100 --global-batch 128 --seq 4096

``deepseek_v3``: DeepSeek-V3 as transformers' ``DeepseekV3Config`` defaults describe it (DeepSeek-AI, "DeepSeek-V3
Technical Report", 2024: 61 layers, the first 3 dense, then 256 routed experts and one shared, 8 routed a token;
multi-head latent attention), with ``layers`` of them; its experts set up by ``use_permuted_experts`` so that an
``ep`` dim may split them. Nothing is downloaded and no weight is allocated.
"""

from __future__ import annotations

import os

import torch

from autopar.models.hf import HFModel, token_loss, use_permuted_experts


def deepseek_v3(global_batch: int = 16, seq: int = 4096, layers: int = 61):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    config = transformers.DeepseekV3Config(num_hidden_layers=layers)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    use_permuted_experts(model, seq)
    vocab = config.vocab_size
    tokens = lambda: torch.randint(0, vocab, (global_batch, seq), device="meta")  # noqa: E731
    return HFModel(model, ["input_ids"], "logits", vocab), (tokens(),), tokens(), token_loss
