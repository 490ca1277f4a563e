"""Validate the cost model against published training runs (issue 3).

Prices every row of Megatron-LM's Table 1 (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC21; copied with its source in
../shared/reference/published-runs.md) with the published degrees pinned through the public API
(``tp``, ``pp``, ``dp``, ``microbatch_size``, full recomputation, 1F1B or interleaved schedule), and
compares autopar's predicted step time with the one the paper measured. The paper reports TFLOP/s
per GPU counting recomputation, F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per step, so the measured
step time is F / (TFLOP/s x GPUs).

The model is the built-in ``gpt-megatron`` preset (GPT with unfused attention, vocabulary 51,200,
sequence 2,048) at each row's size; the cluster is ``Nx8xA100-80GB`` with the catalog's A100
constants (cost_models/hardware.py: 312 TFLOP/s BF16, 2,039 GB/s HBM, NVLink and HDR InfiniBand
figures with their sources). Nothing here is fitted to the rows.

It also runs the paper's (PP, TP) sweep for a 162B model on 64 GPUs (its Figure 13: the best split is
(8, 8), bad splits lose up to 2x), pricing each split with the planner.

``--set modern`` prices instead the published runs on H100, H200 and B200 of ``modern_runs.py`` (NeMo /
Megatron-Core, MaxText, torchtitan, the Llama 3 paper), each with its published degrees pinned the same
way (``tp``, ``pp``, ``dp``, ``cp``, ``ep``, ``microbatch_size``, recomputation, schedule and chunks, the
ZeRO stage of its data parallelism, sequence parallelism), on ``Nx8x<device>`` with the catalog's constants
for that device. A row the planner refuses (context or expert parallelism, no plan fits) is recorded with
autopar's own message. FP8 rows are priced with float8 linears (``fp8=tensorwise``: NeMo's FP8 current scaling,
"FP8-CS", and torchtitan's tensorwise float8 are that recipe). MoE rows are priced
with the MoE family (token-permutation dispatch, ``moe_overrides``) at capacity factor 1: the balanced
routing Megatron-Core's dropless dispatcher spends on average.
Where the published configuration is refused, the closest accepted one is priced (a mode recomputing
more, then the next lower ZeRO stage) and the row lists the refusals.

    python benchmarks/cost_model_validation.py            # every row (about 10 minutes on 2 cores)
    python benchmarks/cost_model_validation.py --rows 3   # the first 3 rows
    python benchmarks/cost_model_validation.py --set modern [--only TEXT ...]   # about 2 minutes
    python benchmarks/cost_model_validation.py --set modern --only nemotron   # the runs whose name contains it
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import autopar
from autopar.core.errors import BadInputError, NoFeasiblePlanError
from autopar.core.plan import CHECKPOINTING
from autopar.cost_models.hardware import DEVICES
from autopar.models import ModelBundle, build_model
from modern_runs import MODERN_RUNS, ModernRun, model_flops_per_sequence

SEQ, VOCAB = 2048, 51200
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class PublishedRun:
    params_b: float
    layers: int
    hidden: int
    heads: int
    gpus: int
    tp: int
    pp: int
    dp: int
    microbatch: int
    global_batch: int
    chunks: int  # v, interleaved model chunks per device (1: plain 1F1B)
    tflops_per_gpu: float

    @property
    def measured_step_s(self) -> float:
        s, l, h, b = SEQ, self.layers, self.hidden, self.global_batch
        flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))
        return flops / (self.tflops_per_gpu * 1e12 * self.gpus)


MEGATRON_SC21_TABLE1 = [
    PublishedRun(1.7, 24, 2304, 24, 32, 1, 1, 32, 16, 512, 1, 137),
    PublishedRun(3.6, 30, 3072, 32, 64, 2, 1, 32, 16, 512, 1, 138),
    PublishedRun(7.5, 36, 4096, 32, 128, 4, 1, 32, 16, 512, 1, 142),
    PublishedRun(18.4, 40, 6144, 48, 256, 8, 1, 32, 8, 1024, 1, 135),
    PublishedRun(39.1, 48, 8192, 64, 512, 8, 2, 32, 4, 1536, 1, 138),
    PublishedRun(76.1, 60, 10240, 80, 1024, 8, 4, 32, 2, 1792, 3, 140),
    PublishedRun(145.6, 80, 12288, 96, 1536, 8, 8, 24, 2, 2304, 2, 148),
    PublishedRun(310.1, 96, 16384, 128, 1920, 8, 16, 15, 1, 2160, 2, 155),
    PublishedRun(529.6, 105, 20480, 128, 2520, 8, 35, 9, 1, 2520, 3, 163),
    PublishedRun(1008.0, 128, 25600, 160, 3072, 8, 64, 6, 1, 3072, 1, 163),
]


def constraints_for(run: PublishedRun) -> dict[str, object]:
    # the 2021 runs: plain data parallelism, fp16 mixed precision with fp16 gradient all_reduces (Megatron-LM
    # reduced in fp32 only under bf16, its accumulate_allreduce_grads_in_fp32)
    fixed: dict[str, object] = {"tp": run.tp, "pp": run.pp, "dp": run.dp, "microbatch_size": run.microbatch,
                                "checkpointing": "full", "fsdp": 0, "dtype": "fp16", "reduce_dtype": "fp16"}
    if run.tp > 1:  # nor sequence parallelism (Korthikanti et al. 2022 came a year later): norms whole on tp
        fixed["sp"] = 0
    if run.pp > 1:
        fixed["schedule"] = "interleaved" if run.chunks > 1 else "1f1b"
    if run.chunks > 1:
        fixed["virtual_stages"] = run.chunks
    return fixed


def price(layers: int, hidden: int, heads: int, gpus: int, global_batch: int,
          constraints: dict[str, object]) -> autopar.Plan:
    bundle = build_model("gpt-megatron", global_batch=global_batch,
                         overrides={"layers": layers, "hidden": hidden, "heads": heads})
    return autopar.plan(bundle.model, bundle.example_inputs, f"{gpus // 8}x8xA100-80GB", bundle.loss_fn,
                        example_targets=bundle.example_targets, constraints=constraints)


def validate_rows(runs: list[PublishedRun]) -> list[dict]:
    rows = []
    for run in runs:
        start = time.perf_counter()
        plan = price(run.layers, run.hidden, run.heads, run.gpus, run.global_batch, constraints_for(run))
        p = plan.predicted
        rows.append({**asdict(run), "measured_step_s": run.measured_step_s, "predicted_step_s": p["step_time_s"],
                     "error": p["step_time_s"] / run.measured_step_s - 1, "predicted_mfu": p["mfu"],
                     "compute_s": p["compute_s"], "exposed_comm_s": p["exposed_comm_s"], "bubble_s": p["bubble_s"],
                     "peak_memory_gb": p["peak_memory_bytes"] / 1e9, "plan_wall_s": time.perf_counter() - start})
        _print_row(rows[-1])
    return rows


def _print_row(r: dict) -> None:
    print(f"{r['params_b']:>7.1f}B {r['gpus']:>5} {r['tp']:>3} {r['pp']:>3} {r['dp']:>3} "
          f"{r['measured_step_s']:>9.2f} {r['predicted_step_s']:>10.2f} {r['error'] * 100:>+7.1f}% "
          f"{r['compute_s']:>8.2f} {r['exposed_comm_s']:>7.2f} {r['bubble_s']:>7.2f} {r['peak_memory_gb']:>6.1f} "
          f"{r['plan_wall_s']:>6.1f}", flush=True)


def pp_tp_sweep() -> list[dict]:
    """Figure 13 of the paper: a 162B GPT (32 layers, hidden 20480) on 64 GPUs, batch 32, microbatch 1."""
    out = []
    for pp, tp in ((2, 32), (4, 16), (8, 8), (16, 4), (32, 2)):
        plan = price(32, 20480, 128, 64, 32, {"pp": pp, "tp": tp, "dp": 1, "microbatch_size": 1,
                                               "checkpointing": "full", "schedule": "1f1b"})
        out.append({"pp": pp, "tp": tp, "step_time_s": plan.predicted["step_time_s"],
                    "mfu": plan.predicted["mfu"]})
        print(f"  (pp={pp:>2}, tp={tp:>2}): {plan.predicted['step_time_s']:.2f} s/step, "
              f"MFU {plan.predicted['mfu'] * 100:.1f}%", flush=True)
    return out


def free_search_162b() -> dict:
    """The planner asked freely for the same model, batch and cluster as the sweep."""
    start = time.perf_counter()
    plan = price(32, 20480, 128, 64, 32, {})
    d = plan.degrees
    print(f"  free search: pp={d['pp']} tp={d['tp']} dp={d['dp']} fsdp={d['fsdp']} {plan.pipeline.schedule} "
          f"m={plan.pipeline.microbatches} checkpointing={plan.checkpointing}: "
          f"{plan.predicted['step_time_s']:.2f} s/step, MFU {plan.predicted['mfu'] * 100:.1f}% "
          f"[{time.perf_counter() - start:.0f} s]", flush=True)
    return {"degrees": dict(d), "schedule": plan.pipeline.schedule, "microbatches": plan.pipeline.microbatches,
            "checkpointing": plan.checkpointing, "step_time_s": plan.predicted["step_time_s"],
            "mfu": plan.predicted["mfu"], "plan_wall_s": time.perf_counter() - start}


# ---- the modern set (issue 20) -----------------------------------------------------------------------

#: ZeRO stages to try for each kind of data parallelism, the published one first, then the next lower.
ZERO_STAGES = {"fsdp": (3, 2, 1), "distributed-optimizer": (1, 0), "ddp": (0,)}
#: FSDP inside pipeline stages, as PyTorch's pipelining runs an FSDP stage: ``PipelineStage`` turns off
#: resharding after backward and gradient reduction for every microbatch but the last
#: (``torch/distributed/pipelining/stage.py``, ``set_reshard_after_backward(False)``,
#: ``set_requires_gradient_sync(False)``), so a stage's parameters are gathered once and stay whole for
#: the step and its gradients are reduce-scattered once, after the last microbatch: the traffic and the
#: peak memory of ZeRO-1 (whole compute-dtype parameters and gradients, sharded optimizer state), which
#: is what autopar prices. autopar's own zero=3 inside a pipeline regathers every microbatch.
FSDP_IN_PIPELINE_STAGES = (1, 3, 2)


def zero_stages(run: ModernRun) -> tuple[int, ...]:
    """The ZeRO stages to price ``run`` at, the one that runs as published first."""
    if run.data_parallel == "fsdp" and run.pp > 1:
        return FSDP_IN_PIPELINE_STAGES
    return ZERO_STAGES[run.data_parallel]


def modern_bundle(run: ModernRun) -> ModelBundle:
    """The built-in model closest to ``run``: Llama (RoPE, GQA; its MLP and norm as the run's: SwiGLU or
    Nemotron-4's squared ReLU, RMSNorm or LayerNorm, which ``LlamaConfig`` checks) or GPT (LayerNorm, GELU
    MLP, fused attention), or for an MoE run the MoE family (Llama attention, top-k routed gated experts;
    ``moe_overrides``)."""
    if run.experts:
        return build_model("mixtral-8x7b", global_batch=run.global_batch, overrides=moe_overrides(run))
    if run.mlp == "gelu":
        if run.kv_heads != run.heads:
            raise ValueError(f"run {run.name}: the built-in GPT has no grouped-query attention")
        overrides = {"layers": run.layers, "hidden": run.hidden, "heads": run.heads, "vocab": run.vocab,
                     "seq": run.seq, "mlp_ratio": run.ffn_hidden // run.hidden}
        return build_model("gpt3-175b", global_batch=run.global_batch, overrides=overrides)
    overrides = {"layers": run.layers, "hidden": run.hidden, "heads": run.heads, "kv_heads": run.kv_heads,
                 "vocab": run.vocab, "ffn_hidden": run.ffn_hidden, "seq": run.seq, "mlp": run.mlp,
                 "norm": run.norm}
    return build_model("llama3-8b", global_batch=run.global_batch, overrides=overrides)


MOE_CAPACITY_FACTOR = 1.0
"""MoE runs are priced with capacity for the balanced load: Megatron-Core's dropless dispatcher spends
that on average (the plan states the assumption, ``model.moe.assumption``)."""


def moe_overrides(run: ModernRun) -> dict[str, object]:
    """The MoE family's dims for ``run``. Its attention has heads of ``hidden / heads``, even; where the
    published heads are of another width (GPT-OSS: 64 of 64 on a 2,880 residual) it gets the most heads,
    no more than published and a multiple of ``kv_heads``, that split ``hidden`` evenly. Under context
    parallelism the tokens are routed in groups of a rank's chunk (``seq / 2 cp``, which autopar needs:
    ``roles.check_groups_within_a_chunk``); at capacity factor 1 the price is the same for any group size."""
    heads = run.heads
    if run.head_dim and run.head_dim * run.heads != run.hidden:
        heads = max(h for h in range(run.kv_heads, run.heads + 1, run.kv_heads)
                    if run.hidden % h == 0 and (run.hidden // h) % 2 == 0)
    return {"layers": run.layers, "hidden": run.hidden, "heads": heads, "kv_heads": run.kv_heads,
            "vocab": run.vocab, "ffn_hidden": run.ffn_hidden, "seq": run.seq, "experts": run.experts,
            "top_k": run.top_k, "capacity_factor": MOE_CAPACITY_FACTOR,
            **({"group_size": run.seq // (2 * run.cp)} if run.cp > 1 else {})}


def modern_cluster(run: ModernRun) -> str:
    """``Nx8x<device>``, with the published HBM capacity where it differs from the catalog's."""
    memory = f",mem={run.device_memory_gb:g}GB" if run.device_memory_gb else ""
    return f"{run.gpus // 8}x8x{run.device}{memory}"


