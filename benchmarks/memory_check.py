"""Predicted against measured memory per rank: a plan's ``peak_memory_bytes`` beside a real step on gloo.

For each row (a built-in model under pinned constraints on W local gloo ranks) every rank builds the
model, plans it for this machine (``autoparallelize``, cluster ``1xWxcpu``) for the DTensor runtime, or
for the lowered one where the row's constraints say ``runtime: lowered`` (FSDP's buckets and prefetch,
``passes/lower_buckets.py``), and trains: a warm-up step,
then one measured step, first with SGD (no momentum: no optimizer state) and then with Adam (a warm-up
step creates its state, then one measured step). A measured step is ``zero_grad(set_to_none=True)``,
``pm.step`` (forward, loss, backward, gradient sync) and ``opt.step()``, run inside
``autopar.testing.memory.LiveTensorBytes`` with this rank's parameters (local shards) and optimizer
state registered: the live bytes of every tensor storage, exactly, peak over the step. What is compared
with what:

* predicted (``plan.predicted``): ``params``, ``grads``, ``optimizer`` (AdamW: two fp32 moments, 8 bytes
  per element on a cpu cluster, where everything is priced in fp32; on GPUs the plan prices bf16
  parameters and gradients and 12 bytes of AdamW state per element, which a CPU run cannot check),
  ``activations`` (what autograd saves for backward, per op and strategy, held for the microbatches in
  flight, plus the largest op's working set) and their sum, the peak;
* measured: ``params``, ``grads`` (after backward) and ``optimizer`` (Adam's state after its step) as the
  storages of this rank's tensors; the peak of the forward+backward and of the optimizer step; Adam's
  measured peak beside the predicted peak (error %), and SGD's beside the predicted peak less the
  optimizer part (the plan prices AdamW; SGD keeps none);
* ``rss_growth``: how much this rank's resident set peaked above where it was when the measured Adam step began
  (``VmHWM`` after ``/proc/self/clear_refs``): the allocator's view, which reuses memory freed by the
  warm-up step, so it is usually below the live-tensor peak.

A pipeline plan's ranks hold different stages: the table shows the largest rank, the JSON every rank.
Prints a Markdown table and writes ``results/memory_check.json`` (after each world size). Usage::

    python benchmarks/memory_check.py            # every row (about 4 minutes on 2 cores)
    python benchmarks/memory_check.py --quick    # the two-rank rows of tiny-gpt
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

import torch

from autopar.api import autoparallelize
from autopar.core.plan import DTENSOR, LOWERED, MEMORY_PARTS
from autopar.testing.launch import run_on_ranks
from autopar.testing.memory import measure_step
from autopar.testing.parity import batches, build

RESULTS = Path(__file__).parent / "results" / "memory_check.json"
BATCH = 8
PARTS = MEMORY_PARTS  # the last, gathered, only where parameters are sharded over data parallelism

ROWS: dict[int, list[tuple[str, dict[str, Any]]]] = {  # world size -> (model, constraints)
    2: [("mlp", {"dp": 2, "fsdp": 0}), ("mlp", {"tp": 2}), ("mlp", {"dp": 2, "fsdp": 3}),
        ("tiny-gpt", {"dp": 2, "fsdp": 0}), ("tiny-gpt", {"dp": 2, "fsdp": 0, "checkpointing": "full"}),
        ("tiny-gpt", {"tp": 2}), ("tiny-gpt", {"dp": 2, "fsdp": 3}),
        ("tiny-gpt", {"pp": 2, "microbatches": 2, "schedule": "1f1b"}),
        ("tiny-llama", {"dp": 2, "fsdp": 0}), ("tiny-llama", {"tp": 2, "checkpointing": "selective"}),
        ("tiny-llama", {"pp": 2, "microbatches": 2, "schedule": "gpipe", "checkpointing": "full"}),
        ("tiny-llama", {"dp": 2, "fsdp": 3, "runtime": "lowered"}),
        ("tiny-llama", {"tp": 2, "sp": 1}), ("tiny-llama", {"tp": 2, "sp": 1, "runtime": "lowered"}),
        ("tiny-llama", {"dp": 2, "fsdp": 0, "microbatches": 2, "fp8": "tensorwise"}),
        ("tiny-llama", {"tp": 2, "fp8": "tensorwise"})],
    4: [("tiny-gpt", {"dp": 2, "tp": 2}), ("tiny-llama", {"dp": 2, "tp": 2, "fsdp": 3}),
        ("tiny-llama", {"dp": 2, "tp": 2, "fsdp": 3, "runtime": "lowered"})],
}
QUICK = {2: [row for row in ROWS[2] if row[0] == "tiny-gpt"]}


def _row_on_rank(name: str, constraints: dict[str, Any]) -> dict[str, Any]:
    bundle = build(name, None, BATCH, None, seed=0)
    lowered = constraints.get("runtime") == LOWERED  # else DTensor's, planned for it
    pm = autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                         example_targets=bundle.example_targets, constraints={"runtime": DTENSOR, **constraints},
                         lowered=lowered)
    warmup, batch = batches(bundle, 2, seed=0)
    sgd = measure_step(pm, lambda ps: torch.optim.SGD(ps, lr=0.01), warmup, batch)
    adam = measure_step(pm, lambda ps: torch.optim.Adam(ps, lr=1e-3), warmup, batch)
    return {"plan": {k: pm.plan.to_dict()[k] for k in ("degrees", "pipeline", "checkpointing", "predicted")},
            "sgd": sgd.to_json(), "adam": adam.to_json()}


def _rows_on_rank(rank: int, world: int, rows: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [_row_on_rank(name, constraints) for name, constraints in rows]


def _record(world: int, name: str, constraints: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    plan = per_rank[0]["plan"]
    predicted = plan["predicted"]
    largest = max(range(world), key=lambda r: per_rank[r]["adam"]["peak"])
    adam, sgd = per_rank[largest]["adam"], per_rank[largest]["sgd"]
    peak = predicted["peak_memory_bytes"]
    without_optimizer = peak - predicted["memory_bytes"]["optimizer"]
    return {"model": name, "world": world, "constraints": constraints,
            "degrees": {k: v for k, v in plan["degrees"].items() if v > 1},
            "microbatches": plan["pipeline"]["microbatches"], "checkpointing": plan["checkpointing"],
            "predicted": {**predicted["memory_bytes"], "peak": peak},
            "measured_rank": largest, "adam": adam, "sgd": sgd,
            "adam_error": adam["peak"] / peak - 1, "sgd_error": sgd["peak"] / without_optimizer - 1,
            "per_rank": [{"adam": r["adam"], "sgd": r["sgd"]} for r in per_rank]}


def _kib(n: float | None) -> str:
    return "-" if n is None else f"{n / 1024:,.1f}"


def _table(records: list[dict[str, Any]]) -> str:
    head = ("| model | plan | predicted params / grads / optimizer / activations / gathered | predicted peak | "
            "measured params / grads / Adam state | Adam peak (phase) | error | SGD peak | "
            "error vs peak less optimizer | RSS growth |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        plan = ", ".join(f"{k}={v}" for k, v in r["degrees"].items())
        plan += ", lowered" if r["constraints"].get("runtime") == LOWERED else ""
        plan += f", fp8={r['constraints']['fp8']}" if r["constraints"].get("fp8") else ""
        extra = [f"m={r['microbatches']}"] if r["microbatches"] > 1 else []
        extra += [r["checkpointing"]] if r["checkpointing"] != "none" else []
        p, a, s = r["predicted"], r["adam"], r["sgd"]
        phase = "optimizer" if a["optimizer_peak"] > a["step_peak"] else "fwd+bwd"
        lines.append(f"| {r['model']} | {plan}{' ' + ' '.join(extra) if extra else ''} | "
                     f"{' / '.join(_kib(p.get(k)) for k in PARTS)} | {_kib(p['peak'])} | "
                     f"{_kib(a['params'])} / {_kib(a['grads'])} / {_kib(a['optimizer'])} | "
                     f"{_kib(a['peak'])} ({phase}) | {r['adam_error'] * 100:+.0f}% | {_kib(s['peak'])} | "
                     f"{r['sgd_error'] * 100:+.0f}% | {_kib(a['rss_growth'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the two-rank rows of tiny-gpt")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    records = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for world, rows in (QUICK if args.quick else ROWS).items():
        per_rank = run_on_ranks(_rows_on_rank, world, rows)
        records += [_record(world, name, c, [ranks[i] for ranks in per_rank]) for i, (name, c) in enumerate(rows)]
        args.out.write_text(json.dumps({"measured": datetime.datetime.now().isoformat(timespec="minutes"),
                                        "torch": torch.__version__, "rows": records}, indent=1))
    print("sizes in KiB\n" + _table(records))


if __name__ == "__main__":
    main()
