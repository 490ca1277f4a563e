"""Published training runs on today's GPUs (H100, H200, B200), for validating the cost model (issue 20).

A data file: one frozen ``ModernRun`` per published run, each copied from a source named in its ``source``
field (repository@commit:path and table, or URL and table), with the model's dimensions, the run's
degrees, batch, recomputation, precision and the throughput as published. Nothing here is fitted or
estimated; where a source leaves something out the row says so in ``notes`` (and the validator leaves
that choice to the planner). ``benchmarks/cost_model_validation.py --set modern`` prices the rows.

The measured step time is derived from the published metric (``ModernRun.measured_step_s``):

* ``step_s``: the source publishes seconds per step (NVIDIA's DGX Cloud benchmarking recipes);
* ``tokens_per_s_per_gpu``: step = global_batch * seq / (tokens/s/GPU * GPUs);
* ``tflops_per_gpu``: step = model FLOPs per step / (TFLOP/s/GPU * GPUs), model FLOPs counted as NeMo and
  the DGX Cloud recipes count them (``model_flops_per_sequence``): 6 * N * s + 12 * l * s^2 * h per
  sequence, N the weights of every matrix multiply (attention, MLP and output head, not the input
  embedding), no causal discount, no recomputation. It reproduces the recipes' published counts
  (GPT-3 175B at seq 2048: 2.205e15 against their 2.20e15; Llama 3.1 405B at seq 8192: 2.15e16 against
  2.17e16). The Llama 3 paper, the one source priced this way, does not state its count.

``device`` is the autopar catalog name (cost_models/hardware.py). ``device_variant`` is set where the
GPUs differ from the catalog part of that name (torchtitan's Grand Teton H100s: 96 GB HBM2e, 2.4 TB/s,
500 W instead of the SXM5 part's 80 GB HBM3, 3.35 TB/s, 700 W); such rows are priced on the catalog
constants with the published capacity, and reported apart. FP8 rows are priced with autopar's float8 linears
(``--fix fp8=tensorwise``, the current scaling their frameworks ran). MoE rows (``experts``, ``top_k``) count a
token's ``top_k`` experts and the router in N (the FLOPs a token meets), and are priced with autopar's MoE family
at capacity factor 1 (``cost_model_validation.moe_overrides``).
"""

from __future__ import annotations

from dataclasses import dataclass

DGXC = "NVIDIA/dgxc-benchmarking"
DGXC_V24_11 = f"{DGXC}@35a9aecc8d5b17d99d80f52f38c75ade0dbab7ae"  # tag v24.11.1
DGXC_V25_01 = f"{DGXC}@143b90dd91f9be958fed4773ae95d941a3356a82"  # tag v25.01
DGXC_V25_03 = f"{DGXC}@1b9bb6b3cfea881fc4997ac111e695e52ae901aa"  # tag v25.03
TORCHTITAN_2412 = ("pytorch/torchtitan@820504e20d1149fbf0b98c567af24c4b0433b22d:"
                   "benchmarks/llama3_h100_202412_torchtitan.md")
TORCHTITAN_2506 = ("pytorch/torchtitan@2887250bbd9103d0bc997ea2efb3a525b5e5dbc0:"
                   "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md")
TORCHTITAN_H200 = ("pytorch/torchtitan@4a61bd87d3c7e92bcfeb5d5464d9e6bd13ef440a:"
                   "benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md")
MEGATRON_BRIDGE = "NVIDIA-NeMo/Megatron-Bridge@00b7660be0254ac6f95f44164ddd0c3e9cc798ed:docs/performance-summary.md"
LLAMA3_PAPER = ("Dubey et al., 'The Llama 3 Herd of Models', arXiv:2407.21783 (2024), Table 4; figures as "
                "tabulated at https://glennklockwood.com/garden/llama-3.1")

GATED_MLPS = ("swiglu", "gated-gelu")
GRAND_TETON_H100 = "Grand Teton H100: 96 GB HBM2e, 2.4 TB/s, 500 W power limit (torchtitan's own note)"