def modern_constraints(run: ModernRun, zero_stage: int, checkpointing: str) -> dict[str, object]:
    """The run's published configuration as planner constraints; what the source leaves out stays free."""
    fixed: dict[str, object] = {"tp": run.tp, "pp": run.pp, "dp": run.dp, "cp": run.cp, "ep": run.ep,
                                "fsdp": zero_stage, "dtype": "bf16"}
    if run.micro_batch:
        fixed["microbatch_size"] = run.micro_batch
    if checkpointing:
        fixed["checkpointing"] = checkpointing
    if run.tp > 1:
        fixed["sp"] = int(run.sequence_parallel)
    if run.pipeline_schedule:  # as the run scheduled it: the free search would also try zero bubble
        fixed["schedule"] = run.pipeline_schedule
    if run.pp > 1 and run.vp > 1:
        fixed["virtual_stages"] = run.vp
    if run.cp > 1 and run.cp_attention:
        fixed["cp_attention"] = run.cp_attention
    if run.precision == "fp8":
        fixed["fp8"] = "tensorwise"
    if run.reduce_dtype:
        fixed["reduce_dtype"] = run.reduce_dtype
    if run.master_dtype:
        fixed["master_dtype"] = run.master_dtype
    if overlaps_fsdp_reductions(run):
        fixed["runtime"] = "lowered"
    return fixed


