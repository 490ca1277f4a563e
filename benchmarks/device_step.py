"""Does the cost model predict a training step on a real accelerator? Calibrate, plan, train, compare.

Run on a CUDA machine under torchrun, one rank per GPU (one GPU is enough)::

    torchrun --nproc_per_node 1 benchmarks/device_step.py --out benchmarks/results/device_step.json

It also runs on CPU with gloo ranks (``--device cpu``), which is how it is tested without a GPU.

1. ``autopar calibrate``'s measurement (``measure_in_job``) runs on the job's ranks and becomes a
   cluster profile (written beside ``--out``).
2. For each model of ``CONFIGS`` (GPT and Llama blocks of growing width, so that GEMMs go from
   small to large), in bf16 on CUDA (fp32 on CPU): the step is planned for the catalog preset
   (``1xWx<preset>``: datasheet figures and efficiency curves, nothing measured here) and for the
   calibrated profile, and trained under the profile's plan. ``pm.step`` (forward, loss, backward,
   gradient sync) is timed against ``predicted.step_time_s``, the peak memory the allocator saw
   against the predicted bytes held in a step
   (``predicted.memory_bytes`` less the optimizer state, which AdamW creates at its first update).
3. The same model runs as plain eager PyTorch (``loss_fn(model(x), y).backward()``): what the
   hardware does with the step when no runtime stands between. A gap between autopar's step and the
   eager step is the runtime's overhead (DTensor dispatch on the host), which the cost model does
   not price on accelerators; a gap between eager and the prediction is the cost model's error.

4. On CUDA, the GEMM alignment probe: ``[16384, 4096] @ [4096, n]`` in bf16 (and its two backward
   products) for n that are and are not multiples of 8 elements, the source of
   ``compute.MISALIGNED_MATMUL_FACTOR``.

Prints a table and writes JSON (the profile's fits, every step sample, each plan's predicted terms).
``--reprice FILE`` re-plans the rows of an earlier run's JSON with today's cost model and that run's
profile, on this machine without a GPU: how a cost-model change moves the predictions of a
measurement already taken.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import autopar
from autopar.core.files import write_atomically
from autopar.cost_models.calibrate import build_profile, measure_in_job, profile_source, profile_text
from autopar.cost_models.memory import adamw_state_bytes
from autopar.testing.launch import free_port
from autopar.models import build_model

#: name, preset, config overrides, global batch, sequence length. Widths double from row to row, so
#: the GEMMs go from launch- and bandwidth-bound to compute-bound.
CONFIGS: list[tuple[str, str, dict[str, Any], int, int]] = [
    ("gpt h768 L12", "gpt2", {}, 16, 1024),
    ("gpt h2048 L8", "gpt2", {"layers": 8, "hidden": 2048, "heads": 16, "seq": 2048}, 8, 2048),
    ("gpt h4096 L4", "gpt2", {"layers": 4, "hidden": 4096, "heads": 32, "seq": 2048}, 8, 2048),
    ("llama h4096 L4", "llama3-8b", {"layers": 4, "vocab": 32000}, 4, 4096),
    # GPT-2's vocabulary (50,257) padded to a multiple of 64, as Megatron-LM and nanoGPT pad it
    ("gpt h4096 L4 v50304", "gpt2", {"layers": 4, "hidden": 4096, "heads": 32, "seq": 2048, "vocab": 50304}, 8, 2048),
]
#: Small stand-ins with the same structure, for ``--device cpu`` (tests, machines without a GPU).
CPU_CONFIGS: list[tuple[str, str, dict[str, Any], int, int]] = [
    ("gpt h64 L2", "tiny-gpt", {}, 8, 32),
    ("llama h64 L2", "tiny-llama", {}, 8, 32),
]
WARMUP_STEPS = 3
"""Steps left out of the timing: DTensor's propagation caches, the allocator and autotuning warm up."""


