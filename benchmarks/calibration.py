"""Does a calibrated profile predict real step times? Calibrate on W gloo ranks, plan, train, compare.

For each world size W: ``autopar calibrate``'s measurement runs on W spawned gloo ranks and becomes a
cluster profile; the demo model (``tiny-gpt``, global batch 8, as ``autopar demo``) is planned for that
profile and, for reference, for the uncalibrated ``1xWxcpu`` preset, once per runtime (``--runtimes``:
the default lowered program and DTensor, each plan pinned to its runtime and so priced with that runtime's
host dispatch); then each of the profile's plans trains on W fresh gloo ranks, on its runtime, and each
training step is timed (median and fastest step are both reported:
calibration keeps each op's fastest repeat, so the fastest step is the like-for-like figure on a
shared, busy machine). ``pm.step`` (forward, loss, backward, gradient sync) is what
``predicted.step_time_s`` prices; the optimizer update (``opt.step``) is timed apart and compared with
``predicted.optimizer_s``.

The development machine's virtual CPUs change speed by up to 2x for tens of seconds at a time (the
same single-process timing, pinned to one vCPU, gave 4.6 and then 8.2 ms), so one calibration and the
training that follows it can be taken at different speeds. ``--rounds R`` repeats the whole cycle
(calibrate, plan, train) R times per world size and also reports the pooled error: the median of the
R predictions against the median of the R measured medians. Prints a table per round and the pooled
summary, and writes ``benchmarks/results/calibration.json`` (every round's rows, with each profile's
fitted figures, and the summary). Usage::

    python benchmarks/calibration.py                   # W = 1, 2 and 4, 3 rounds, full calibration
    python benchmarks/calibration.py --worlds 2 --rounds 1 --quick --steps 6 --out /tmp/calibration.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from autopar.api import plan
from autopar.core.files import write_atomically
from autopar.cost_models.calibrate import build_profile, measure_spawned_rank, profile_source, profile_text
from autopar.testing.launch import run_on_ranks
from autopar.models import build_model
from autopar.testing.parity import batches, build

MODEL = "tiny-gpt"
GLOBAL_BATCH = 8
WARMUP_STEPS = 2
"""Steps left out of the timing: the first builds DTensor's sharding-propagation caches."""


def calibrate(world: int, quick: bool, directory: Path) -> tuple[dict[str, Any], str]:
    """The profile measured on ``world`` gloo ranks, and the path it was written to."""
    measured = run_on_ranks(measure_spawned_rank, world, quick)[0]
    profile = build_profile(measured, profile_source())
    path = str(directory / f"calibrated-{world}.json")
    write_atomically(path, profile_text(profile))
    return profile, path


RUNTIMES = ("lowered", "dtensor")
"""The runtimes each world is timed on, each under a plan pinned to it (``constraints.runtime``) and so
priced with that runtime's host dispatch (the profile's ``lowered_host_op_s`` and ``host_op_s``)."""


def plan_demo(cluster: str, runtime: str) -> Any:
    bundle = build_model(MODEL, global_batch=GLOBAL_BATCH, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn, {"runtime": runtime},
                    example_targets=bundle.example_targets, name=MODEL)


def timed_steps_rank(rank: int, world: int, plan_dict: dict, steps: int) -> dict[str, list[float]]:
    """One rank trains the demo under ``plan_dict``, on the runtime it is priced for; seconds of each
    ``pm.step`` and ``opt.step``."""
    import torch
    import torch.distributed as dist

    import autopar

    bundle = build(MODEL, None, GLOBAL_BATCH, None, seed=0)
    chosen = autopar.Plan.from_dict(plan_dict)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, plan=chosen,
                                 lowered=chosen.predicted["runtime"] == "lowered")
    opt = torch.optim.AdamW(pm.parameters())  # the update pricing prices (cost_models.compute.adamw_step_time)
    step_s, update_s = [], []
    for batch in batches(bundle, steps + WARMUP_STEPS, seed=0):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        pm.step(*batch)
        stepped = time.perf_counter()
        opt.step()
        step_s.append(stepped - start)
        update_s.append(time.perf_counter() - stepped)
    return {"step_s": step_s[WARMUP_STEPS:], "update_s": update_s[WARMUP_STEPS:]}


def measure_world(world: int, steps: int, quick: bool, directory: Path, round_index: int = 0,
                  runtimes: tuple[str, ...] = RUNTIMES) -> list[dict[str, Any]]:
    """One calibration on ``world`` ranks, then a row per runtime: its plan trained and timed."""
    load_before = os.getloadavg()
    profile, path = calibrate(world, quick, directory)
    return [measure_runtime(world, steps, quick, path, profile, runtime, round_index, load_before)
            for runtime in runtimes]