def overlaps_fsdp_reductions(run: ModernRun) -> bool:
    """Whether ``run`` is priced on autopar's lowered runtime: one-stage FSDP. Its frameworks reduce-scatter
    each layer's gradients as backward produces them, overlapped with the rest of backward (MaxText: XLA's
    async collectives; torchtitan: FSDP2's reduce-scatter stream), as autopar's lowered program does
    (``passes/lower_buckets.bucket_gradient_scatters``); the DTensor runtime runs them inside backward.
    The runtime changes no other price, and lowered programs run neither pipelines nor ring attention."""
    return run.data_parallel == "fsdp" and run.pp == 1


def configurations(run: ModernRun) -> list[dict[str, object]]:
    """The published configuration first, then the closest ones to fall back on where it is refused: each
    checkpointing mode that recomputes more than the published one (``plan.CHECKPOINTING``'s order), then
    the next ZeRO stage of ``zero_stages``."""
    recompute = ([run.recompute] if run.recompute in ("", "none")
                 else list(CHECKPOINTING[CHECKPOINTING.index(run.recompute):]))
    return [modern_constraints(run, stage, checkpointing)
            for stage in zero_stages(run) for checkpointing in recompute]


def why_not_priced(run: ModernRun) -> str:
    """Why a row is recorded without pricing ("" when it is priced)."""
    if run.precision not in ("bf16", "fp8"):
        return f"{run.precision.upper()} run: autopar prices bf16 and float8 linears only"
    return ""


