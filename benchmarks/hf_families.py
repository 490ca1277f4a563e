"""Hugging Face families autopar has no factory for, as a user meets them: capture, plan, and train on 2 gloo ranks.

Each row builds a tiny model of one ``transformers`` family from its config class (2 layers, width 64, random
weights, nothing downloaded; dropout, stochastic depth and router noise off, since parity compares exact
steps), wrapped as a user's ``module:factory`` would (``autopar.models.hf.HFModel``, logits and a token or class
cross-entropy). Per row:

* ``plan``: ``autopar.plan`` with ``tp=2`` on ``1x2xcpu`` (meta tensors): ``ok`` or the error's first line, and
  the ops the plan runs replicated for want of a DTensor rule (autopar's warnings);
* with ``--parity``: 3 SGD steps on 2 gloo ranks under each of ``dp=2``, ``tp=2`` and ``pp=2`` against one
  process (``autopar.testing.parity``: gradients after the first backward, per-step losses, final parameters
  and buffers): ``ok``, ``differs`` (the worst mismatch), ``refused`` (autopar's clear refusal, such as a
  pipeline of layers that do not repeat) or ``failed`` (anything else: a bug).

Families whose eager training is itself chaotic at this size (MobileNet's BatchNorm over a 1x1 map: a 1e-6
relative change of the weights moves its parameters by 0.6 in 3 steps; Gemma 4's and CPM-Ant's text models,
whose final parameters move by 6e-5 and 2e-3 when one process only accumulates the batch in two halves) or that
need a sequence length their config ties elsewhere are left out. Prints a Markdown table and writes
``results/hf_families.json``::

    python benchmarks/hf_families.py            # capture and plan every family
    python benchmarks/hf_families.py --parity   # and train each on 2 gloo ranks (about 45 minutes on 2 cores)
    python benchmarks/hf_families.py --parity --only Jamba SqueezeBERT   # these rows again, the others kept
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results" / "hf_families.json"
BATCH, SEQ, STEPS = 4, 16, 3
PARALLELISMS = ({"dp": 2}, {"tp": 2}, {"pp": 2})

DECODER = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=128, max_position_embeddings=64, head_dim=16, bos_token_id=0,
               eos_token_id=1, pad_token_id=None)
ENCODER = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128,
               max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SEQ2SEQ = dict(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
               dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=0,
               eos_token_id=1, decoder_start_token_id=0)
SPEECH = {**{k: v for k, v in SEQ2SEQ.items() if k != "max_position_embeddings"}, "num_mel_bins": 16,
          "max_source_positions": 16, "max_target_positions": 32}  # Whisper: 2 x 16 frames, halved by its stride
VISION = dict(image_size=32, num_labels=10)
EXPERTS = dict(num_experts_per_tok=2)

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {  # row -> (kind, config class, settings beyond the kind's)
    "Gemma": ("decoder", "GemmaConfig", {}),
    "Gemma 2": ("decoder", "Gemma2Config", {"sliding_window": 8}),
    "Gemma 3": ("decoder", "Gemma3TextConfig", {"sliding_window": 8}),
    "Phi": ("decoder", "PhiConfig", {}),
    "Phi-3": ("decoder", "Phi3Config", {}),
    "Falcon": ("decoder", "FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2, "head_dim": None}),
    "GPT-NeoX": ("decoder", "GPTNeoXConfig", {}),
    "GPT-J": ("decoder", "GPTJConfig", {"rotary_dim": 8}),
    "CodeGen": ("decoder", "CodeGenConfig", {"rotary_dim": 8, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                             "attn_pdrop": 0.0}),
    "OPT": ("decoder", "OPTConfig", {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
                                     "layerdrop": 0.0}),
    "XGLM": ("decoder", "XGLMConfig", {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
                                       "layerdrop": 0.0}),
    "GPT-BigCode": ("decoder", "GPTBigCodeConfig", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "MPT": ("decoder", "MptConfig", {}),
    "OLMo": ("decoder", "OlmoConfig", {}),
    "OLMo 2": ("decoder", "Olmo2Config", {}),
    "Qwen3": ("decoder", "Qwen3Config", {}),
    "Granite": ("decoder", "GraniteConfig", {}),
    "Cohere": ("decoder", "CohereConfig", {}),
    "StableLM": ("decoder", "StableLmConfig", {}),
    "Starcoder2": ("decoder", "Starcoder2Config", {}),
    "Llama 4 (text)": ("decoder", "Llama4TextConfig", {}),
    "SmolLM3": ("decoder", "SmolLM3Config", {}),
    "GLM-4": ("decoder", "Glm4Config", {}),
    "Nemotron": ("decoder", "NemotronConfig", {}),
    "Helium": ("decoder", "HeliumConfig", {}),
    "Exaone 4": ("decoder", "Exaone4Config", {}),
    "Apertus": ("decoder", "ApertusConfig", {}),
    "DiffLlama": ("decoder", "DiffLlamaConfig", {}),
    "Doge": ("decoder", "DogeConfig", {}),
    "BitNet": ("decoder", "BitNetConfig", {}),
    "LFM2": ("decoder", "Lfm2Config", {}),
    "Qwen2-MoE": ("decoder", "Qwen2MoeConfig", {**EXPERTS, "num_experts": 4, "moe_intermediate_size": 32,
                                                "shared_expert_intermediate_size": 32}),
    "Qwen3-MoE": ("decoder", "Qwen3MoeConfig", {**EXPERTS, "num_experts": 4, "moe_intermediate_size": 32}),
    "OLMoE": ("decoder", "OlmoeConfig", {**EXPERTS, "num_experts": 4}),
    "GraniteMoE": ("decoder", "GraniteMoeConfig", {**EXPERTS, "num_local_experts": 4}),
    "PhiMoE": ("decoder", "PhimoeConfig", {**EXPERTS, "num_local_experts": 4, "router_jitter_noise": 0.0,
                                           "input_jitter_noise": 0.0, "attention_dropout": 0.0}),
    "GLM-4-MoE": ("decoder", "Glm4MoeConfig", {}),
    "gpt-oss": ("decoder", "GptOssConfig", {**EXPERTS, "num_local_experts": 4, "sliding_window": 8}),
    "Jamba (4 layers)": ("decoder", "JambaConfig", {**EXPERTS, "num_hidden_layers": 4, "num_experts": 4,
                                                    "attn_layer_period": 2, "attn_layer_offset": 1,
                                                    "expert_layer_period": 2, "expert_layer_offset": 1,
                                                    "mamba_d_state": 8, "use_mamba_kernels": False}),
    "Bamba": ("decoder", "BambaConfig", {}),
    "Falcon-H1": ("decoder", "FalconH1Config", {}),
    "Falcon-Mamba": ("decoder", "FalconMambaConfig", {}),
    "Qwen3-Next": ("decoder", "Qwen3NextConfig", {}),
    "RoBERTa": ("masked", "RobertaConfig", {}),
    "XLM-RoBERTa": ("masked", "XLMRobertaConfig", {}),
    "ELECTRA": ("masked", "ElectraConfig", {"embedding_size": 64}),
    "DistilBERT": ("masked", "DistilBertConfig", {"n_layers": 2, "dim": 64, "n_heads": 4, "hidden_dim": 128,
                                                  "dropout": 0.0, "attention_dropout": 0.0}),
    "ModernBERT": ("masked", "ModernBertConfig", {"global_attn_every_n_layers": 2, "local_attention": 8,
                                                  "embedding_dropout": 0.0, "mlp_dropout": 0.0,
                                                  "attention_dropout": 0.0, "pad_token_id": 0}),
    "ERNIE": ("masked", "ErnieConfig", {}),
    "MegatronBERT": ("masked", "MegatronBertConfig", {}),
    "RemBERT": ("masked", "RemBertConfig", {"input_embedding_size": 64, "output_embedding_size": 64}),
    "DeBERTa": ("masked", "DebertaConfig", {}),
    "RoFormer": ("masked", "RoFormerConfig", {"embedding_size": 64}),
    "MPNet": ("masked", "MPNetConfig", {}),
    "ConvBERT": ("masked", "ConvBertConfig", {"embedding_size": 64}),
    "SqueezeBERT": ("masked", "SqueezeBertConfig", {"embedding_size": 64}),
    "FNet": ("masked", "FNetConfig", {"use_tpu_fourier_optimizations": False}),
    "Marian": ("seq2seq", "MarianConfig", {}),
    "Pegasus": ("seq2seq", "PegasusConfig", {}),
    "mBART": ("seq2seq", "MBartConfig", {}),
    "Whisper": ("speech", "WhisperConfig", {}),
    "DINOv2": ("vision", "Dinov2Config", {"patch_size": 8, "hidden_size": 64, "num_hidden_layers": 2,
                                          "num_attention_heads": 4, "intermediate_size": 128}),
    "BEiT": ("vision", "BeitConfig", {"patch_size": 8, "hidden_size": 64, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "intermediate_size": 128,
                                      "use_relative_position_bias": True, "drop_path_rate": 0.0}),
    "SegFormer": ("vision", "SegformerConfig", {"hidden_sizes": [16, 32, 48, 64], "num_attention_heads": [1, 2, 2, 4],
                                                "depths": [1, 1, 1, 1], "drop_path_rate": 0.0,
                                                "classifier_dropout_prob": 0.0}),
    "ConvNeXt V2": ("vision", "ConvNextV2Config", {"hidden_sizes": [16, 32, 48, 64], "depths": [1, 1, 1, 1]}),
    "PoolFormer": ("vision", "PoolFormerConfig", {"hidden_sizes": [16, 32, 48, 64], "depths": [1, 1, 1, 1]}),
    "FocalNet": ("vision", "FocalNetConfig", {"embed_dim": 16, "depths": [1, 1, 1, 1], "hidden_dropout_prob": 0.0,
                                              "drop_path_rate": 0.0}),
    "Swinv2": ("vision", "Swinv2Config", {"embed_dim": 16, "depths": [1, 1, 1, 1], "num_heads": [1, 2, 2, 4],
                                          "window_size": 2, "drop_path_rate": 0.0}),
}
# Decoders of transformers' causal-LM registry beyond those above, each from its config's defaults with the
# decoder settings (and every dropout off, ``_dropout_off``), probed 2026-12-07 (stop 60).
FAMILIES.update({row: ("decoder", config_class, {}) for row, config_class in (
    ("Bailing hybrid", "BailingHybridConfig"), ("Beam", "BeamConfig"), ("BioGPT", "BioGptConfig"),
    ("Blenderbot (decoder)", "BlenderbotConfig"), ("Cohere 2", "Cohere2Config"), ("CTRL", "CTRLConfig"),
    ("CWM", "CwmConfig"), ("Dory", "DoryConfig"), ("ERNIE 4.5", "Ernie4_5Config"), ("EXAONE", "ExaoneConfig"),
    ("Flint", "FlintConfig"), ("GIT", "GitConfig"), ("GLM", "GlmConfig"),
    ("GPT-NeoX Japanese", "GPTNeoXJapaneseConfig"),
    ("HRM (text)", "HrmTextConfig"), ("HyperCLOVA X", "HyperCLOVAXConfig"), ("InternLM3", "InternLM3Config"),
    ("Jais 2", "Jais2Config"), ("LFM3", "Lfm3Config"), ("Mamba", "MambaConfig"), ("Ministral 3", "Ministral3Config"),
    ("Moshi", "MoshiConfig"), ("MVP (decoder)", "MvpConfig"), ("nanochat", "NanoChatConfig"), ("OLMo 3", "Olmo3Config"),
    ("OLMo hybrid", "OlmoHybridConfig"), ("OpenAI GPT", "OpenAIGPTConfig"), ("Persimmon", "PersimmonConfig"),
    ("Qwen3.5 (text)", "Qwen3_5TextConfig"), ("RWKV", "RwkvConfig"), ("Seed-OSS", "SeedOssConfig"),
    ("VaultGemma", "VaultGemmaConfig"), ("xLSTM", "xLSTMConfig"))})


def factory(row: str) -> tuple:
    """The row's model as a user's ``module:factory`` returns it: (model, inputs, targets, loss_fn)."""
    from autopar.models import hf

    kind, config_class, settings = FAMILIES[row]
    transformers = hf._transformers()
    defaults = {"decoder": DECODER, "masked": ENCODER, "seq2seq": SEQ2SEQ, "speech": SPEECH, "vision": VISION}[kind]
    config_type = getattr(transformers, config_class)
    arguments = {k: v for k, v in {**defaults, **_dropout_off(config_type), **settings}.items()
                 if v is not None or k == "pad_token_id"}
    config = config_type(**arguments)
    if kind == "decoder":
        model = _from_config(transformers.AutoModelForCausalLM, config)
        inputs = {"input_ids": hf._ids(config.vocab_size, BATCH, SEQ)}
    elif kind == "masked":
        model = _from_config(transformers.AutoModelForMaskedLM, config)
        inputs = hf._token_inputs(config.vocab_size, BATCH, SEQ, True)
    elif kind == "seq2seq":
        model = transformers.AutoModelForSeq2SeqLM.from_config(config)
        inputs = {"input_ids": hf._ids(config.vocab_size, BATCH, SEQ),
                  "decoder_input_ids": hf._ids(config.vocab_size, BATCH, SEQ)}
    elif kind == "speech":
        model = transformers.WhisperForConditionalGeneration(config)
        inputs = {"input_features": torch.randn(BATCH, config.num_mel_bins, 2 * config.max_source_positions),
                  "decoder_input_ids": hf._ids(config.vocab_size, BATCH, SEQ)}
    else:
        model = transformers.AutoModelForImageClassification.from_config(config)
        return hf._result(model, {"pixel_values": torch.randn(BATCH, 3, 32, 32)},
                          torch.randint(0, config.num_labels, (BATCH,)), config.num_labels, False)
    return hf._result(model, inputs, hf._ids(config.vocab_size, BATCH, SEQ), config.vocab_size, False)


def _dropout_off(config_type: Any) -> dict[str, float]:
    """Every dropout rate of ``config_type``'s defaults (``*dropout*``, ``*pdrop``, ``drop_path*``,
    ``layerdrop``) at 0: parity compares exact steps."""
    try:
        defaults = config_type().to_dict()
    except Exception:  # a config that cannot be built bare: its row's own settings say
        return {}
    return {k: 0.0 for k, v in defaults.items()
            if isinstance(v, float) and any(word in k for word in ("dropout", "pdrop", "drop_path", "layerdrop"))}


def _from_config(auto: Any, config: Any) -> torch.nn.Module:
    """``auto.from_config`` with fused attention, or the family's own where it has none."""
    try:
        return auto.from_config(config, attn_implementation="sdpa")
    except ValueError:
        return auto.from_config(config, attn_implementation="eager")