def measure_runtime(world: int, steps: int, quick: bool, path: str, profile: dict[str, Any], runtime: str,
                    round_index: int, load_before: tuple[float, ...]) -> dict[str, Any]:
    calibrated, preset = plan_demo(path, runtime), plan_demo(f"1x{world}xcpu", runtime)
    per_rank = run_on_ranks(timed_steps_rank, world, calibrated.to_dict(), steps)
    # a synchronous step ends when its slowest rank does
    step_s = [max(times) for times in zip(*(r["step_s"] for r in per_rank))]
    update_s = [max(times) for times in zip(*(r["update_s"] for r in per_rank))]
    measured, fastest = statistics.median(step_s), min(step_s)
    predicted = calibrated.predicted["step_time_s"]
    return {
        "world": world, "round": round_index, "runtime": runtime, "model": MODEL, "global_batch": GLOBAL_BATCH,
        "quick": quick,
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "mesh": dict(zip(calibrated.mesh.dim_names, calibrated.mesh.shape)),
        "predicted_step_s": predicted, "predicted_compute_s": calibrated.predicted["compute_s"],
        "predicted_exposed_comm_s": calibrated.predicted["exposed_comm_s"],
        "preset_predicted_step_s": preset.predicted["step_time_s"],
        "measured_step_s": measured, "fastest_step_s": fastest, "measured_step_samples_s": step_s,
        "measured_update_s": statistics.median(update_s), "fastest_update_s": min(update_s),
        "predicted_update_s": calibrated.predicted["optimizer_s"],
        "update_error": (calibrated.predicted["optimizer_s"] - statistics.median(update_s)) / statistics.median(update_s),
        "error": (predicted - measured) / measured, "error_vs_fastest": (predicted - fastest) / fastest,
        "profile": {"source": profile["source"], "device": profile["device"],
                    "fits": profile["measured"]["fits"], "op_floor": profile["measured"]["op_floor"]},
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'W':>2}  {'runtime':<8} {'mesh':<10} {'preset pred':>11} {'calib pred':>10} {'median':>9} {'error':>7} "
          f"{'fastest':>9} {'error':>7} "
          f"{'opt pred':>9} {'opt.step':>9}  {'GFLOP/s':>8} {'GB/s':>6} {'dispatch':>9} {'link GB/s':>9} "
          f"{'link lat':>9} {'redistr':>8}")
    for r in rows:
        fits, device = r["profile"]["fits"], r["profile"]["device"]
        link = fits["links"].get("intra", {"bw": float("nan"), "base_latency_s": float("nan")})
        mesh = "x".join(f"{k}={v}" for k, v in r["mesh"].items())
        dispatch = device.get("lowered_host_op_s" if r["runtime"] == "lowered" else "host_op_s") or 0.0
        print(f"{r['world']:>2}  {r['runtime']:<8} {mesh:<10} {r['preset_predicted_step_s'] * 1e3:>8.1f} ms "
              f"{r['predicted_step_s'] * 1e3:>7.1f} ms {r['measured_step_s'] * 1e3:>6.1f} ms "
              f"{r['error'] * 100:>+6.0f}% {r['fastest_step_s'] * 1e3:>6.1f} ms {r['error_vs_fastest'] * 100:>+6.0f}% "
              f"{r['predicted_update_s'] * 1e3:>6.1f} ms {r['measured_update_s'] * 1e3:>6.1f} ms  "
              f"{fits['matmul']['fp32']['rate'] / 1e9:>8.1f} {fits['memory']['rate'] / 1e9:>6.2f} "
              f"{dispatch * 1e6:>6.0f} us {link['bw'] / 1e9:>9.2f} "
              f"{link['base_latency_s'] * 1e6:>6.0f} us {device.get('redistribute_s', 0.0) * 1e6:>5.0f} us")


def pooled(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per world size and runtime: the median prediction against the median of the rounds' measured
    medians, and how many rounds alone were within 30% of their own measurement."""
    out = []
    for world, runtime in sorted({(r["world"], r["runtime"]) for r in rows}):
        mine = [r for r in rows if (r["world"], r["runtime"]) == (world, runtime)]
        predicted = statistics.median(r["predicted_step_s"] for r in mine)
        measured = statistics.median(r["measured_step_s"] for r in mine)
        out.append({"world": world, "runtime": runtime, "rounds": len(mine), "predicted_step_s": predicted,
                    "measured_step_s": measured,
                    "error": (predicted - measured) / measured,
                    "rounds_within_30_percent": sum(abs(r["error"]) <= 0.30 for r in mine)})
    return out


def print_pooled(summary: list[dict[str, Any]]) -> None:
    print(f"{'W':>2}  {'runtime':<8} {'rounds':>6} {'median pred':>11} {'median measured':>15} {'error':>7} "
          f"{'rounds within 30%':>17}")
    for s in summary:
        print(f"{s['world']:>2}  {s['runtime']:<8} {s['rounds']:>6} {s['predicted_step_s'] * 1e3:>8.1f} ms "
              f"{s['measured_step_s'] * 1e3:>12.1f} ms {s['error'] * 100:>+6.0f}% "
              f"{s['rounds_within_30_percent']:>11} of {s['rounds']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated gloo world sizes (default 1,2,4)")
    parser.add_argument("--rounds", type=int, default=3, help="calibrate-plan-train cycles per world (default 3)")
    parser.add_argument("--steps", type=int, default=12, help="timed training steps per world (default 12)")
    parser.add_argument("--quick", action="store_true", help="calibrate with `autopar calibrate --quick` sizes")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES),
                        help=f"runtimes to time, comma-separated (default {','.join(RUNTIMES)})")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "calibration.json"))
    args = parser.parse_args()
    runtimes = tuple(args.runtimes.split(","))
    if not set(runtimes) <= set(RUNTIMES):
        parser.error(f"--runtimes: choose from {', '.join(RUNTIMES)}")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for round_index in range(args.rounds):
            found = [row for w in args.worlds.split(",")
                     for row in measure_world(int(w), args.steps, args.quick, Path(directory), round_index, runtimes)]
            print(f"round {round_index + 1} of {args.rounds}")
            print_table(found)
            rows += found
    summary = pooled(rows)
    print("pooled over rounds")
    print_pooled(summary)
    Path(args.out).write_text(json.dumps({"rows": rows, "pooled": summary}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