def timed(fn: Callable[[], Any], sync: Callable[[], None], steps: int,
          align: Callable[[], None] = dist.barrier) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn`` after the warm-up ones, each started together on every
    rank (``align``) and ended by ``sync``."""
    samples = []
    for i in range(WARMUP_STEPS + steps):
        align()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        if i >= WARMUP_STEPS:
            samples.append(time.perf_counter() - start)
    return samples


def slowest_rank(samples: list[float]) -> list[float]:
    """Per step, the slowest rank's seconds: a synchronous step ends when its last rank does."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, samples)
    return [max(step) for step in zip(*gathered)]


def bundle_for(preset: str, overrides: dict[str, Any], batch: int, seq: int, device: str, dtype: torch.dtype) -> Any:
    bundle = build_model(preset, overrides=overrides, global_batch=batch, seq=seq, device=device, seed=0)
    bundle.model.to(dtype)
    return bundle


def plan_for(bundle: Any, cluster: str, dtype: str, name: str) -> autopar.Plan:
    """The plan rank 0 makes for ``cluster``, sent to every rank."""
    box: list[Any] = [planned(bundle, cluster, dtype, name).to_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return autopar.Plan.from_dict(box[0])


def planned(bundle: Any, cluster: str, dtype: str, name: str) -> autopar.Plan:
    """``autopar.plan`` of the bundle's step in ``dtype`` for ``cluster`` (its warnings left out of the table)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn, {"dtype": dtype},
                            example_targets=bundle.example_targets, name=name)


RUNTIMES: dict[str, dict[str, Any]] = {
    "default": {},
    "compiled": {"compile": True},
    "dtensor": {"lowered": False},
}
"""autopar's runtimes a row can time, by name: ``autoparallelize``'s keywords for each (the default
runs the plan lowered to local ops with explicit collectives, ``compiled`` runs those graphs through
inductor, ``dtensor`` runs the plan op by op on DTensor). ``default`` is reported as ``autopar``, the
others as ``autopar_<name>``."""


def measure_model(row: tuple[str, str, dict[str, Any], int, int], clusters: dict[str, str], device: str,
                  steps: int, runtimes: list[str], eager_compiled: bool, profiling: bool) -> dict[str, Any]:
    name, preset, overrides, batch, seq = row
    dtype, dtype_key = (torch.bfloat16, "bf16") if device == "cuda" else (torch.float32, "fp32")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    baseline = _allocated(device)  # what earlier rows left allocated is not this step's memory
    bundle = bundle_for(preset, overrides, batch, seq, device, dtype)
    plans = {which: plan_for(bundle, cluster, dtype_key, name) for which, cluster in clusters.items()}
    chosen = plans["calibrated"]
    out: dict[str, Any] = {"model": name, "preset": preset, "overrides": overrides, "global_batch": batch,
                           "seq": seq, "dtype": dtype_key, "params": bundle.num_params(),
                           "mesh": dict(zip(chosen.mesh.dim_names, chosen.mesh.shape)),
                           "checkpointing": chosen.checkpointing, "precision": _precision(chosen),
                           "predicted": {which: p.predicted for which, p in plans.items()}}
    out["eager"] = _eager(bundle, sync, steps, device, baseline, profiling, compiled=False)
    if eager_compiled:
        out["eager_compiled"] = _guarded(partial(_eager, bundle, sync, steps, device, baseline, profiling,
                                                 compiled=True))
    del bundle
    for runtime in runtimes:
        key = "autopar" if runtime == "default" else f"autopar_{runtime}"
        before = _allocated(device)  # what earlier runtimes left (compiled programs' caches) is not this one's
        fresh = bundle_for(preset, overrides, batch, seq, device, dtype)  # each runtime starts from the same weights
        out[key] = _guarded(partial(_autopar, fresh, chosen, sync, steps, device, before, profiling,
                                    **RUNTIMES[runtime]))
        del fresh
    return out


_DEFAULT_PRECISION = {"compute": "bf16", "master": "fp32"}
"""The precision of rows written before the JSON recorded it (2026-11-29): bf16 compute, fp32 masters."""


def _precision(chosen: autopar.Plan) -> dict[str, str]:
    return {"compute": chosen.precision.compute, "master": chosen.precision.master}


def _guarded(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()``, or why it failed: one runtime that fails leaves the row's others measured."""
    try:
        return measure()
    except Exception as exc:  # a benchmark reports every variant it could run, and why one failed
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _eager(bundle: Any, sync: Callable[[], None], steps: int, device: str, baseline: int, profiling: bool,
           compiled: bool) -> dict[str, Any]:
    model, inputs, targets = bundle.model, bundle.example_inputs, bundle.example_targets
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        model.zero_grad(set_to_none=True)
        bundle.loss_fn(forward(*inputs), targets).backward()

    _reset_peak(device)
    samples = slowest_rank(timed(step, sync, steps))
    out = {"step_s": samples, "median_s": statistics.median(samples), "peak_gb": _peak_gb(device, baseline),
           **(profiled(step, sync, device) if profiling else {})}
    model.zero_grad(set_to_none=True)
    return out


def _autopar(bundle: Any, chosen: autopar.Plan, sync: Callable[[], None], steps: int, device: str,
             baseline: int, profiling: bool, **runtime: Any) -> dict[str, Any]:
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, plan=chosen, **runtime)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pm.step(*bundle.example_inputs, bundle.example_targets)

    _reset_peak(device)
    samples = slowest_rank(timed(step, sync, steps))
    peak = _peak_gb(device, baseline)
    profile = profiled(step, sync, device) if profiling else {}
    updates = slowest_rank(timed(opt.step, sync, steps))
    return {"step_s": samples, "median_s": statistics.median(samples), "peak_gb": peak,
            "update_s": updates, "update_median_s": statistics.median(updates), "redistributes": pm.redistributes,
            **profile}