@dataclass(frozen=True)
class ModernRun:
    """One published training run, its configuration and its throughput, with the source of each figure."""

    name: str
    """Short id, unique in the set."""
    model: str
    """The model as the source names it."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    """Key/value heads (== heads: multi-head attention)."""
    ffn_hidden: int
    """MLP inner width as published."""
    vocab: int
    """Vocabulary as the run padded it."""
    mlp: str
    """"swiglu" or "gated-gelu" (three matrices), "gelu" or "squared-relu" (two)."""
    norm: str
    """"rmsnorm" or "layernorm"."""
    seq: int
    global_batch: int
    micro_batch: int
    """Sequences per microbatch on each data-parallel rank (0: not published)."""
    gpus: int
    device: str
    """autopar catalog name: "H100", "H200" or "B200"."""
    tp: int
    pp: int
    vp: int
    """Model chunks per pipeline stage (1: no interleaving)."""
    cp: int
    ep: int
    data_parallel: str
    """How data parallelism ran: "ddp", "distributed-optimizer" (ZeRO-1 sharded optimizer state) or "fsdp"
    (parameters, gradients and optimizer state sharded over the whole data-parallel group)."""
    recompute: str
    """An autopar checkpointing mode (``plan.CHECKPOINTING``: NeMo's and Megatron-LM's "selective" is
    ``core_attention``, MaxText's ``save_dot_except_mlpwi``; torchtitan's per-op "selective" is priced as
    ``selective``, which keeps every linear layer's output where torchtitan's keeps every other ``mm``), or ""
    where the source does not say; ``recompute_as_published`` quotes it."""
    recompute_as_published: str
    precision: str
    """"bf16" or "fp8"."""
    metric: str
    """"step_s", "tokens_per_s_per_gpu" or "tflops_per_gpu"."""
    published: float
    """The figure as published, in ``metric``'s unit."""
    source: str
    notes: str = ""
    published_mfu: float | None = None
    """MFU as published, where it is (a check on the dims: ``implied_mfu`` should match it)."""
    experts: int = 0
    """Experts a layer of an MoE model (0: dense), each an MLP of ``ffn_hidden``."""
    top_k: int = 0
    """Experts each token is routed to (MoE)."""
    head_dim: int = 0
    """Width of an attention head where it is not ``hidden / heads`` (0: it is)."""
    device_variant: str = ""
    """Where the GPUs differ from the catalog part named ``device``."""
    device_memory_gb: float | None = None
    """Published HBM capacity where it differs from the catalog's."""
    sequence_parallel: bool = True
    """Whether tensor parallelism also split the norms and the residual stream on the sequence."""
    cp_attention: str = ""
    """How context parallelism attended, where the source says: "allgather" (keys and values gathered) or
    "ring" (exchanged block by block); "" leaves it to the planner."""
    reduce_dtype: str = ""
    """Dtype of the data-parallel gradient reductions where the source states it ("bf16": NeMo's
    ``optim.grad_sync_dtype: bf16``, Megatron-Core's ``grad_reduce_in_fp32 = False``); "" leaves autopar's
    default (fp32, Megatron-Core's ``grad_reduce_in_fp32`` under bf16)."""
    master_dtype: str = ""
    """Dtype of the master weights and optimizer state where the source keeps them narrower than fp32 ("bf16":
    NeMo's ``optim.dtype: bf16`` for ``distributed_fused_adam``, Apex ``DistributedFusedAdam(dtype=bf16)``,
    whose parameter shard and moments are bf16); "" leaves autopar's default (fp32 masters and moments)."""
    schedule: str = ""
    """The pipeline schedule where it differs from Megatron-Core's (1F1B, interleaved where ``vp`` > 1):
    "interleaved" with its chunks unstated (the Llama 3 paper's modified interleaved 1F1B)."""

    @property
    def pipeline_schedule(self) -> str:
        """The schedule the run used, as an autopar name ("" without a pipeline)."""
        if self.pp == 1:
            return ""
        return self.schedule or ("interleaved" if self.vp > 1 else "1f1b")

    @property
    def moe(self) -> str:
        """The routing in words ("" for a dense model)."""
        return f"{self.experts} experts, top-{self.top_k}" if self.experts else ""

    @property
    def dp(self) -> int:
        """Data-parallel degree: what the GPUs leave after tensor, pipeline and context parallelism."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def measured_step_s(self) -> float:
        """Seconds per step, derived from the published metric as the module docstring states."""
        if self.metric == "step_s":
            return self.published
        if self.metric == "tokens_per_s_per_gpu":
            return self.global_batch * self.seq / (self.published * self.gpus)
        if self.metric == "tflops_per_gpu":
            return self.global_batch * model_flops_per_sequence(self) / (self.published * 1e12 * self.gpus)
        raise ValueError(f"run {self.name}: unknown metric {self.metric!r}")

    def implied_tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU implied by ``measured_step_s`` under NeMo's FLOP count."""
        return self.global_batch * model_flops_per_sequence(self) / (self.measured_step_s * self.gpus) / 1e12


def model_flops_per_sequence(run: ModernRun) -> float:
    """NeMo's model FLOPs for one sequence (forward and backward): 6 N s + 12 l s^2 h (module docstring)."""
    return 6 * matmul_weights(run) * run.seq + 12 * run.layers * run.seq ** 2 * run.hidden


