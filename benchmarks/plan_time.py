"""How long planning takes: capture and search times of built-in models on large clusters.

Runs ``autopar.plan`` offline (meta-device models, no processes) for each (model, cluster, batch,
sequence) row, and prints a table of capture time, search time, the chosen mesh and the solver's size;
writes the rows to ``benchmarks/results/plan_time.json``. Usage::

    python benchmarks/plan_time.py                 # llama3-8b and llama3-70b
    python benchmarks/plan_time.py --quick         # tiny models only (seconds)
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

from autopar.api import resolve_cluster
from autopar.ir.capture import capture
from autopar.models import build_model
from autopar.planning.search import make_plan

FULL = [
    ("llama3-8b", "2x8xH100", 64, 4096),
    ("llama3-70b", "16x8xH100", 512, 4096),
]
QUICK = [
    ("tiny-gpt", "1x4xcpu", 8, None),
    ("tiny-llama", "4x8xH100", 64, None),
]


def measure(name: str, cluster: str, batch: int, seq: int | None) -> dict:
    bundle = build_model(name, global_batch=batch, seq=seq, device="meta")
    start = time.perf_counter()
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    captured_at = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(captured, resolve_cluster(cluster), model_name=name)
    done = time.perf_counter()
    return {
        "model": name, "cluster": cluster, "global_batch": batch, "seq": seq,
        "nodes": len(captured.graph.nodes), "capture_s": captured_at - start, "search_s": done - captured_at,
        "total_s": done - start, "mesh": dict(zip(plan.mesh.dim_names, plan.mesh.shape)),
        "microbatches": plan.pipeline.microbatches, "meshes_tried": plan.solver["meshes_tried"],
        "variables": plan.solver["variables"], "step_time_s": plan.predicted["step_time_s"],
        "mfu": plan.predicted["mfu"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models only")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_time.json"))
    args = parser.parse_args()
    rows = [measure(*row) for row in (QUICK if args.quick else FULL)]
    header = f"{'model':<12} {'cluster':<11} {'batch':>5} {'seq':>5} {'nodes':>6} {'capture':>8} {'search':>8} " \
             f"{'total':>8}  {'mesh':<18} {'mb':>3} {'vars':>7} {'step':>9} {'MFU':>6}"
    print(header)
    for r in rows:
        mesh = "x".join(f"{k}{v}" for k, v in r["mesh"].items())
        print(f"{r['model']:<12} {r['cluster']:<11} {r['global_batch']:>5} {str(r['seq'] or '-'):>5} {r['nodes']:>6} "
              f"{r['capture_s']:>7.1f}s {r['search_s']:>7.1f}s {r['total_s']:>7.1f}s  {mesh:<18} "
              f"{r['microbatches']:>3} {r['variables']:>7} {r['step_time_s']:>8.3f}s {r['mfu'] * 100:>5.1f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