PROFILED_STEPS = 3
"""Steps ``--profile`` records after the timed ones (their kernels and host ops, summed)."""
PROFILE_ROWS = 25


def profiled(step: Callable[[], None], sync: Callable[[], None], device: str) -> dict[str, str]:
    """``--profile``'s tables: torch.profiler over ``PROFILED_STEPS`` steps, the ops by their own device
    time (on CUDA) and by their own host time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        sync()
    averages = prof.key_averages()
    tables = {"profile_host": averages.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)}
    if device == "cuda":
        tables["profile_device"] = averages.table(sort_by="self_device_time_total", row_limit=PROFILE_ROWS)
    return tables


def _reset_peak(device: str) -> None:
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _allocated(device: str) -> int:
    gc.collect()
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def _peak_gb(device: str, baseline: int) -> float | None:
    """The allocator's peak since the last reset, less what was allocated before the row began."""
    return (torch.cuda.max_memory_allocated() - baseline) / 1e9 if device == "cuda" else None


ALIGNMENT_PROBE = ((16384, 4096, 50257), (16384, 4096, 50304), (16384, 4096, 32001), (16384, 4096, 32000))
"""(m, k, n) of the probe's GEMMs: GPT-2's vocabulary, padded to a multiple of 64, and one off 32,000."""


def measure_alignment(steps: int) -> list[dict[str, Any]]:
    """TFLOP/s of each probe GEMM in bf16, forward (x @ w) and its backward products (dy @ w.T, x.T @ dy)."""
    rows = []
    for m, k, n in ALIGNMENT_PROBE:
        x, w, dy = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in ((m, k), (k, n), (m, n)))
        for product, fn in (("forward", partial(torch.matmul, x, w)), ("grad_input", partial(torch.matmul, dy, w.t())),
                            ("grad_weight", partial(torch.matmul, x.t(), dy))):
            seconds = statistics.median(timed(fn, torch.cuda.synchronize, steps))
            rows.append({"m": m, "k": k, "n": n, "product": product, "seconds": seconds,
                         "tflops": 2 * m * k * n / seconds / 1e12})
        del x, w, dy, fn
    return rows


