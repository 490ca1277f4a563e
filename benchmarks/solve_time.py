"""Solve time against model depth and world size (docs/architecture.md "Benchmarks").

Plans GPT models of Megatron-LM's shape (``gpt-megatron`` with ``layers``, ``hidden``, ``heads`` set)
offline, on meta tensors, without processes:

* depth sweep: one width at 8, 24, 48 and 96 layers on a fixed cluster;
* world sweep: one model on 64, 256, 1,024 and 4,096 H100s (8 to 512 nodes of 8), same global batch.

Per row it prints the capture time and the search time, and splits the search into its phases, timed
around the planner's own functions: building the per-mesh problem (strategies and pricing), repricing
it per microbatch count, staging it (pipeline and checkpointing), and the ILP (model build plus HiGHS);
then meshes solved and pruned, the ILP's size, the chosen degrees and the predicted step time. Writes
the rows to ``benchmarks/results/solve_time.json``. Usage::

    python benchmarks/solve_time.py                  # both sweeps (an hour or more on 2 shared cores)
    python benchmarks/solve_time.py --quick          # 2 depths, 2 world sizes
    python benchmarks/solve_time.py --profile        # also cProfile the largest world's search
    python benchmarks/solve_time.py --depths 8 --worlds   # one row
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import json
import pstats
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from autopar.planning import problem, search as planner
from autopar.ir.capture import CapturedGraph, capture
from autopar.cost_models import parse_cluster
from autopar.models import build_model
from autopar.core.plan import Plan

WIDTH = {"hidden": 2048, "heads": 16}  # 1.3B parameters at 24 layers (GPT-3 XL's width)
SEQ = 2048
DEPTH_CLUSTER, DEPTH_BATCH = "16x8xH100", 512
DEPTHS = (8, 24, 48, 96)
WORLD_LAYERS, WORLD_BATCH = 24, 4096
WORLDS = ("8x8xH100", "32x8xH100", "128x8xH100", "512x8xH100")
QUICK_DEPTHS, QUICK_WORLDS = (8, 24), ("8x8xH100", "128x8xH100")

PHASES = {  # phase name: (owner of the function, attribute); each is timed inclusive of what it calls
    "build_s": (planner, "problem_for"),
    "reprice_s": (problem.Problem, "with_microbatches"),
    "stage_s": (planner, "stage_problem"),
    "ilp_s": (planner, "solve"),
}


@contextlib.contextmanager
def timed_phases() -> Iterator[dict[str, float]]:
    """Wall seconds spent inside each of :data:`PHASES` while the block runs (wrappers restored after)."""
    spent: dict[str, float] = defaultdict(float)
    originals = {name: getattr(owner, attr) for name, (owner, attr) in PHASES.items()}

    def timing(name: str, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return wrapper

    for name, (owner, attr) in PHASES.items():
        setattr(owner, attr, timing(name, originals[name]))
    try:
        yield spent
    finally:
        for name, (owner, attr) in PHASES.items():
            setattr(owner, attr, originals[name])


def capture_gpt(layers: int, batch: int) -> tuple[CapturedGraph, float]:
    bundle = build_model("gpt-megatron", global_batch=batch, overrides={"layers": layers, **WIDTH, "seq": SEQ})
    start = time.perf_counter()
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    return captured, time.perf_counter() - start


def search(captured: CapturedGraph, cluster: str, profile: bool = False) -> tuple[Plan, float, dict[str, float], str]:
    """The plan, the search's wall seconds, its phases, and (with ``profile``) cProfile's top functions."""
    profiler = cProfile.Profile() if profile else None
    with timed_phases() as phases, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        plan = planner.make_plan(captured, parse_cluster(cluster), model_name="gpt-megatron")
        if profiler:
            profiler.disable()
        wall = time.perf_counter() - start
    return plan, wall, dict(phases), top_functions(profiler) if profiler else ""


def top_functions(profiler: cProfile.Profile, count: int = 25) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(count)
    return out.getvalue()


def row(sweep: str, layers: int, batch: int, cluster: str, captured: CapturedGraph, capture_s: float,
        profile: bool = False) -> dict[str, Any]:
    plan, search_s, phases, profiled = search(captured, cluster, profile)
    if profiled:
        print(profiled)
    solver = plan.solver
    return {
        "sweep": sweep, "layers": layers, "hidden": WIDTH["hidden"], "heads": WIDTH["heads"], "seq": SEQ,
        "global_batch": batch, "cluster": cluster, "devices": plan.cluster["devices"],
        "params": plan.model["params"], "nodes": len(captured.graph.nodes), "capture_s": capture_s,
        "search_s": search_s, **phases, "meshes_solved": len(plan.candidates),
        "meshes_pruned": len(solver["pruned_meshes"]), "decisions": solver["decisions"],
        "variables": solver["variables"], "constraints": solver["constraints"],
        "degrees": {k: plan.degrees[k] for k in ("pp", "dp", "tp", "fsdp")},
        "microbatches": plan.pipeline.microbatches, "checkpointing": plan.checkpointing,
        "step_time_s": plan.predicted["step_time_s"], "mfu": plan.predicted["mfu"],
    }


def depth_sweep(depths: tuple[int, ...], rows: list[dict[str, Any]], out: Path) -> None:
    for layers in depths:
        captured, capture_s = capture_gpt(layers, DEPTH_BATCH)
        record(rows, row("depth", layers, DEPTH_BATCH, DEPTH_CLUSTER, captured, capture_s), out)


def world_sweep(worlds: tuple[str, ...], profile: bool, rows: list[dict[str, Any]], out: Path) -> None:
    if not worlds:
        return
    captured, capture_s = capture_gpt(WORLD_LAYERS, WORLD_BATCH)
    for cluster in worlds:
        record(rows, row("world", WORLD_LAYERS, WORLD_BATCH, cluster, captured, capture_s,
                         profile and cluster == worlds[-1]), out)


def record(rows: list[dict[str, Any]], new: dict[str, Any], out: Path) -> None:
    """Print the row and rewrite the JSON with every row so far (a long run leaves its partial results)."""
    rows.append(new)
    print_row(new)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


HEADER = (f"{'sweep':<6} {'layers':>6} {'cluster':<11} {'nodes':>6} {'capture':>8} {'search':>8} {'build':>7} "
          f"{'reprice':>7} {'stage':>7} {'ilp':>7} {'solved':>6} {'pruned':>6} {'vars':>7}  {'degrees':<22} "
          f"{'mb':>3} {'ckpt':<9} {'step':>9} {'MFU':>6}")


def print_row(r: dict[str, Any]) -> None:
    d = r["degrees"]
    degrees = f"pp{d['pp']} dp{d['dp']} tp{d['tp']}" + (" fsdp" if d["fsdp"] > 1 else "")
    print(f"{r['sweep']:<6} {r['layers']:>6} {r['cluster']:<11} {r['nodes']:>6} {r['capture_s']:>7.1f}s "
          f"{r['search_s']:>7.1f}s {r['build_s']:>6.1f}s {r['reprice_s']:>6.1f}s {r['stage_s']:>6.1f}s "
          f"{r['ilp_s']:>6.1f}s {r['meshes_solved']:>6} {r['meshes_pruned']:>6} {r['variables']:>7}  {degrees:<22} "
          f"{r['microbatches']:>3} {r['checkpointing']:<9} {r['step_time_s']:>8.3f}s {r['mfu'] * 100:>5.1f}%",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two depths and two world sizes")
    parser.add_argument("--profile", action="store_true", help="cProfile the largest world's search")
    parser.add_argument("--depths", type=int, nargs="*", help=f"depth sweep's layer counts (default {DEPTHS})")
    parser.add_argument("--worlds", nargs="*", help=f"world sweep's clusters (default {WORLDS})")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "solve_time.json"))
    args = parser.parse_args()
    depths = tuple(args.depths) if args.depths is not None else QUICK_DEPTHS if args.quick else DEPTHS
    worlds = tuple(args.worlds) if args.worlds is not None else QUICK_WORLDS if args.quick else WORLDS
    print(HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    depth_sweep(depths, rows, Path(args.out))
    world_sweep(worlds, args.profile, rows, Path(args.out))


if __name__ == "__main__":
    main()
