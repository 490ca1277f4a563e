"""Memory: the live-bytes tracker is exact, a plan's predicted peak is near a real step's, and the runtime
refuses a plan its own prediction says cannot fit this device (docs/architecture.md "Correctness").

The gloo test spawns two ranks once: each builds tiny-gpt under a data-parallel plan made for this
machine and measures an Adam step (``autopar.testing.memory.measure_step``) on the default runtime
(lowered) and on DTensor, and under an FSDP plan on the default runtime; then tries the data-parallel plan
with its predicted peak raised above any host (refused with both numbers), and that plan again with
``check_memory=False`` (built). ``benchmarks/memory_check.py`` compares the other plans and models.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar.api import autoparallelize
from autopar.core.errors import NoFeasiblePlanError
from autopar.core.plan import Plan
from autopar.core.units import fmt_bytes
from autopar.passes.lower import LoweredProgram
from autopar.testing.launch import run_on_ranks
from autopar.testing.memory import LiveTensorBytes, measure_step
from autopar.testing.parity import batches, build

UNDER_PREDICTION = 0.05
"""How far the measured peak may exceed the predicted one: the plan prices what is held at once, not the
transient temporaries of one op (an optimizer's per-parameter scratch, a reduction's result), which add a
few per cent at most on tiny-gpt (``benchmarks/README.md``, "Memory"). A larger excess would let the
planner pick plans that run out of memory."""
OVER_PREDICTION = 0.15
"""How far the predicted peak may exceed the measured one: the plan adds every part's maximum as if all
were held at once (all gradients beside all saved activations, the loss's working set on top), which
overstates the data-parallel tiny-gpt step by about 9% on DTensor; more would mean the model counts something twice."""
UNDER_PREDICTION_UNDER_LOAD = {"fsdp, lowered": 0.12}
"""Runs whose peak depends on when gloo completes the collectives the program overlaps with compute: the
lowered FSDP step's prefetched all_gathers (``passes/lower_buckets.py``) hold more gathered bytes while a wait
is slow (rank 0 peaked at 2,644,528 B alone and at 2,939,440 B, 11% more, in a loaded test tier, 2026-12-07;
the plan predicts 2,777,476)."""
OVER_PREDICTION_ON_DTENSOR = {"ddp, DTensor": 0.2}
"""A plan priced for the lowered runtime (the default) run on DTensor: since the loss's ``gather`` makes its
gradient in its rows' placement (``passes/dtensor_backward.py``, 2026-12-07) DTensor's step no longer fills a
buffer of the whole batch's logits, and peaks 16.5% below the prediction (2,879,396 B against 3,449,220);
the lowered step it was priced for, 2% above (3,516,976 B)."""
TWO_DIM_FSDP_UNDER_PREDICTION = 0.2
"""The lowered dp x tp FSDP step's SGD peak above its prediction: +9% measured alone (2026-12-07,
``benchmarks/memory_check.py``), more where gloo completes the prefetched gathers late (as
``UNDER_PREDICTION_UNDER_LOAD``); +27% with every saved activation's gather launched at backward's start."""
SEQUENCE_PARALLEL_UNDER_PREDICTION = 0.1
"""The sequence-parallel tiny-llama step's SGD peak above its prediction: -4% on DTensor and +4% lowered,
measured alone (2026-12-07); +38% and +35% while the gathered norm outputs were held for backward."""
TOO_LARGE = 2**60  # bytes: more than any host has
RUNS = (("ddp, lowered", 0, None), ("ddp, DTensor", 0, False), ("fsdp, lowered", 3, None))
"""(name, ZeRO stage, ``lowered``) of the steps measured: data parallelism on the default runtime
(``lower_buckets._reduce_bucket``) and on DTensor, and FSDP on the default runtime, whose largest
gathered unit the plan holds (``problem.gathered_units``; without it the step peaked 11% above)."""


def test_tracker_counts_each_storage_once_and_frees_it_exactly() -> None:
    tracker = LiveTensorBytes()
    kept = torch.ones(100)  # made before: counted only once tracked
    tracker.track(kept, None, [kept])
    assert tracker.current == 400
    with tracker:
        a = torch.empty(1000)  # 4,000 bytes
        b = torch.empty(250, dtype=torch.float64)  # 2,000
        view = a.view(10, 100)  # shares a's storage: nothing new
        a.add_(1)  # in place: nothing new
        c = a + 1  # 4,000 more: 10,400 live, the peak
        del a, view
        assert tracker.current == 6400  # a's storage died with its last view
        d = torch.zeros(500)  # 2,000: 8,400, below the peak
        del c, b
    assert (tracker.current, tracker.peak) == (2400, 10400)
    tracker.reset_peak()
    assert tracker.peak == 2400 and d.numel() == 500


def _rank(rank: int, world: int) -> dict[str, Any]:
    bundle = build("tiny-gpt", None, 8, None, seed=0)
    args = (bundle.model, bundle.example_inputs)
    kwargs = dict(loss_fn=bundle.loss_fn, example_targets=bundle.example_targets)
    measured, plans = {}, {}
    for name, fsdp, lowered in RUNS:
        pm = autoparallelize(*args, constraints={"dp": world, "fsdp": fsdp}, lowered=lowered, **kwargs)
        warmup, batch = batches(bundle, 2, seed=0)
        plans[name] = pm.plan
        measured[name] = (pm.plan.predicted["peak_memory_bytes"],
                          measure_step(pm, lambda ps: torch.optim.Adam(ps, lr=1e-3), warmup, batch).peak)
    data = plans[RUNS[0][0]].to_dict()
    huge = Plan.from_dict({**data, "predicted": {**data["predicted"], "peak_memory_bytes": TOO_LARGE}})
    try:
        autoparallelize(*args, plan=huge, **kwargs)
        refused = None
    except NoFeasiblePlanError as exc:
        refused = str(exc)
    built = autoparallelize(*args, plan=huge, check_memory=False, **kwargs)
    return {"predicted": data["predicted"]["peak_memory_bytes"], "measured": measured, "refused": refused,
            "opted_out": built.plan.predicted["peak_memory_bytes"]}


@pytest.mark.dist
@pytest.mark.slow
def test_predicted_peak_is_near_the_measured_one_and_a_plan_too_large_is_refused() -> None:
    for r in run_on_ranks(_rank, 2):
        for name, (predicted, measured) in r["measured"].items():
            under = UNDER_PREDICTION_UNDER_LOAD.get(name, UNDER_PREDICTION)
            over = OVER_PREDICTION_ON_DTENSOR.get(name, OVER_PREDICTION)
            assert predicted * (1 - over) <= measured <= predicted * (1 + under), r
        message = r["refused"]
        assert message is not None, "a plan predicted to need 2**60 bytes per device was built"
        assert fmt_bytes(TOO_LARGE) in message and "shared by 2 ranks on this host" in message
        assert "cluster=None" in message and "check_memory=False" in message
        assert r["opted_out"] == TOO_LARGE


def _two_dim_fsdp_rank(rank: int, world: int) -> dict[str, Any]:
    bundle = build("tiny-llama", None, 8, None, seed=0)
    pm = autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                         example_targets=bundle.example_targets, constraints={"dp": 2, "tp": 2, "fsdp": 3})
    warmup, batch = batches(bundle, 2, seed=0)
    step = measure_step(pm, lambda ps: torch.optim.SGD(ps, lr=0.01), warmup, batch)
    predicted = pm.plan.predicted
    return {"lowered": _runs_lowered(pm), "params": step.params,
            "grads": step.grads, "peak": step.peak,
            "predicted": predicted["peak_memory_bytes"] - predicted["memory_bytes"]["optimizer"]}


def _runs_lowered(pm: Any) -> bool:
    """Whether ``pm`` runs its lowered program (not the DTensor program a failed lowering falls back to)."""
    return isinstance(pm.program, LoweredProgram) and pm.program.fallback is None


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.extended
def test_lowered_fsdp_over_tensor_parallel_shards_keeps_gradients_and_gathers_as_priced() -> None:
    """tiny-llama, dp=2 x tp=2 with FSDP on the lowered runtime: each gradient is its parameter's shard, not a
    view holding a whole reduce_scatter bucket (``lower_buckets._scatter_bucket``), and the SGD step peaks near
    the prediction: no backward that launches every saved activation's gather at its start, no parameter
    gathered whole where DTensor nests shards out of order (``pricing.redistribute_steps``). Before those
    three (2026-12-07): gradients 2.4x the parameters, the peak 32% over the prediction."""
    for r in run_on_ranks(_two_dim_fsdp_rank, 4):
        assert r["lowered"], r
        assert r["grads"] == r["params"], r
        assert r["peak"] <= r["predicted"] * (1 + TWO_DIM_FSDP_UNDER_PREDICTION), r


def _tensor_parallel_gradients(rank: int, world: int) -> dict[str, tuple[int, int]]:
    bundle = build("tiny-llama", None, 8, None, seed=0)
    found = {}
    for runtime, lowered in (("lowered", True), ("dtensor", False)):
        pm = autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                             example_targets=bundle.example_targets,
                             constraints={"tp": world, "checkpointing": "selective", "runtime": runtime},
                             lowered=lowered)
        warmup, batch = batches(bundle, 2, seed=0)
        step = measure_step(pm, lambda ps: torch.optim.SGD(ps, lr=0.01), warmup, batch)
        found[runtime] = (step.params, step.grads)
    return found


@pytest.mark.dist
@pytest.mark.slow
def test_gradients_of_a_mixed_reduction_bucket_are_no_larger_than_their_parameters() -> None:
    """tiny-llama, tp=2, selective checkpointing: the norm weights' gradients, partial on tp, share an
    all_reduce bucket with gradients that are cut to their parameter's shard after the reduction. Handed
    out as views, the norms' gradients held the whole bucket (on both runtimes, 2026-12-07: 305 KiB of
    gradients for 209 KiB of parameters); the gradient sync (``passes/gradient_sync.py``) and the lowered
    program's bucket (``lower_buckets._copied_out``) now copy them out where a member is cut."""
    for r in run_on_ranks(_tensor_parallel_gradients, 2):
        for runtime, (params, grads) in r.items():
            assert grads == params, (runtime, r)