def reprice(path: str) -> None:
    """Print an earlier run's measurements beside the predictions today's cost model makes for them."""
    data = json.loads(Path(path).read_text())
    profile = Path(path).with_name("device_step_profile.json")
    clusters = {"preset": data["clusters"]["preset"], "calibrated": str(profile)}
    for row in data["rows"]:
        if "error" in row:
            continue
        bundle = build_model(row["preset"], overrides=row["overrides"], global_batch=row["global_batch"],
                             seq=row["seq"], device="meta")
        for which, cluster in clusters.items():
            row["predicted"][which] = planned(bundle, cluster, row["dtype"], row["model"]).predicted
    print_table(data["rows"])


def calibrate(out_dir: Path, quick: bool) -> tuple[str, dict[str, Any] | None]:
    """The calibrated profile's path (written by rank 0) and, on rank 0, the profile."""
    measured = measure_in_job(quick)
    path = str(out_dir / "device_step_profile.json")
    profile = None
    if measured is not None:
        profile = build_profile(measured, profile_source())
        write_atomically(path, profile_text(profile))
    dist.barrier()
    return path, profile


def _join_job(device: str) -> None:
    """Join torchrun's process group (NCCL, one GPU per local rank; gloo on CPU), or be a job of one."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


def preset_cluster(device: str) -> str:
    """``1xWx<preset>`` for this job, the catalog's figures for its device."""
    world = dist.get_world_size()
    if device == "cuda":
        from autopar.cost_models.hardware import preset_for_cuda_name

        return f"1x{world}x{preset_for_cuda_name(torch.cuda.get_device_name())}"
    return f"1x{world}xcpu"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<16} {'params':>7} {'batch':>9} {'preset pred':>11} {'calib pred':>10} {'eager':>9} "
          f"{'autopar':>9} {'err/eager':>9} {'err/autopar':>11} {'mem pred':>8} {'mem eager':>9} "
          f"{'mem autopar':>11} {'redistributes':>13}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<16} failed: {r['error']}")
            continue
        pred, calib = r["predicted"]["preset"], r["predicted"]["calibrated"]
        ours = r.get("autopar", {})
        eager, run = r["eager"]["median_s"], ours.get("median_s", float("nan"))
        step = calib["step_time_s"]
        peaks = [r["eager"]["peak_gb"], ours.get("peak_gb")]
        peak_text = [f"{p:.2f} GB" if p is not None else "-" for p in peaks]
        print(f"{r['model']:<16} {r['params'] / 1e6:>6.0f}M {r['global_batch']:>3}x{r['seq']:<5} "
              f"{pred['step_time_s'] * 1e3:>8.1f} ms {step * 1e3:>7.1f} ms {eager * 1e3:>6.1f} ms "
              f"{run * 1e3:>6.1f} ms {(step - eager) / eager * 100:>+8.0f}% {(step - run) / run * 100:>+10.0f}% "
              f"{_step_memory_gb(calib, r.get('precision', _DEFAULT_PRECISION)):>5.2f} GB "
              f"{peak_text[0]:>9} {peak_text[1]:>11} "
              f"{ours.get('redistributes', '-'):>13}")
    print_runtimes(rows)


def print_runtimes(rows: list[dict[str, Any]]) -> None:
    """Each runtime's median step beside eager PyTorch's, as a multiple of it (and why one failed)."""
    keys = [k for k in ("eager_compiled", "autopar", "autopar_compiled", "autopar_dtensor")
            if any(k in r for r in rows)]
    print(f"\n{'model':<16} {'eager':>9} " + " ".join(f"{k:>22}" for k in keys))
    for r in rows:
        if "error" in r:
            continue
        eager = r["eager"]["median_s"]
        cells = []
        for key in keys:
            run = r.get(key)
            if run is None:
                cells.append(f"{'-':>22}")
            elif "error" in run:
                cells.append(f"{'failed':>22}")
            else:
                cells.append(f"{run['median_s'] * 1e3:>10.1f} ms ({run['median_s'] / eager:4.2f}x)")
        print(f"{r['model']:<16} {eager * 1e3:>6.1f} ms " + " ".join(cells))
    for r in rows:
        for key in keys:
            if "error" in r.get(key, {}):
                print(f"{r['model']} {key} failed: {r[key]['error']}")