def price_modern(run: ModernRun) -> dict:
    """Price ``run`` with its degrees pinned; where autopar refuses, the next of ``configurations``."""
    start, refusals = time.perf_counter(), []
    for constraints in configurations(run):
        try:
            bundle = modern_bundle(run)
            plan = autopar.plan(bundle.model, bundle.example_inputs, modern_cluster(run), bundle.loss_fn,
                                example_targets=bundle.example_targets, constraints=constraints)
        except (BadInputError, NoFeasiblePlanError) as err:
            refusals.append(f"{_fix_text(constraints)}: {type(err).__name__}: {err}")
            continue
        return {"status": "priced", "fix": _fix_text(constraints), "refusals": refusals,
                "plan_wall_s": time.perf_counter() - start, **plan_terms(plan, run)}
    return {"status": "refused", "reason": refusals[0], "refusals": refusals,
            "plan_wall_s": time.perf_counter() - start}


def _fix_text(constraints: dict[str, object]) -> str:
    """The constraints as ``--fix`` text, so a row can be re-priced from the command line."""
    return ",".join(f"{key}={value}" for key, value in constraints.items())


def plan_terms(plan: autopar.Plan, run: ModernRun) -> dict:
    """The predicted step and its parts, and what the planner chose where the row left it free."""
    p = plan.predicted
    step_flops = run.global_batch * model_flops_per_sequence(run)
    return {"predicted_step_s": p["step_time_s"], "error": p["step_time_s"] / run.measured_step_s - 1,
            "compute_term_tflops_per_gpu": step_flops / (p["compute_s"] * run.gpus) / 1e12,
            "predicted_mfu": p["mfu"], "compute_s": p["compute_s"], "exposed_comm_s": p["exposed_comm_s"],
            "grad_sync_s": p["grad_sync_s"], "bubble_s": p["bubble_s"], "optimizer_s": p["optimizer_s"],
            "comm_s": p["comm_s"], "peak_memory_gb": p["peak_memory_bytes"] / 1e9,
            "memory_gb": {part: size / 1e9 for part, size in p["memory_bytes"].items()},
            "degrees": dict(plan.degrees), "schedule": plan.pipeline.schedule,
            "microbatches": plan.pipeline.microbatches, "checkpointing": plan.checkpointing}