def _sequence_parallel_rank(rank: int, world: int) -> dict[str, dict[str, int]]:
    bundle = build("tiny-llama", {"layers": 8, "seq": 128}, 8, 128, seed=0)
    found = {}
    for runtime, lowered in (("lowered", True), ("dtensor", False)):
        pm = autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                             example_targets=bundle.example_targets,
                             constraints={"tp": world, "sp": 1, "runtime": runtime}, lowered=lowered)
        warmup, batch = batches(bundle, 2, seed=0)
        step = measure_step(pm, lambda ps: torch.optim.SGD(ps, lr=0.01), warmup, batch)
        predicted = pm.plan.predicted
        found[runtime] = {"peak": step.peak, "sp": pm.plan.degrees.sp, "lowered": _runs_lowered(pm),
                          "predicted": predicted["peak_memory_bytes"] - predicted["memory_bytes"]["optimizer"]}
    return found


@pytest.mark.dist
@pytest.mark.slow
def test_sequence_parallel_steps_keep_the_sequence_shards_the_plan_prices() -> None:
    """tiny-llama of 8 layers at a sequence of 128, tp=2 with sequence parallelism, SGD: each layer's norm
    outputs are gathered whole for the projections that read them, which keep them for their weight
    gradients. The plan prices them split on the sequence, as they are made; the runtimes make the gathered
    copies again in backward from those shards (``passes/rematerialize.regathered_moves``). Holding them
    (2026-12-07), the step peaked 38% (DTensor) and 35% (lowered) over the prediction."""
    for r in run_on_ranks(_sequence_parallel_rank, 2):
        for runtime, step in r.items():
            assert step["sp"] == 2 and step["lowered"] == (runtime == "lowered"), (runtime, step)
            assert step["peak"] <= step["predicted"] * (1 + SEQUENCE_PARALLEL_UNDER_PREDICTION), (runtime, step)