def _step_memory_gb(predicted: dict[str, Any], precision: dict[str, str]) -> float:
    """Predicted bytes a device holds during ``pm.step``: all but the optimizer state, which the timed
    steps have not created yet (the update is timed after them), except the master copy of each
    parameter under mixed precision: the runtime's parameters are those masters (``precision.master``)
    from the start, and the step computes with copies in ``precision.compute``."""
    memory = predicted["memory_bytes"]
    state = adamw_state_bytes(1, precision["compute"], precision["master"])
    moments = adamw_state_bytes(1, precision["master"], precision["master"])
    masters = memory.get("optimizer", 0) * (state - moments) / state
    return (sum(v for k, v in memory.items() if k != "optimizer") + masters) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per model (default 8)")
    parser.add_argument("--quick", action="store_true", help="calibrate with `autopar calibrate --quick` sizes")
    parser.add_argument("--models", default=None, help="comma-separated indices into the model list (default all)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "device_step.json"))
    parser.add_argument("--reprice", default=None, metavar="FILE",
                        help="re-plan the rows of an earlier run's JSON with today's cost model (no GPU needed)")
    parser.add_argument("--runtimes", default="default",
                        help=f"autopar runtimes to time, comma-separated, from {', '.join(RUNTIMES)} "
                             "(default: default)")
    parser.add_argument("--eager-compiled", action="store_true", help="also time eager PyTorch under torch.compile")
    parser.add_argument("--skip-alignment", action="store_true", help="leave out the GEMM alignment probe")
    parser.add_argument("--profile", action="store_true",
                        help=f"also profile {PROFILED_STEPS} steps of each runtime (tables in the JSON)")
    args = parser.parse_args()
    if args.reprice:
        reprice(args.reprice)
        return
    out = Path(args.out)
    _join_job(args.device)
    path, profile = calibrate(out.parent, args.quick)
    clusters = {"preset": preset_cluster(args.device), "calibrated": path}
    configs = CONFIGS if args.device == "cuda" else CPU_CONFIGS
    if args.models:
        configs = [configs[int(i)] for i in args.models.split(",")]
    runtimes = args.runtimes.split(",")
    unknown = sorted(set(runtimes) - set(RUNTIMES))
    if unknown:
        parser.error(f"unknown runtime(s) {', '.join(unknown)}: choose from {', '.join(RUNTIMES)}")
    rows: list[dict[str, Any]] = []
    for row in configs:
        try:
            rows.append(measure_model(row, clusters, args.device, args.steps, runtimes, args.eager_compiled,
                                      args.profile))
        except Exception as exc:  # a benchmark reports every model it could run, and why one failed
            rows.append({"model": row[0], "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        if args.device == "cuda":
            torch.cuda.empty_cache()
        write_results(out, profile, clusters, rows, [])  # each row kept as it ends, should a later one hang
    alignment = measure_alignment(args.steps) if args.device == "cuda" and not args.skip_alignment else []
    if dist.get_rank() == 0:
        print_table(rows)
        for a in alignment:
            print(f"[{a['m']}, {a['k']}] @ [{a['k']}, {a['n']}] bf16 {a['product']:<11} {a['tflops']:6.0f} TFLOP/s")
        write_results(out, profile, clusters, rows, alignment)
        print(f"wrote {out}")


def write_results(out: Path, profile: dict[str, Any] | None, clusters: dict[str, str], rows: list[dict[str, Any]],
                  alignment: list[dict[str, Any]]) -> None:
    """The run's JSON (rank 0 writes it): the profile, the clusters planned for, the rows, the GEMM probe."""
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"torch": torch.__version__, "profile": profile, "clusters": clusters, "rows": rows,
                                   "gemm_alignment": alignment}, indent=2) + "\n")


if __name__ == "__main__":
    main()