def modern_row(run: ModernRun) -> dict:
    """One row of the modern table: the run as published, and autopar's price or why there is none."""
    row = {"name": run.name, "model": run.model, "device": run.device, "device_variant": run.device_variant,
           "gpus": run.gpus, "tp": run.tp, "pp": run.pp, "vp": run.vp, "cp": run.cp, "ep": run.ep, "dp": run.dp,
           "data_parallel": run.data_parallel, "micro_batch": run.micro_batch, "global_batch": run.global_batch,
           "seq": run.seq, "recompute": run.recompute or "(not published)", "precision": run.precision,
           "published": run.published, "metric": run.metric, "measured_step_s": run.measured_step_s,
           "measured_tflops_per_gpu": run.implied_tflops_per_gpu(),
           "peak_tflops": DEVICES[run.device].peak("bf16") / 1e12,
           "source": run.source, "notes": run.notes}
    reason = why_not_priced(run)
    row.update({"status": "not priced", "reason": reason} if reason else price_modern(run))
    _print_modern_row(row)
    return row


def _print_modern_row(r: dict) -> None:
    head = f"{r['name']:<42} {r['gpus']:>6} {r['measured_step_s']:>9.2f}"
    if r["status"] != "priced":
        print(f"{head}  {r['status']}: {r.get('reason', '')[:150]}", flush=True)
        return
    fallback = "  (fallback: " + r["fix"] + ")" if r["refusals"] else ""
    print(f"{head} {r['predicted_step_s']:>10.2f} {r['error'] * 100:>+7.1f}% {r['compute_s']:>8.2f} "
          f"{r['exposed_comm_s']:>7.2f} {r['bubble_s']:>7.2f} {r['peak_memory_gb']:>6.1f} "
          f"{r['plan_wall_s']:>6.1f}{fallback}", flush=True)


