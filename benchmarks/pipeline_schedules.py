"""Zero bubble against 1F1B on gloo: the same pipeline plan run under both schedules, step by step.

For a built-in model on ``--world`` gloo ranks (``pp = world``, one rank a stage), autopar plans the
pipeline once per schedule (``1f1b`` and ``zero_bubble`` pinned, the same microbatches), builds both
modules in one process group and runs their training steps alternately (forward, loss, backward,
gradient sync; no optimizer update), so a load change on the machine hits both alike; each step's time
is the slowest rank's. Prints each schedule's median and 10th-90th percentile step time in ms and the
plan's predicted bubble. On CPU ranks sharing cores the idle time a schedule saves is not idle (the
other ranks use the cores), so this measures what zero bubble's split backward costs more than the
bubble it saves; the bubble is what a device with its own compute would save::

    python benchmarks/pipeline_schedules.py --world 2 --microbatches 4 --steps 20 [--hidden 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from autopar.api import autoparallelize
from autopar.models import build_model
from autopar.testing.launch import run_on_ranks

SCHEDULES = ("1f1b", "zero_bubble")
WARMUP_STEPS = 2


def _rank(rank: int, world: int, model: str, overrides: dict[str, int], microbatches: int, steps: int
          ) -> dict[str, dict[str, object]]:
    bundle = build_model(model, overrides=overrides, global_batch=2 * microbatches, device="cpu", seed=0)
    modules = {s: autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                  example_targets=bundle.example_targets,
                                  constraints={"pp": world, "microbatches": microbatches, "schedule": s,
                                               "checkpointing": "none"}, lowered=False)
               for s in SCHEDULES}  # both on DTensor, where zero bubble runs: the schedules compared alone
    batch = (*bundle.example_inputs, bundle.example_targets)
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    for step in range(WARMUP_STEPS + steps):
        for schedule, module in modules.items():
            dist.barrier()
            start = time.perf_counter()
            module.step(*batch)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= WARMUP_STEPS:
                times[schedule].append(float(elapsed))
    bubbles = {s: m.plan.predicted["bubble_s"] for s, m in modules.items()}
    return {"times": times, "bubbles": bubbles}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", default="tiny-gpt")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=None, help="the model's hidden size (default: its own)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    overrides = {"layers": args.layers, **({"hidden": args.hidden} if args.hidden else {})}
    result = run_on_ranks(_rank, args.world, args.model, overrides, args.microbatches, args.steps)[0]
    print(f"{args.model} {overrides}, pp={args.world}, {args.microbatches} microbatches, {args.steps} steps")
    print("| schedule | median ms | p10-p90 ms | predicted bubble |")
    print("|---|---|---|---|")
    for schedule, samples in result["times"].items():
        deciles = statistics.quantiles(samples, n=10)
        print(f"| {schedule} | {1e3 * statistics.median(samples):.1f} | {1e3 * deciles[0]:.1f}-{1e3 * deciles[-1]:.1f} "
              f"| {1e3 * result['bubbles'][schedule]:.3g} ms |")


if __name__ == "__main__":
    main()
