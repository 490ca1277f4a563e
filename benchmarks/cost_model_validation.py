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

    python benchmarks/cost_model_validation.py            # every row (about 10 minutes on 2 cores)
    python benchmarks/cost_model_validation.py --rows 3   # the first 3 rows
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import autopar
from autopar.models import build_model

SEQ, VOCAB = 2048, 51200


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
    fixed: dict[str, object] = {"tp": run.tp, "pp": run.pp, "dp": run.dp, "microbatch_size": run.microbatch,
                                "checkpointing": "full", "fsdp": 0}  # the 2021 runs: plain data parallelism
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
    return {"degrees": d, "schedule": plan.pipeline.schedule, "microbatches": plan.pipeline.microbatches,
            "checkpointing": plan.checkpointing, "step_time_s": plan.predicted["step_time_s"],
            "mfu": plan.predicted["mfu"], "plan_wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=len(MEGATRON_SC21_TABLE1))
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("-o", "--output", default=str(Path(__file__).parent / "results" / "cost_model_validation.json"))
    args = parser.parse_args()
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