def modern_summary(rows: list[dict]) -> dict:
    """Median and max |error| over the priced rows on catalog devices, and apart over device variants."""
    priced = [r for r in rows if r["status"] == "priced"]
    return {"catalog_devices": _error_stats([r for r in priced if not r["device_variant"]]),
            "device_variants": _error_stats([r for r in priced if r["device_variant"]]),
            "all_priced": _error_stats(priced),
            "not_priced": {r["name"]: r["reason"] for r in rows if r["status"] != "priced"}}


def _error_stats(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {"rows": len(errors), "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None}


def run_modern(only: list[str], output: Path | None) -> None:
    """Price the modern set (or the runs whose name contains one of ``only``) and write the rows and
    summary to ``output``."""
    unmatched = [text for text in only if not any(text in run.name for run in MODERN_RUNS)]
    if unmatched:
        raise SystemExit(f"no run's name contains {', '.join(unmatched)}; names are in benchmarks/modern_runs.py")
    runs = [run for run in MODERN_RUNS if not only or any(text in run.name for text in only)]
    print("Modern published runs (modern_runs.py), published degrees pinned; step times in seconds")
    print(f"{'run':<42} {'GPUs':>6} {'measured':>9} {'predicted':>10} {'error':>8} {'compute':>8} {'comm':>7} "
          f"{'bubble':>7} {'GB':>6} {'plan s':>6}")
    rows = [modern_row(run) for run in runs]
    summary = modern_summary(rows)
    for group in ("catalog_devices", "device_variants"):
        s = summary[group]
        if s["rows"]:
            print(f"{group}: {s['rows']} priced, median |error| {s['median_abs_error'] * 100:.1f}%, "
                  f"max |error| {s['max_abs_error'] * 100:.1f}%")
    if output is not None:
        output.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
        print(f"wrote {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("sc21", "modern"), default="sc21", dest="which",
                        help="sc21: Megatron-LM SC21 Table 1 (default); modern: modern_runs.py")
    parser.add_argument("--only", nargs="*", default=[],
                        help="with --set modern: price only the runs whose name contains one of these "
                             "(nemotron, 340b, gpt3-175b/128xH100); nothing is written without -o")
    parser.add_argument("--rows", type=int, default=len(MEGATRON_SC21_TABLE1))
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("-o", "--output", help="JSON to write (default: results/cost_model_validation.json, "
                        "or results/cost_model_validation_modern.json with --set modern)")
    args = parser.parse_args()
    if args.which == "modern":
        default = None if args.only else RESULTS / "cost_model_validation_modern.json"
        run_modern(args.only, Path(args.output) if args.output else default)
        return
    args.output = args.output or str(RESULTS / "cost_model_validation.json")
    print("Megatron-LM SC21 Table 1, published degrees pinned; step times in seconds")
    print(f"{'model':>8} {'GPUs':>5} {'TP':>3} {'PP':>3} {'DP':>3} {'measured':>9} {'predicted':>10} {'error':>8} "
          f"{'compute':>8} {'comm':>7} {'bubble':>7} {'GB':>6} {'plan s':>6}")
    rows = validate_rows(MEGATRON_SC21_TABLE1[:args.rows])
    errors = [abs(r["error"]) for r in rows]
    summary = {"rows": len(rows), "max_abs_error": max(errors), "median_abs_error": statistics.median(errors)}
    print(f"max |error| {summary['max_abs_error'] * 100:.1f}%, median |error| {summary['median_abs_error'] * 100:.1f}%")
    sweep, free = [], {}
    if not args.no_sweep:
        print("(PP, TP) sweep, 162B GPT on 64 A100s (paper: best at (8, 8))")
        sweep = pp_tp_sweep()
        free = free_search_162b()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"table1": rows, "summary": summary, "pp_tp_sweep": sweep,
                                              "free_search_162b": free}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