def __getattr__(name: str) -> Any:
    """``hf_families:ROW`` (row names with spaces and punctuation as ``_``), for ``build_model`` and spawned ranks."""
    row = next((r for r in FAMILIES if _spec_name(r) == name), None)
    if row is None:
        raise AttributeError(name)
    return lambda **_: factory(row)


def _spec_name(row: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in row)


def plan_row(row: str) -> dict[str, Any]:
    import autopar
    from autopar.models import build_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            bundle = build_model(f"hf_families:{_spec_name(row)}", global_batch=BATCH, device="meta")
            autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, {"tp": 2},
                         example_targets=bundle.example_targets)
            outcome = "ok"
        except Exception as exc:  # a row's failure is its result
            outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    replicated = sorted({str(w.message).split(" for ")[1].split(";")[0] for w in caught
                         if "no DTensor sharding strategy for" in str(w.message)})
    return {"plan": outcome, "replicated": replicated}


def parity_row(row: str) -> dict[str, str]:
    from autopar.core.errors import DistributedRunError
    from autopar.testing.parity import train_parallel_many, train_single

    spec = f"hf_families:{_spec_name(row)}"
    out = {}
    for constraints in PARALLELISMS:
        key = ",".join(f"{k}={v}" for k, v in constraints.items())
        run = dict(name=spec, overrides=None, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                   constraints=constraints)
        try:
            result = train_parallel_many(2, [run])[0]
        except DistributedRunError as exc:
            refusal = [line.split("BadInputError: ", 1)[1] for line in str(exc).splitlines()
                       if "BadInputError: " in line]
            out[key] = f"refused: {refusal[0][:120]}" if refusal else \
                "failed: " + str(exc).strip().splitlines()[-1][:160]
            continue
        mismatches = result.mismatches(train_single(spec, None, BATCH, None, STEPS))
        out[key] = "ok" if not mismatches else "differs: " + mismatches[0][:160]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parity", action="store_true", help="also train each family on 2 gloo ranks")
    parser.add_argument("--only", nargs="+", help="rows whose names start so")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"the JSON results (default {RESULTS})")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))  # hf_families:ROW, here and (below) in spawned ranks
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    rows = [r for r in FAMILIES if not args.only or any(r.startswith(o) for o in args.only)]
    results = []
    for row in rows:
        result = {"family": row, "config": FAMILIES[row][1], **plan_row(row)}
        if args.parity and result["plan"] == "ok":
            result["parity"] = parity_row(row)
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.only and args.out.exists():  # the other rows as the last full run left them
        kept = {r["family"]: r for r in json.loads(args.out.read_text())["rows"]}
        results = list({**kept, **{r["family"]: r for r in results}}.values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="minutes"),
                                   "torch": torch.__version__, "transformers": transformers.__version__,
                                   "rows": results}, indent=1) + "\n")
    print(_table(results, args.parity))


def _table(results: list[dict[str, Any]], parity: bool) -> str:
    keys = [",".join(f"{k}={v}" for k, v in c.items()) for c in PARALLELISMS] if parity else []
    lines = ["| family | config | plan | " + " | ".join(keys) + (" | " if keys else "") + "run replicated |",
             "|---" * (4 + len(keys)) + "|"]
    for r in results:
        cells = [r.get("parity", {}).get(k, "-") for k in keys]
        lines.append(f"| {r['family']} | `{r['config']}` | {r['plan']} | " + " | ".join(cells)
                     + (" | " if keys else "") + ", ".join(r["replicated"]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
