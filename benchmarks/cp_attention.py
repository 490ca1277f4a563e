"""Context parallelism's two ways of attending over a split sequence, as the planner prices them.

For Llama 3 8B (two layers: the price per layer is what differs) at each sequence length, under a
pinned ``cp`` on one node (NVLink) and across nodes (one H100 per node: InfiniBand), the plan is made
three times: free (the ILP picks, ``plan.cp_attention``), pinned to the ring and pinned to the
all-gather (``--fix cp_attention=``). Per row: the choice, the predicted step of each way, the first
attention op's exposed communication under each (the ring's p2p, ``pricing.ring_exposed_s``; the
all-gather's gathers and reduce-scatters, its edges' included) and its kept activation bytes (the
gathered keys and values the all-gather keeps for backward). Prints a Markdown table and writes
``results/cp_attention.json``. Usage::

    python benchmarks/cp_attention.py            # cp 2 at 2k to 32k tokens, cp 8 at 8k to 128k (about 2 minutes)
    python benchmarks/cp_attention.py --quick    # cp 2, 2k and 32k
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

import autopar
from autopar.models import build_model

RESULTS = Path(__file__).parent / "results" / "cp_attention.json"


def _plan(seq: int, cluster: str, constraints: dict[str, Any]) -> autopar.Plan:
    bundle = build_model("llama3-8b", overrides={"layers": 2, "seq": seq}, global_batch=2, device="meta")
    return autopar.plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn, constraints,
                        example_targets=bundle.example_targets)


def _attention(plan: autopar.Plan) -> dict[str, Any]:
    return next(op for op in plan.ops.values() if "scaled_dot_product_attention" in op["op"])


def row(seq: int, cp: int, link: str) -> dict[str, Any]:
    cluster = f"1x{cp}xH100" if link == "nvlink" else f"{cp}x1xH100"
    free, ring, gather = (_plan(seq, cluster, {"cp": cp, **extra}) for extra in
                          ({}, {"cp_attention": "ring"}, {"cp_attention": "allgather"}))
    return {"seq": seq, "cp": cp, "link": link, "cluster": cluster, "chosen": free.cp_attention,
            "ring_step_s": ring.predicted["step_time_s"], "allgather_step_s": gather.predicted["step_time_s"],
            "ring_attention_comm_s": sum(_attention(ring)["cost"]["comm_s"].values()),
            "allgather_attention_comm_s": sum(_attention(gather)["cost"]["comm_s"].values()),
            "ring_attention_memory_bytes": _attention(ring)["cost"]["memory_bytes"],
            "allgather_attention_memory_bytes": _attention(gather)["cost"]["memory_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    grid = ([(s, 2) for s in (2048, 32768)] if args.quick else
            [(s, 2) for s in (2048, 8192, 32768)] + [(s, 8) for s in (8192, 32768, 131072)])
    rows = [row(seq, cp, link) for seq, cp in grid for link in ("nvlink", "ib")]
    print("| seq | cp | link | chosen | ring step | all-gather step | ring attn comm | all-gather attn comm "
          "| ring attn kept | all-gather attn kept |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq']} | {r['cp']} | {r['link']} | {r['chosen']} | {r['ring_step_s'] * 1e3:.2f} ms "
              f"| {r['allgather_step_s'] * 1e3:.2f} ms | {r['ring_attention_comm_s'] * 1e6:.0f} us "
              f"| {r['allgather_attention_comm_s'] * 1e6:.0f} us | {r['ring_attention_memory_bytes'] / 2**20:.0f} MiB "
              f"| {r['allgather_attention_memory_bytes'] / 2**20:.0f} MiB |")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                                   "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