def matmul_weights(run: ModernRun) -> int:
    """Weights of every matrix multiply a token meets: attention (q, k, v, o), MLP (an MoE's ``top_k``
    experts and its router), output head; not the input embedding."""
    head_dim = run.head_dim or run.hidden // run.heads
    attention = 2 * run.hidden * run.heads * head_dim + 2 * run.hidden * run.kv_heads * head_dim
    mlp = (3 if run.mlp in GATED_MLPS else 2) * run.hidden * run.ffn_hidden
    if run.experts:
        mlp = mlp * run.top_k + run.hidden * run.experts
    return run.layers * (attention + mlp) + run.hidden * run.vocab


# ---- model dims, each from the run's own configuration ---------------------------------------------------

# GPT-3 175B as NeMo ran it (DGXC v24.11.1 nemo_megatron/gpt3_175b_hydra.yaml: 96 layers, hidden 12288,
# 96 heads, ffn 49152, GPT-2 BPE vocabulary 50257 padded to a multiple of 128 x TP 4 = 50688).
GPT3_175B = dict(model="GPT-3 175B", layers=96, hidden=12288, heads=96, kv_heads=96, ffn_hidden=49152,
                 vocab=50688, mlp="gelu", norm="layernorm")
# Nemotron-4 (DGXC v24.11.1 nemotron/nemotron4-15b-synth.yaml, nemotron4-340b-synth.yaml: ffn_hidden_size
# 24576 and 73728, "activation: squared-relu" (two matrices), "normalization: layernorm1p" (LayerNorm with
# a zero-centred scale), "bias: false", RoPE with "rotary_percentage: 0.5" (priced as rotating whole heads),
# 8 query groups, 256k SentencePiece vocabulary nemotron_2_256k.model).
NEMOTRON4_15B = dict(model="Nemotron-4 15B", layers=32, hidden=6144, heads=48, kv_heads=8, ffn_hidden=24576,
                     vocab=256000, mlp="squared-relu", norm="layernorm")
NEMOTRON4_340B = dict(model="Nemotron-4 340B", layers=96, hidden=18432, heads=96, kv_heads=8, ffn_hidden=73728,
                      vocab=256000, mlp="squared-relu", norm="layernorm")
