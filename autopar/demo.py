"""``autopar demo``: plan a small GPT for this machine, train it on local gloo ranks, and check it.

The demo plans the built-in ``tiny-gpt`` for ``1xWxcpu`` (W local ranks), trains a few SGD steps
under that plan on W spawned gloo processes and, beside it, in a single process with the same seed and
global batches (``autopar.testing.parity``), then prints the plan, both loss curves, and the largest
differences of the losses, of the gradients after the first backward and of the final parameters.
A rank that raises or dies stops the others and ends the demo with one ``DistributedRunError`` naming it
(``autopar.testing.launch``), which the CLI prints as ``autopar demo: error: ...`` (exit 1).
"""

from __future__ import annotations

import time

from autopar.api import plan
from autopar.models import build_model
from autopar.testing.parity import max_abs_diff, train_parallel, train_single

MODEL = "tiny-gpt"
GLOBAL_BATCH = 8


def run_demo(world: int = 4, steps: int = 5) -> str:
    start = time.perf_counter()
    bundle = build_model(MODEL, global_batch=GLOBAL_BATCH, device="meta")
    the_plan = plan(bundle.model, bundle.example_inputs, f"1x{world}xcpu", bundle.loss_fn,
                    example_targets=bundle.example_targets, name=MODEL)
    planned = time.perf_counter()
    parallel = train_parallel(world, MODEL, None, GLOBAL_BATCH, None, steps, plan=the_plan.to_dict())
    reference = train_single(MODEL, None, GLOBAL_BATCH, None, steps)
    trained = time.perf_counter()
    lines = [the_plan.summary(), "", f"training {MODEL}: {steps} SGD steps, global batch {GLOBAL_BATCH}, "
             f"{world} gloo ranks vs 1 process", f"{'step':>4}  {'single process':>15}  {'autopar x' + str(world):>15}  {'|diff|':>9}"]
    for i, (a, b) in enumerate(zip(reference.losses, parallel.losses[0])):
        lines.append(f"{i:>4}  {a:>15.6f}  {b:>15.6f}  {abs(a - b):>9.2e}")
    loss_diff = max(abs(a - b) for a, b in zip(reference.losses, parallel.losses[0]))
    lines.append(f"max loss difference {loss_diff:.2e}; max gradient difference "
                 f"{max_abs_diff(reference.grads, parallel.grads):.2e}; max parameter difference "
                 f"{max_abs_diff(reference.params, parallel.params):.2e}; "
                 f"{parallel.redistributes} redistributes in the per-rank program")
    lines.append(f"planned in {planned - start:.1f} s, trained in {trained - planned:.1f} s")
    return "\n".join(lines)
