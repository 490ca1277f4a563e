"""Activation checkpointing modes, predicted against measured: the activations a plan prices beside the
bytes a real step holds, per mode (``autopar.core.plan.CHECKPOINTING``), on one process.

For each model (tiny-gpt with unfused attention, as gpt-megatron; tiny-gpt and tiny-llama with fused
attention) the step is captured once, planned for one CPU with each mode pinned, and run under
``autopar.testing.memory.LiveTensorBytes`` after a warm-up step: ``held`` is what the forward leaves
alive for backward (the saved activations and the loss), ``peak`` the most the forward and backward
hold at once (gradients included; parameters are not counted), beside the plan's
``memory_bytes.activations`` (saved activations, the recompute working set of one layer and the
largest op's working set) and its predicted step time. Prints a Markdown table and writes
``results/checkpointing_memory.json``. Usage::

    python benchmarks/checkpointing_memory.py      # about a minute on 2 cores
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.api import resolve_cluster
from autopar.core.constraints import Constraints
from autopar.core.plan import CHECKPOINTING
from autopar.ir.capture import capture
from autopar.models import build_model
from autopar.planning.search import make_plan
from autopar.runtime.parallel_module import ParallelModule, mesh_for_plan
from autopar.testing.memory import LiveTensorBytes
from autopar.testing.parity import batches

RESULTS = Path(__file__).parent / "results" / "checkpointing_memory.json"
BATCH = 8
MODELS = [("tiny-gpt", {"attention": "eager"}), ("tiny-gpt", {}), ("tiny-llama", {})]


def measure(name: str, overrides: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per checkpointing mode of ``name``: predicted activations and step time, measured bytes."""
    bundle = build_model(name, global_batch=BATCH, device="cpu", seed=0, overrides=overrides)
    captured = capture(bundle.model, tuple(bundle.example_inputs), bundle.example_targets, bundle.loss_fn)
    rows = []
    for mode in CHECKPOINTING:
        plan = make_plan(captured, resolve_cluster("1x1xcpu"), model_name=name,
                         constraints=Constraints.from_mapping({"checkpointing": mode}))
        fresh = build_model(name, global_batch=BATCH, device="cpu", seed=0, overrides=overrides)
        pm = ParallelModule(fresh.model, captured, plan, mesh_for_plan(plan))
        batch = batches(fresh, 1, seed=0)[0]
        pm.step(*batch)  # warm-up: DTensor's caches
        for p in pm.parameters():
            p.grad = None
        tracker = LiveTensorBytes()
        with tracker:
            loss = pm.forward(*batch)
            held = tracker.current
            loss.to_local().backward()
        rows.append({"model": name, "overrides": overrides, "mode": mode, "held": held, "peak": tracker.peak,
                     "predicted_activations": plan.predicted["memory_bytes"]["activations"],
                     "predicted_step_s": plan.predicted["step_time_s"]})
    return rows


def main() -> None:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        rows = [row for name, overrides in MODELS for row in measure(name, overrides)]
    finally:
        dist.destroy_process_group()
    print("| model | mode | measured held after forward (B) | measured peak (B) | predicted activations (B) | "
          "predicted step (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        model = r["model"] + (" (unfused attention)" if r["overrides"] else "")
        print(f"| {model} | {r['mode']} | {r['held']:,} | {r['peak']:,} | {r['predicted_activations']:,.0f} | "
              f"{r['predicted_step_s'] * 1e3:.3f} |")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