# Llama 3 / 3.1 (Llama 3 paper Table 3; vocabulary 128256) and Llama 2 70B (vocabulary 32000).
LLAMA3_8B = dict(model="Llama 3.1 8B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                 vocab=128256, mlp="swiglu", norm="rmsnorm")
LLAMA3_70B = dict(model="Llama 3.1 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672,
                  vocab=128256, mlp="swiglu", norm="rmsnorm")
LLAMA3_405B = dict(model="Llama 3.1 405B", layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                   vocab=128256, mlp="swiglu", norm="rmsnorm")
LLAMA2_70B = dict(model="Llama 2 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672,
                  vocab=32000, mlp="swiglu", norm="rmsnorm")
# MoE. Grok-1: xai-org/grok-1 run.py (64 layers, emb 48 x 128, 48 query and 8 kv
# heads, vocabulary 128 x 1024, 8 experts, 2 selected) and model.py (gated GELU expert of width
# ffn_size(6144, widening_factor 8) = 8 x 6144 x 2/3 = 32768). GPT-OSS 120B: huggingface.co/openai/gpt-oss-120b
# config.json (36 layers, hidden 2880, 64 query heads of 64 and 8 kv heads, experts of width 2880, 128
# experts, 4 per token, vocabulary 201088; alternate layers attend over a 128-token sliding window).
GROK1 = dict(model="Grok-1 314B (MoE)", layers=64, hidden=6144, heads=48, kv_heads=8, ffn_hidden=32768,
             vocab=131072, mlp="gated-gelu", norm="rmsnorm", experts=8, top_k=2)
GPT_OSS_RECIPES = ("NVIDIA-NeMo/Megatron-Bridge@00b7660be0254ac6f95f44164ddd0c3e9cc798ed (the table's commit): "
                   "src/megatron/bridge/recipes/gpt_oss/gpt_oss.py (pretraining: distributed_fused_adam, "
                   "use_distributed_optimizer=True) and scripts/performance/configs/gpt_oss/gpt_oss_llm_pretrain.py "
                   "(set_gpt_oss_common_configs: grad_reduce_in_fp32 = False for mixed_precision and ddp, i.e. "
                   "gradients reduced in bf16; moe_router_force_load_balancing=True)")
LLAMA_RECIPES = ("NVIDIA-NeMo/Megatron-Bridge, as stored at later commits than the table's: "
                 "src/megatron/bridge/recipes/llama/llama3.py@0d5f5558 (llama3_8b_pretrain_config and "
                 "llama31_405b_pretrain_config: use_distributed_optimizer = True, recompute_granularity = None) and "
                 "scripts/performance/configs/llama/llama3_llm_pretrain.py@2a0d46e2 (set_llama3_common_configs: "
                 "grad_reduce_in_fp32 = False for mixed_precision and ddp); the B200 FP8-CS presets set only the "
                 "degrees, batch sizes and CUDA graphs (scripts/performance/configs/llama/"
                 "llama3_workload_base_configs.py, llama31_workload_base_configs.py)")
TP_COMM_OVERLAP = ("Megatron-Core overlaps the tensor-parallel all_gathers and reduce_scatters with the GEMMs here "
                   "(NVIDIA-NeMo/Megatron-Bridge, as stored: src/megatron/bridge/recipes/llama/llama3.py's "
                   "llama3_70b_pretrain_config and llama31_405b_pretrain_config set CommOverlapConfig(tp_comm_overlap="
                   "True) with userbuffers configs, which scripts/performance/configs/llama/llama3_llm_pretrain.py"
                   "@2a0d46e2 keeps on H100, with the FP8 userbuffers config for FP8); autopar's runtime runs them on "
                   "the critical path, and prices them so")
GPT_OSS_120B = dict(model="GPT-OSS 120B (MoE)", layers=36, hidden=2880, heads=64, kv_heads=8, head_dim=64,
                    ffn_hidden=2880, vocab=201088, mlp="swiglu", norm="rmsnorm", experts=128, top_k=4)


def _nemo_h100(run_name: str, dims: dict, **fields: object) -> ModernRun:
    """A NeMo run from NVIDIA's DGX Cloud benchmarking recipes on DGX H100 (BF16, seconds per step)."""
    defaults = dict(device="H100", vp=1, cp=1, ep=1, data_parallel="distributed-optimizer",
                    precision="bf16", metric="step_s")
    return ModernRun(name=run_name, **dims, **{**defaults, **fields})


def _bridge_fp8(run_name: str, dims: dict, system: str, row: str, **fields: object) -> ModernRun:
    """A Megatron-Bridge FP8-CS run of the 25.11 performance summary on DGX-``system`` (tokens/s/GPU), ``row``
    of its table, as the Llama recipes configure it (``LLAMA_RECIPES``): the distributed optimizer, bf16
    gradient reductions, no recomputation."""
    defaults = dict(device=system, seq=8192, ep=1, data_parallel="distributed-optimizer", recompute="none",
                    recompute_as_published="none (the recipe's recompute_granularity=None)", precision="fp8",
                    metric="tokens_per_s_per_gpu", reduce_dtype="bf16",
                    source=f"{MEGATRON_BRIDGE}, '25.11 NeMo Container', 'System: DGX-{system}', row '{row}' (FP8-CS)",
                    notes=f"the distributed optimizer, bf16 gradient reductions and no recomputation: {LLAMA_RECIPES}")
    return ModernRun(name=run_name, **dims, **{**defaults, **fields})


MODERN_RUNS: tuple[ModernRun, ...] = (
    # ---- NeMo / Megatron-Core on DGX H100, BF16, seconds per step as published -----------------------
    _nemo_h100("gpt3-175b/128xH100", GPT3_175B, seq=2048, global_batch=256, micro_batch=1, gpus=128,
               tp=4, pp=8, vp=12, recompute="none", recompute_as_published="activations_checkpoint_granularity: null",
               published=8.91, published_mfu=0.4993, reduce_dtype="bf16",
               source=f"{DGXC_V24_11}:nemo_megatron/README_175b.md, table 'NeMo Megatron 24.11 BF16 (TP=4,PP=8, "
                      "MBS=1, VP=12, SEQ=2048)', column 128x H100 (GBS=256); config nemo_megatron/gpt3_175b_hydra.yaml",
               notes="distributed_fused_adam (ZeRO-1) with overlapped grad and param sync, grad_sync_dtype: bf16; "
                     "sequence parallel; "
                     "TP communication overlap (ub_tp_comm_overlap)"),
    _nemo_h100("gpt3-175b/512xH100", GPT3_175B, seq=2048, global_batch=1024, micro_batch=1, gpus=512,
               tp=4, pp=8, vp=12, recompute="none", recompute_as_published="activations_checkpoint_granularity: null",
               published=9.09, published_mfu=0.4894, reduce_dtype="bf16",
               source=f"{DGXC_V24_11}:nemo_megatron/README_175b.md, same table, column 512x H100 (GBS=1024)",
               notes="as gpt3-175b/128xH100, weak-scaled"),
    _nemo_h100("nemotron4-15b/16xH100", NEMOTRON4_15B, seq=4096, global_batch=64, micro_batch=4, gpus=16,
               tp=4, pp=1, recompute="none", recompute_as_published="activations_checkpoint_granularity: null",
               published=2.83, published_mfu=0.6210,
               source=f"{DGXC_V25_01}:nemotron/README_15b.md, table 'Nemotron4 15b 24.11 BF16 (TP=4, PP=1, MBS=4, "
                      "GA=4)', column 16x H100 (GBS=64); config v24.11.1 nemotron/nemotron4-15b-synth.yaml",
               notes="distributed_fused_adam; sequence parallel; ub_tp_comm_overlap: True"),
    _nemo_h100("nemotron4-15b/256xH100", NEMOTRON4_15B, seq=4096, global_batch=1024, micro_batch=4, gpus=256,
               tp=4, pp=1, recompute="none", recompute_as_published="activations_checkpoint_granularity: null",
               published=2.88, published_mfu=0.6102,
               source=f"{DGXC_V25_01}:nemotron/README_15b.md, same table, column 256x H100 (GBS=1024)",
               notes="as nemotron4-15b/16xH100, weak-scaled"),
    _nemo_h100("nemotron4-340b/128xH100", NEMOTRON4_340B, seq=4096, global_batch=32, micro_batch=1, gpus=128,
               tp=8, pp=8, vp=12, recompute="core_attention",
               recompute_as_published="activations_checkpoint_granularity: selective", published=4.61,
               published_mfu=0.5538, reduce_dtype="bf16", master_dtype="bf16",
               source=f"{DGXC_V24_11}:nemotron/README_340b.md, table 'Nemotron4 340b 24.11 BF16 (TP=8, PP=8, MBS=1, "
                      "GA=16, VP=12)', column 128x H100 (GBS=32); config nemotron/nemotron4-340b-synth.yaml",
               notes="distributed_fused_adam with grad_sync_dtype: bf16 and its state in bf16 (optim.dtype: bf16: "
                     "pinned as master_dtype=bf16); sequence parallel; no TP communication overlap"),
    _nemo_h100("nemotron4-340b/1024xH100", NEMOTRON4_340B, seq=4096, global_batch=256, micro_batch=1, gpus=1024,
               tp=8, pp=8, vp=12, recompute="core_attention",
               recompute_as_published="activations_checkpoint_granularity: selective", published=4.73,
               published_mfu=0.5398, reduce_dtype="bf16", master_dtype="bf16",
               source=f"{DGXC_V24_11}:nemotron/README_340b.md, same table, column 1024x H100 (GBS=256)",
               notes="as nemotron4-340b/128xH100, weak-scaled"),
    _nemo_h100("llama3.1-8b-cp2/8xH100", LLAMA3_8B, seq=8192, global_batch=128, micro_batch=1, gpus=8,
               tp=1, pp=1, cp=2, recompute="", recompute_as_published="not stated", published=12.91,
               published_mfu=0.5937,
               source=f"{DGXC_V24_11}:llama3.1/README_8b.md, table 'Llama 3.1 8b 24.09 BF16 (TP=1, PP=1, CP=2, MBS=1, "
                      "GA=32)', column 8x H100 (GBS=128)"),
    _nemo_h100("llama3.1-70b-cp2/64xH100", LLAMA3_70B, seq=8192, global_batch=128, micro_batch=1, gpus=64,
               tp=4, pp=4, vp=5, cp=2, recompute="", recompute_as_published="not stated", published=14.72,
               published_mfu=0.5410,
               source=f"{DGXC_V24_11}:llama3.1/README_70b.md, table 'Llama 3.1 70b 24.09 BF16 (TP=4, PP=4, CP=2, VP=5, "
                      "MBS=1, GA=64)', column 64x H100 (GBS=128)"),
    _nemo_h100("llama3.1-405b-cp2/576xH100", LLAMA3_405B, seq=8192, global_batch=252, micro_batch=1, gpus=576,
               tp=8, pp=9, vp=7, cp=2, recompute="", recompute_as_published="not stated", published=17.20,
               published_mfu=0.5578,
               source=f"{DGXC_V24_11}:llama3.1/README_405b.md, table 'Llama 3.1 405b 24.09 BF16 (TP=8, PP=9, CP=2, "
                      "VP=7, MBS=1, GA=63)', column 576x H100 (126 layers, GBS=252)"),
    _nemo_h100("grok1-314b/512xH100", GROK1, seq=8192, global_batch=1024, micro_batch=1, gpus=512,
               tp=4, pp=8, vp=8, cp=2, ep=8, recompute="", recompute_as_published="not stated", published=20.83,
               published_mfu=0.415,
               source=f"{DGXC_V24_11}:grok1/README_314b.md, configuration table row 512 GPUs and table "
                      "'Grok 1 314b Dev BF16', column 512 H100",
               notes="MoE; dims from the public Grok-1 release (see GROK1), not from the recipe"),
    # ---- JAX MaxText on DGX H100, FSDP only, BF16, seconds per step as published -----------------------
    ModernRun(name="maxtext-llama2-70b-fsdp/64xH100", **LLAMA2_70B, seq=4096, global_batch=128, micro_batch=2,
              gpus=64, device="H100", tp=1, pp=1, vp=1, cp=1, ep=1, data_parallel="fsdp",
              recompute="save_dot_except_mlpwi",
              recompute_as_published="remat_policy save_dot_except_mlpwi (the q, k, v and output projections' and "
                                     "the MLP's output projection's outputs saved, the rest recomputed)",
              precision="bf16", metric="step_s", published=6.999, published_mfu=0.5259, sequence_parallel=False,
              source=f"{DGXC_V25_01}:maxtext/README_70b.md, table 'Maxtext LLama2 70b BF16 (FSDP+DP MBS=2)', column "
                     "64x H100 (FSDP=64 GBS=128); config maxtext/configure.sh (max_target_length=4096)",
              notes="JAX/XLA, cuDNN flash attention; FSDP over all 64 GPUs (ici 8 x dcn 8)"),
    ModernRun(name="maxtext-llama3-70b-fsdp/128xH100", **LLAMA3_70B, seq=8192, global_batch=256, micro_batch=2,
              gpus=128, device="H100", tp=1, pp=1, vp=1, cp=1, ep=1, data_parallel="fsdp", recompute="full",
              recompute_as_published="remat_policy save_qkv_proj (all recomputed but the q/k/v projections: "
                                     "about 90% of the layer's matmul FLOPs)",
              precision="bf16", metric="step_s", published=15.563, published_mfu=0.5120, sequence_parallel=False,
              source=f"{DGXC_V25_03}:maxtext/README_70b.md, table 'Maxtext Llama3 70b BF16 (FSDP+DP MBS=2)', column "
                     "128x H100 (FSDP=128 GBS=256); config maxtext/configure.sh (max_target_length=8192)",
              notes="JAX/XLA, cuDNN flash attention; FSDP over all 128 GPUs"),
    # ---- torchtitan (PyTorch FSDP2 / TP) on Grand Teton H100 (a device variant), BF16, tokens/s/GPU ------
    ModernRun(name="torchtitan-llama3.1-8b-fsdp/8xH100", **LLAMA3_8B, seq=8192, global_batch=16, micro_batch=2,
              gpus=8, device="H100", tp=1, pp=1, vp=1, cp=1, ep=1, data_parallel="fsdp", recompute="selective",
              recompute_as_published="selective activation checkpointing (per-op policy: matmul outputs saved "
                                      "every other one)",
              precision="bf16", metric="tokens_per_s_per_gpu", published=5762, sequence_parallel=False,
              device_variant=GRAND_TETON_H100, device_memory_gb=96,
              source=f"{TORCHTITAN_2412}, Table 1 (1D FSDP, Llama 3.1 8B, 8 GPUs, local batch 2), row 'FSDP' "
                     "(eager, no Float8); seq_len 8192 from train_configs/llama3_8b.toml at torchtitan 9dec370"),
    ModernRun(name="torchtitan-llama3.1-8b-fsdp/128xH100", **LLAMA3_8B, seq=8192, global_batch=256, micro_batch=2,
              gpus=128, device="H100", tp=1, pp=1, vp=1, cp=1, ep=1, data_parallel="fsdp", recompute="selective",
              recompute_as_published="selective activation checkpointing (per-op policy)",
              precision="bf16", metric="tokens_per_s_per_gpu", published=5605, sequence_parallel=False,
              device_variant=GRAND_TETON_H100, device_memory_gb=96,
              source=f"{TORCHTITAN_2412}, Table 3 (1D FSDP, Llama 3.1 8B, 128 GPUs, local batch 2), row 'FSDP'"),
    ModernRun(name="torchtitan-llama3.1-8b-fsdp-tp/64xH100", **LLAMA3_8B, seq=8192, global_batch=96, micro_batch=12,
              gpus=64, device="H100", tp=8, pp=1, vp=1, cp=1, ep=1, data_parallel="fsdp", recompute="selective",
              recompute_as_published="per op SAC", precision="bf16", metric="tokens_per_s_per_gpu", published=4378,
              device_variant=GRAND_TETON_H100, device_memory_gb=96,
              source=f"{TORCHTITAN_2506}, table 'Llama3 8b on 64 H100s with FSDP=8, TP=8, torch.compile, per op SAC, "
                     "local batch size 12', row 'None (bfloat16)', column 'Vanilla TP tokens/sec'",
              notes="torch.compile; global batch = local batch 12 x FSDP 8"),
    ModernRun(name="torchtitan-llama3.1-70b-fsdp-tp/256xH100", **LLAMA3_70B, seq=8192, global_batch=512,
              micro_batch=16, gpus=256, device="H100", tp=8, pp=1, vp=1, cp=1, ep=1, data_parallel="fsdp",
              recompute="full", recompute_as_published="full AC", precision="bf16", metric="tokens_per_s_per_gpu",
              published=597.3, device_variant=GRAND_TETON_H100, device_memory_gb=96,
              source=f"{TORCHTITAN_2506}, table 'Llama3 70b on 256 H100s with FSDP=32, TP=8, torch.compile, full AC, "
                     "local batch size 16', row 'None (bfloat16)', column 'Vanilla TP tokens/sec'",
              notes="torch.compile; global batch = local batch 16 x FSDP 32"),
    # ---- Llama 3 405B pre-training at Meta (H100 SXM 80 GB HBM3, 700 W), BF16, TFLOP/s per GPU --------
    ModernRun(name="llama3-405b/8192xH100", **LLAMA3_405B, seq=8192, global_batch=2048, micro_batch=0, gpus=8192,
              device="H100", tp=8, pp=16, vp=1, cp=1, ep=1, data_parallel="fsdp", recompute="",
              recompute_as_published="not stated", precision="bf16", metric="tflops_per_gpu", published=430,
              published_mfu=0.43, source=LLAMA3_PAPER + ", row 8,192 GPUs (TP 8, CP 1, PP 16, DP 64, 16M tokens/batch)",
              notes="global batch = 16M tokens / 8192; the paper's FLOP count is not stated (NeMo's is used); "
                    "its pipeline schedule is a modified interleaved 1F1B with an unstated number of chunks; "
                    "microbatch, recomputation and the chunks are left to the planner", schedule="interleaved"),
    ModernRun(name="llama3-405b/16384xH100", **LLAMA3_405B, seq=8192, global_batch=2048, micro_batch=0, gpus=16384,
              device="H100", tp=8, pp=16, vp=1, cp=1, ep=1, data_parallel="fsdp", recompute="",
              recompute_as_published="not stated", precision="bf16", metric="tflops_per_gpu", published=400,
              published_mfu=0.41,
              source=LLAMA3_PAPER + ", row 16,384 GPUs (TP 8, CP 1, PP 16, DP 128, 16M tokens/batch)",
              notes="as llama3-405b/8192xH100", schedule="interleaved"),
    ModernRun(name="llama3-405b-long-cp16/16384xH100", **LLAMA3_405B, seq=131072, global_batch=128, micro_batch=0,
              gpus=16384, device="H100", tp=8, pp=16, vp=1, cp=16, ep=1, data_parallel="fsdp", recompute="",
              cp_attention="allgather",
              recompute_as_published="not stated", precision="bf16", metric="tflops_per_gpu", published=380,
              published_mfu=0.38,
              source=LLAMA3_PAPER + ", row 16,384 GPUs (TP 8, CP 16, PP 16, DP 8, seq 131072, 16M tokens/batch)",
              notes="long-context stage; global batch = 16M tokens / 131072; the paper's context parallelism "
                    "all-gathers the keys and values (§3.3.2)", schedule="interleaved"),
    # ---- MoE runs and FP8 runs (float8 linears, fp8=tensorwise) ---------------------------------------------
    ModernRun(name="gpt-oss-120b/64xH100", **GPT_OSS_120B, seq=4096, global_batch=512, micro_batch=4, gpus=64,
              device="H100", tp=1, pp=4, vp=1, cp=1, ep=8, data_parallel="distributed-optimizer", recompute="",
              recompute_as_published="not stated", precision="bf16", metric="tokens_per_s_per_gpu", published=5630,
              reduce_dtype="bf16",
              source=f"{MEGATRON_BRIDGE}, '25.11 NeMo Container', 'System: DGX-H100', row 'GPT OSS 120B' (BF16)",
              notes="MoE; dims from the public gpt-oss-120b config.json (see GPT_OSS_120B), not from the table; "
                    "recomputation left free: the H100 preset at the table's commit (scripts/performance/configs/"
                    "gpt_oss/gpt_oss_workload_base_configs.py) recomputes recompute_modules=['layernorm', 'moe_act'] "
                    "but at micro_batch_size 1, not the table's 4, so it is not the published run's; "
                    "priced with 48 heads of 60 (the MoE family's heads split the 2,880 residual) and full "
                    f"attention in every layer; the distributed optimizer, bf16 gradient reductions and balanced "
                    f"routing: {GPT_OSS_RECIPES}"),
    ModernRun(name="gpt-oss-120b/64xB200", **GPT_OSS_120B, seq=4096, global_batch=512, micro_batch=4, gpus=64,
              device="B200", tp=1, pp=1, vp=1, cp=1, ep=8, data_parallel="distributed-optimizer", recompute="",
              recompute_as_published="not stated", precision="bf16", metric="tokens_per_s_per_gpu", published=8213,
              reduce_dtype="bf16",
              source=f"{MEGATRON_BRIDGE}, '25.11 NeMo Container', 'System: DGX-B200', row 'GPT OSS 120B' (BF16)",
              notes="MoE; dims from the public gpt-oss-120b config.json (see GPT_OSS_120B), not from the table; "
                    "priced with 48 heads of 60 (the MoE family's heads split the 2,880 residual) and full "
                    f"attention in every layer; the distributed optimizer, bf16 gradient reductions and balanced "
                    f"routing: {GPT_OSS_RECIPES}; the table also gives 223 model TFLOP/s/GPU (its own count, "
                    "27.2 MFLOP a token against NeMo's formula's 35.9 here) and a DGX-GB200 row of the same model "
                    "(EP 64 inside one NVLink domain, GBS 1280, MBS 1, seq 8192: 15,876 tokens/s/GPU), not "
                    "catalogued since GB200 is no catalog device"),
    _bridge_fp8("llama3-8b-fp8/8xB200", LLAMA3_8B, "B200", "LLAMA3_8B", global_batch=128, micro_batch=2, gpus=8,
                tp=1, pp=1, vp=1, cp=1, published=30624),
    _bridge_fp8("llama3.1-405b-fp8/128xB200", LLAMA3_405B, "B200", "LLAMA3.1_405B", global_batch=64, micro_batch=1,
                gpus=128, tp=4, pp=8, vp=8, cp=2, published=661),
    _bridge_fp8("llama3-8b-fp8/8xH100", LLAMA3_8B, "H100", "LLAMA3_8B", global_batch=128, micro_batch=1, gpus=8,
                tp=1, pp=1, vp=1, cp=1, published=14451, data_parallel="fsdp",
                notes=f"the table's FSDP = 1 (Megatron FSDP); bf16 gradient reductions, no recomputation: "
                      f"{LLAMA_RECIPES}"),
    _bridge_fp8("llama3-70b-fp8/64xH100", LLAMA3_70B, "H100", "LLAMA3_70B", global_batch=128, micro_batch=1, gpus=64,
                tp=4, pp=8, vp=5, cp=1, published=1602,
                notes=f"{TP_COMM_OVERLAP}; the distributed optimizer, bf16 gradient reductions and no recomputation: "
                      f"{LLAMA_RECIPES}"),
    _bridge_fp8("llama3.1-405b-fp8/1024xH100", LLAMA3_405B, "H100", "LLAMA3.1_405B", global_batch=512,
                micro_batch=1, gpus=1024, tp=8, pp=8, vp=8, cp=2, published=292,
                notes=f"{TP_COMM_OVERLAP}; the distributed optimizer, bf16 gradient reductions and no recomputation: "
                      f"{LLAMA_RECIPES}"),
    ModernRun(name="torchtitan-llama3.1-8b-fp8/32xH200", **LLAMA3_8B, seq=8192, global_batch=64, micro_batch=2,
              gpus=32, device="H200", tp=1, pp=1, vp=1, cp=1, ep=1, data_parallel="fsdp", recompute="selective",
              recompute_as_published="not in the command; the config it names, llama3_8b.toml at torchtitan "
                                      "e7c0cae: activation_checkpoint mode 'selective', selective_ac_option 'op'",
              precision="fp8",
              metric="tokens_per_s_per_gpu", published=10938, sequence_parallel=False,
              source=f"{TORCHTITAN_H200}, results table, row NUM_NODES 4",
              notes="Float8 linears with float8 FSDP all-gather, torch.compile; the op policy's save list "
                    "(parallelize_llama.py at e7c0cae) holds aten.mm, not the float8 linears' _scaled_mm, so every "
                    "linear layer's forward runs again in backward, which autopar's selective (keeping them) does "
                    "not price"),
)
