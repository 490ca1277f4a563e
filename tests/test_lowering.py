"""The lowered runtime (``autoparallelize(..., lowered=True)``, ``passes/lower.py``) on gloo: the rank's
forward and backward run as graphs of local tensor ops with explicit functional collectives.

Numerical parity (docs/architecture.md "Correctness"): 3 SGD steps of the lowered program on 2 ranks
(data parallelism, in fp32 and in bf16 with bf16 gradient reductions, FSDP, FSDP with selective
checkpointing, tensor parallelism, tensor + sequence parallelism, ZeRO-2 with gradient accumulation)
and, in the extended tier, on 4 ranks (FSDP, dp x tp, HSDP) match
single-process training: gradients, losses and final parameters; the data-parallel and FSDP runs go
through the bucketing passes (``passes/lower_buckets.py``: gradient all_reduces in the backward graph,
one gather and one gradient reduce_scatter per layer). Collective parity: the collectives in the
lowered graphs are the ones that run (counted by ``CollectiveCounter``), the forward graph's are the
plan's forward prediction exactly, and the whole step's (graphs plus any gradient sync outside them)
are the plan's prediction kind by kind, both as the lowered program runs it (``lowered_prediction``:
each bucket of parameter gathers or gradient reduce_scatters counted once), up to the gap
``tests/test_collective_parity.py`` explains for the DTensor runtime, which the lowering inherits (it
traces that program). All runs of one world share one spawn of ranks (``_lowered_runs``), as
``tests/test_parity.py`` does. The bucketing passes are also tested alone on hand-made graphs.

The heavy tier compiles the lowered program with inductor (``compile=True``) and checks both parities
again; a program that cannot be traced runs unlowered with one warning. ``autoparallelize`` runs lowered by
default (``lowered_by_default``): expert and context parallelism (keys and values gathered) run so, to the
same numbers; ring attention and zero-bubble pipelines run on DTensor.
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

import pytest
import torch

from autopar.inspect.collectives import predicted_collectives
from autopar.passes.lower import COLLECTIVE_KINDS
from autopar.testing.parity import AutoparResult, train_single
from autopar.testing.counters import as_run_on_gloo
from test_collective_parity import BACKWARD_GAPS, SHARDED_GAPS

DISTRIBUTED = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3
BATCH = 8
CONFIGS = {2: [("tiny-gpt", {"dp": 2}), ("tiny-gpt", {"dp": 2, "fsdp": 3}), ("tiny-gpt", {"tp": 2}),
               ("tiny-gpt", {"tp": 2, "sp": 1}), ("tiny-gpt", {"dp": 2, "fsdp": 3, "checkpointing": "selective"}),
               ("tiny-llama", {"dp": 2, "fsdp": 2, "microbatches": 2}),
               ("tiny-gpt", {"dp": 2, "dtype": "bf16", "reduce_dtype": "bf16"})],
           4: [("tiny-gpt", {"dp": 4, "fsdp": 3}), ("tiny-llama", {"dp": 2, "tp": 2}),
               ("tiny-gpt", {"dp": 4, "fsdp": 3, "dp_shard": 2}), ("tiny-llama", {"dp": 2, "tp": 2, "fsdp": 3})]}
STEP_GAPS: dict[str, dict[str, int]] = {
    "tiny-gpt {'dp': 2}": BACKWARD_GAPS["tiny-gpt"],
    "tiny-gpt {'dp': 2, 'dtype': 'bf16', 'reduce_dtype': 'bf16'}": BACKWARD_GAPS["tiny-gpt"],
    "tiny-gpt {'dp': 4, 'fsdp': 3, 'dp_shard': 2}": SHARDED_GAPS["{'dp': 4, 'fsdp': 3, 'dp_shard': 2}"],
}
"""A step's collectives, counted minus predicted, per kind, where they differ: the lazy reduction of the
position embedding's gradient under data parallelism and HSDP (``tests/test_collective_parity.py``)."""
NOT_EXACT = {"tiny-llama {'dp': 2, 'tp': 2}", "tiny-llama {'dp': 2, 'fsdp': 2, 'microbatches': 2}",
             "tiny-llama {'dp': 2, 'tp': 2, 'fsdp': 3}"}
"""Configurations checked for numerical parity only: a 2-D mesh, whose backward the plan does not predict
exactly on the DTensor runtime either (DTensor's norm backward, ``tests/test_collective_parity.py``),
and gradient accumulation (collective parity counts one microbatch's forward). The 2-D mesh with FSDP
gathers parameters split on both dims twice, one dim after the other, and reduce-scatters their gradients so:
until 2026-12-07 its lowering failed there and it ran on DTensor."""


def _lowered_runs(rank: int, world: int, configs: list[tuple[str, dict]], compile: bool) -> list[dict[str, Any]]:
    return [_lowered_run(rank, name, constraints, compile) for name, constraints in configs]


def _lowered_run(rank: int, name: str, constraints: dict, compile: bool) -> dict[str, Any]:
    """Train the lowered (``compile``: and compiled) program ``STEPS`` steps (``train_module``), then
    count one forward's and one step's collectives and read the lowered graphs'."""
    import autopar
    from autopar.testing.counters import CollectiveCounter
    from autopar.testing.parity import batches, build, train_module

    from torch.distributed.tensor import DTensor

    bundle = build(name, None, BATCH, None, seed=0)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints=constraints, lowered=True,
                                 compile=compile)
    result = train_module(pm, bundle, STEPS, 0, rank)
    (batch,) = batches(bundle, 1, seed=0)
    forward_loss = None
    with CollectiveCounter() as forward:
        if pm.microbatches == 1:  # a forward pass takes one microbatch
            forward_loss = pm(*batch).to_local().item()
    for p in pm.parameters():  # a step onto held gradients would add partial ones to them, one all_reduce each
        p.grad = None
    with CollectiveCounter() as step:
        step_loss = pm.step(*batch).item()
    in_flight = torch._C._distributed_c10d._get_work_registry_size()  # collectives launched, never waited on
    once = {name: p.grad.to_local().clone() for name, p in pm.named_parameters()}
    direct, pm.program.direct = pm.program.direct, None  # the same step through AOT autograd's runtime wrapper
    for p in pm.parameters():
        p.grad = None
    through_aot = (pm.step(*batch).item(), {name: p.grad.to_local().clone() for name, p in pm.named_parameters()})
    pm.program.direct = direct
    pm.step(*batch)  # onto the gradients held: each adds the same again
    held_added = all(float((p.grad.to_local() - 2 * once[name]).abs().max()) <= 1e-5 * float(once[name].abs().max())
                     for name, p in pm.named_parameters())  # ZeRO-2 adds its microbatches' in another order
    return {**result, "forward": forward.counts, "step": step.counts, "graphs": pm.program.collectives(),
            "in_flight": in_flight, "held_added": held_added, "bucket_waits": _bucket_waits(pm.program),
            "gradient_storages": len({p.grad.to_local().untyped_storage().data_ptr() for p in pm.parameters()}),
            "buckets": pm.program.buckets[True], "fallback": pm.program.fallback, "forward_loss": forward_loss,
            "step_loss": step_loss, "waits": _waits(pm.program), "local_parameters": len(pm.program.local or {}),
            "dtensor_parameters": pm.program.dtensor_parameters, "direct": direct is not None,
            "direct_as_aot": through_aot[0] == step_loss
            and all(torch.equal(once[k], g) for k, g in through_aot[1].items()),
            "regathers": _regathers(pm.program),
            "parameters": len(list(pm.parameters())), "gradients_placed": all(
                isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in pm.parameters())}


def _waits(program: Any) -> dict[str, int]:
    """The waits on collectives in the lowered forward graph and in the loss's deferred end."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    graphs = {"forward": program.graphs.get(True, {}).get("forward"), "deferred": program.deferred.get(True)}
    return {name: len(gm.graph.find_nodes(op="call_function", target=wait)) for name, gm in graphs.items()
            if gm is not None}


def _regathers(program: Any) -> dict[str, int]:
    """In the lowered backward graph, the all_gathers AOT's partition recomputes (activations gathered again:
    ``passes/rematerialize.py``), and those of them a matmul runs beside, between their launch and their wait."""
    gm = program.graphs.get(True, {}).get("backward")
    if gm is None:
        return {}
    from torch.utils.checkpoint import CheckpointPolicy
    from torch.utils.flop_counter import flop_registry

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    computes = [order[n] for n in gm.graph.nodes if getattr(n.target, "overloadpacket", n.target) in flop_registry
                or n.target in (torch.mm, torch.addmm, torch.bmm)]  # ``call_through_bindings``' targets
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    gathers = [n for n in gm.graph.find_nodes(op="call_function", target=gather)
               if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE]
    beside = [g for g in gathers if any(order[g] < i < order[next(iter(g.users))] for i in computes)]
    return {"recomputed": len(gathers), "beside_a_matmul": len(beside)}


def _bucket_waits(program: Any) -> dict[str, int]:
    """In the lowered backward graph, the waits on gradient buckets (in-place all_reduces) left in the graph,
    and those left to the end of backward (``lower_buckets.defer_bucket_waits``)."""
    gm = program.graphs.get(True, {}).get("backward")
    if gm is None:
        return {}
    c10d = torch.ops._c10d_functional
    in_graph = [n for n in gm.graph.find_nodes(op="call_function", target=c10d.wait_tensor.default)
                if n.args[0].target is c10d.all_reduce_.default]
    return {"in_graph": len(in_graph), "at_backward_end": len(gm.graph.find_nodes(op="call_module"))}


def _spawned(world: int, configs: list[tuple[str, dict]], compile: bool = False) -> list[dict[str, Any]]:
    from autopar.testing.launch import run_on_ranks

    per_rank = run_on_ranks(_lowered_runs, world, configs, compile, timeout_s=900)
    return [{**per_rank[0][i], "ranks": [r[i] for r in per_rank]} for i in range(len(configs))]


class _RunsByWorld(dict):
    """Per world, per configuration: rank 0's run (and every rank's, under ``ranks``), spawned at the first
    test of that world, so a tier that runs only one world's cases spawns only its ranks."""

    def __missing__(self, world: int) -> list[dict[str, Any]]:
        self[world] = _spawned(world, CONFIGS[world])
        return self[world]


@pytest.fixture(scope="module")
def runs() -> _RunsByWorld:
    return _RunsByWorld()


def _cases(exact_only: bool = False) -> list[Any]:
    """The 2-rank configurations in the default tier; the 4-rank meshes, variants and compositions of them, in
    the extended tier."""
    return [pytest.param(world, i, id=f"{name}-{c}-w{world}",
                         marks=DISTRIBUTED + ([pytest.mark.extended] if world > 2 else []))
            for world, configs in CONFIGS.items()
            for i, (name, c) in enumerate(configs) if not (exact_only and f"{name} {c}" in NOT_EXACT)]


def _minus(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) - b.get(k, 0) for k in sorted(set(a) | set(b)) if a.get(k, 0) != b.get(k, 0)}


def _plus(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b)) if a.get(k, 0) + b.get(k, 0)}


@pytest.mark.parametrize("world, index", _cases())
def test_after_its_first_step_a_program_runs_its_graphs_directly_with_aots_losses_and_gradients(
        runs, world: int, index: int) -> None:
    """``lower_direct.DirectGraphs``: from its second call on, a program that reduces its gradients in its graphs
    (one microbatch a step: under gradient accumulation the sync runs after the graphs) and is not compiled
    calls its graphs without AOT autograd's runtime wrapper; a step so gives the loss and every gradient, bit
    for bit, that the same step through AOT's wrapper gives (that path is the one the parity tests hold
    against single-process training at the first step)."""
    run = runs[world][index]
    _, constraints = CONFIGS[world][index]
    assert run["direct"] == (constraints.get("microbatches", 1) == 1), run["direct"]
    assert run["direct_as_aot"]


@pytest.mark.parametrize("world, index", _cases())
def test_lowered_program_matches_single_process(runs, world: int, index: int) -> None:
    """Against single-process training (a bf16 plan: mixed precision done by hand, at bf16's tolerances)."""
    run = runs[world][index]
    name, constraints = CONFIGS[world][index]
    assert run["fallback"] is None, f"the program was not lowered: {run['fallback']}"
    AutoparResult.from_ranks(run["ranks"]).assert_matches(
        train_single(name, None, BATCH, None, STEPS, dtype=constraints.get("dtype")))


@pytest.mark.parametrize("world, index", _cases(exact_only=True))
def test_lowered_graphs_run_the_predicted_collectives(runs, world: int, index: int) -> None:
    name, constraints = CONFIGS[world][index]
    _assert_predicted_collectives(runs[world][index], f"{name} {constraints}")


@pytest.mark.heavy
@pytest.mark.dist
@pytest.mark.slow
def test_compiled_program_matches_single_process_and_keeps_the_collectives() -> None:
    """Inductor compiles the lowered graphs (a minute or two of C++ compilation per rank on 2 cores):
    the same numbers within parity's tolerances, the same collectives (inductor's in-place
    ``all_reduce_`` counted as ``all_reduce``)."""
    name, constraints = "tiny-gpt", {"tp": 2}
    (run,) = _spawned(2, [(name, constraints)], compile=True)
    assert run["fallback"] is None, f"the program was not compiled: {run['fallback']}"
    AutoparResult.from_ranks(run["ranks"]).assert_matches(train_single(name, None, BATCH, None, STEPS))
    run["forward"] = _as_plan_kinds(run["forward"])
    run["step"] = _as_plan_kinds(run["step"])
    _assert_predicted_collectives(run, f"{name} {constraints}")


PADDED_VOCAB = 1030
"""A vocabulary whose logits rows inductor pads (1,030 fp32 elements: a stride of at least
``padding_stride_threshold``, 1,024, not a multiple of its 32-element alignment, so 1,056)."""


def _padded_compiled_run(rank: int, world: int) -> dict[str, Any]:
    """``STEPS`` SGD steps of tiny-gpt with ``PADDED_VOCAB`` compiled, inductor padding strides on CPU
    as it does on GPUs (``disable_padding_cpu=False``)."""
    import torch._inductor.config as inductor_config

    import autopar
    from autopar.testing.parity import build, train_module

    bundle = build("tiny-gpt", {"vocab": PADDED_VOCAB}, BATCH, None, seed=0)
    with inductor_config.patch(disable_padding_cpu=False):
        pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                     example_targets=bundle.example_targets, constraints={"dp": world}, compile=True)
        result = train_module(pm, bundle, STEPS, 0, rank)
    return {**result, "fallback": pm.program.fallback, "compiled": pm.program.compile}


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_a_compiled_program_whose_forward_pads_what_it_saves_runs_its_backward() -> None:
    """On GPUs inductor pads a saved row of 50,257 bf16 logits to 50,304; the backward must be compiled
    for the strides the compiled forward chose (as ``torch.compile`` does, through its tracing context),
    else its first call fails asserting the unpadded ones (GPT-2 small on an H200 did, 2026-12-04). CPU
    pads too once asked to: one rank, the same numbers as single-process training."""
    from autopar.testing.launch import run_on_ranks

    ranks = run_on_ranks(_padded_compiled_run, 1, timeout_s=600)
    assert ranks[0]["compiled"] and ranks[0]["fallback"] is None
    AutoparResult.from_ranks(ranks).assert_matches(train_single("tiny-gpt", {"vocab": PADDED_VOCAB}, BATCH, None,
                                                                STEPS))


def _as_plan_kinds(counts: Mapping[str, int]) -> dict[str, int]:
    """``CollectiveCounter``'s counts with inductor's in-place collectives under their plan kinds."""
    out: dict[str, int] = {}
    for kind, n in counts.items():
        out[COLLECTIVE_KINDS.get(kind, kind)] = out.get(COLLECTIVE_KINDS.get(kind, kind), 0) + n
    return out


def _assert_predicted_collectives(run: Mapping[str, Any], config: str) -> None:
    """The lowered program's prediction is the plan's, each bucket of parameter gathers or gradient
    reduce_scatters (one per layer, or module outside layers, and kind) counted once
    (``lowered_prediction``)."""
    graphs, plan, buckets = run["graphs"], run["plan"], run["buckets"]
    assert run["forward"] == graphs["forward"], "the forward ran other collectives than its graph holds"
    assert graphs["forward"] == lowered_prediction(predicted_collectives(plan, ["forward"]), buckets, ["forward"])
    sync = _minus(run["step"], _plus(graphs["forward"], graphs["backward"]))
    assert set(sync) <= {"all_reduce"} and all(v > 0 for v in sync.values()), (
        f"outside the graphs a step may only all-reduce gradients; it ran {sync}")
    predicted = lowered_prediction(predicted_collectives(plan), buckets, ["forward", "backward"])
    assert _minus(run["step"], predicted) == STEP_GAPS.get(config, {}), (run["step"], predicted)


def lowered_prediction(predicted: Mapping[str, int], buckets: Mapping[str, Mapping[str, list[int]]],
                       graphs: list[str]) -> dict[str, int]:
    """The plan's collective counts as the lowered ``graphs`` run them: a bucket of n parameter gathers
    or gradient reduce_scatters (``LoweredProgram.buckets``) is one collective, so n - 1 fewer; a gather
    only summed whole (``summed_gather``: the loss's mean) is an all_reduce; the gradient all_reduces
    are the plan's buckets already (the same rule, ``gradient_sync.buckets``)."""
    merged = {kind: sum(n - 1 for g in graphs for n in buckets.get(g, {}).get(kind, []))
              for kind in ("all_gather", "reduce_scatter")}
    summed = sum(len(buckets.get(g, {}).get("summed_gather", [])) for g in graphs)
    counts = as_run_on_gloo(predicted)
    counts = {**counts, "all_reduce": counts.get("all_reduce", 0) + summed}
    merged["all_gather"] += summed
    return {k: v - merged.get(k, 0) for k, v in counts.items() if v - merged.get(k, 0)}


class _DataDependent(torch.nn.Module):
    """A program AOT autograd cannot trace: its branch depends on a value."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return ((x * 2).sum() if x.sum() > 0 else x.sum(),)


def test_a_program_that_cannot_be_traced_runs_unlowered_with_one_warning() -> None:
    from autopar.passes.lower import LoweredProgram

    program = LoweredProgram(_DataDependent(), parameters={})
    x = torch.ones(3, requires_grad=True)
    with pytest.warns(UserWarning, match="could not be lowered") as warned:
        (first,) = program(x)
        (second,) = program(x)
    assert len([w for w in warned if "could not be lowered" in str(w.message)]) == 1
    assert program.fallback and first.item() == second.item() == 6.0


# ---- the bucketing passes on hand-made graphs (no processes: a fake process group) ----------------
_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


def _call(graph: torch.fx.Graph, target: Any, *args: Any) -> torch.fx.Node:
    """A node of ``graph`` with the example value running ``target`` on its inputs' values gives."""
    node = graph.call_function(target, args)
    values = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    node.meta["val"] = target(*values)
    return node


def _placeholder(graph: torch.fx.Graph, name: str, value: torch.Tensor) -> torch.fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = value
    return node


def _index(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def test_gradient_reductions_are_bucketed_after_their_last_gradient_and_waited_at_the_end(two_fake_ranks) -> None:
    """Three marked gradients (one transposed, one in another dtype's reduction) of 48, 12 and 48
    fp32 elements, reduced in bf16 (2 bytes each) with 150-byte buckets: the first two share a bucket
    launched right after the second is produced (the gradients copied into it first), the third its
    own; both waited before the output; the values are what the marks compute (a fake group's
    all_reduce leaves them as they are)."""
    import torch.distributed as dist

    from autopar.passes.lower_buckets import REDUCE_GRADIENT, bucket_gradient_reductions

    group = dist.group.WORLD.group_name
    graph = torch.fx.Graph()
    x = _placeholder(graph, "x", torch.randn(4, 12))
    a = _call(graph, _aten.mul.Tensor, x, 2.0)
    b = _call(graph, _aten.sum.dim_IntList, x, [0])
    c = _call(graph, _aten.t.default, _call(graph, _aten.mul.Tensor, x, 3.0))
    marks = [_call(graph, REDUCE_GRADIENT, g, group, [2], torch.bfloat16) for g in (a, b, c)]
    graph.output(tuple(_call(graph, _aten.view.default, m, list(m.meta["val"].shape)) for m in marks))
    gm = torch.fx.GraphModule({}, graph)
    inputs = torch.randn(4, 12)
    expected = gm(inputs)

    assert bucket_gradient_reductions(gm, bucket_bytes=150) == [2, 1]
    reduces = [n for n in gm.graph.nodes if n.target is _c10d.all_reduce_.default]
    waits = [n for n in gm.graph.nodes if n.target is _c10d.wait_tensor.default]
    copies = [n for n in gm.graph.nodes if n.target is _aten.copy_.default]
    order = _index(gm)
    assert not any(n.target is REDUCE_GRADIENT for n in gm.graph.nodes)
    assert not any(n.target is _aten.cat.default for n in gm.graph.nodes), "gradients are copied into the bucket"
    assert [c.args[1] for c in copies] == [a, b, c]
    assert [order[r] > order[g] for r, g in zip(reduces, (b, c))] == [True, True]
    assert order[copies[1]] < order[reduces[0]] < order[copies[2]]
    assert order[reduces[0]] < order[c], "the first bucket waits for nothing it does not hold"
    assert all(order[w] > order[c] for w in waits)
    outputs = gm(inputs)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert outputs[2].is_contiguous(), "a transposed gradient leaves in its row-major layout (its parameter's)"


def test_a_bucket_read_only_through_its_views_is_waited_on_when_the_backward_pass_ends(two_fake_ranks) -> None:
    """Two gradients reduced in fp32 share a bucket whose views alone leave the graph: its wait becomes a call of
    ``waits_at_backward_end``; a third, reduced in bf16 and cast back, keeps its wait in the graph. Called outside
    autograd's engine the graph waits at once; inside a backward pass it hands the bucket on in flight and, once
    the pass ends, runs ``first`` and waits (nothing left registered), with the same values either way."""
    import torch.distributed as dist

    from autopar.passes.lower_buckets import (REDUCE_GRADIENT, WAITS_AT_BACKWARD_END, bucket_gradient_reductions,
                                              defer_bucket_waits)

    group = dist.group.WORLD.group_name
    graph = torch.fx.Graph()
    x = _placeholder(graph, "x", torch.randn(4, 12))
    grads = [_call(graph, _aten.mul.Tensor, x, 2.0), _call(graph, _aten.sum.dim_IntList, x, [0]),
             _call(graph, _aten.mul.Tensor, x, 3.0)]
    marks = [_call(graph, REDUCE_GRADIENT, g, group, [1], dtype)
             for g, dtype in zip(grads, (torch.float32, torch.float32, torch.bfloat16))]
    graph.output(tuple(marks))
    gm = torch.fx.GraphModule({}, graph)
    inputs = torch.randn(4, 12)
    expected = gm(inputs)
    assert bucket_gradient_reductions(gm) == [2, 1]
    finished: list[int] = []

    assert defer_bucket_waits(gm, lambda: finished.append(len(getattr(gm, WAITS_AT_BACKWARD_END).pending))) == 1
    waits = [n for n in gm.graph.nodes if n.target is _c10d.wait_tensor.default]
    assert len(waits) == 1 and len(gm.graph.find_nodes(op="call_module")) == 1
    assert waits[0].args[0].args[0].kwargs["dtype"] is torch.bfloat16, "the wait kept is the bf16 bucket's"
    for got, want in zip(gm(inputs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert finished == [], "outside a backward pass the graph waits at once"

    class _RunsTheGraphInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value):
            return value.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(gm(inputs))
            return grad

    seen: list[Any] = []
    leaf = torch.zeros(1, requires_grad=True)
    _RunsTheGraphInBackward.apply(leaf).sum().backward()
    assert finished == [1], "the pass's end ran ``first`` with the bucket still pending, then waited on it"
    assert not getattr(gm, WAITS_AT_BACKWARD_END).pending
    assert torch._C._distributed_c10d._get_work_registry_size() == 0
    for got, want in zip(seen[0], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_parameter_gathers_are_one_per_unit_prefetched_one_unit_ahead(two_fake_ranks) -> None:
    """Three parameters' gathers (one through a transposed copy), two in ``blocks.0`` and one in
    ``blocks.1``, each waited right before its use: one all_gather per unit; ``blocks.1``'s launched
    right after ``blocks.0``'s wait, before ``blocks.0``'s compute, and waited right before its first
    reader; the graph still runs, every value in its shape (a fake group gathers no data)."""
    import torch.distributed as dist

    from autopar.passes.lower_buckets import bucket_parameter_gathers

    group = dist.group.WORLD.group_name
    graph = torch.fx.Graph()
    w1 = _placeholder(graph, "primals_1", torch.randn(2, 4))
    w2 = _placeholder(graph, "primals_3", torch.randn(4, 2))
    w3 = _placeholder(graph, "primals_5", torch.randn(2, 4))
    x = _placeholder(graph, "primals_7", torch.randn(3, 4))

    def gathered(source: torch.fx.Node) -> torch.fx.Node:
        node = graph.call_function(_c10d.all_gather_into_tensor.default, (source, 2, group))
        node.meta["val"] = torch.cat([source.meta["val"]] * 2)
        wait = graph.call_function(_c10d.wait_tensor.default, (node,))
        wait.meta["val"] = node.meta["val"]
        return wait

    h = _call(graph, _aten.mm.default, x, _call(graph, _aten.t.default, gathered(w1)))
    transposed = _call(graph, _aten.clone.default, _call(graph, _aten.t.default, w2))
    h = _call(graph, _aten.mm.default, h, gathered(transposed))
    graph.output((_call(graph, _aten.mm.default, h, gathered(w3)),))
    gm = torch.fx.GraphModule({}, graph)

    units = {"primals_1": "blocks.0", "primals_3": "blocks.0", "primals_5": "blocks.1"}
    assert bucket_parameter_gathers(gm, units) == [2, 1]
    order = _index(gm)
    gathers = [n for n in gm.graph.nodes if n.target is _c10d.all_gather_into_tensor.default]
    waits = [n for n in gm.graph.nodes if n.target is _c10d.wait_tensor.default]
    mms = [n for n in gm.graph.nodes if n.target is _aten.mm.default]
    assert len(gathers) == len(waits) == 2
    assert order[waits[0]] < order[gathers[1]] < order[mms[0]], "blocks.1 is gathered while blocks.0 computes"
    assert order[mms[1]] < order[waits[1]] < order[mms[2]], "blocks.1 is waited on right before its use"
    (out,) = gm(torch.randn(2, 4), torch.randn(4, 2), torch.randn(2, 4), torch.randn(3, 4))
    assert out.shape == (3, 4)


def test_a_collective_of_inputs_alone_is_launched_first_and_waited_where_it_was() -> None:
    """An all_gather of a mask of the input is launched before the compute that precedes it, its wait
    left in place; one of a value computed from a parameter stays where it was."""
    from autopar.passes.lower_buckets import launch_from_inputs_first

    graph = torch.fx.Graph()
    w = _placeholder(graph, "primals_1", torch.randn(4, 4))
    x = _placeholder(graph, "primals_3", torch.randn(3, 4))
    h = _call(graph, _aten.mm.default, x, w)
    collectives = []
    for source in (_call(graph, _aten.ne.Scalar, x, 0.0), _call(graph, _aten.mul.Tensor, w, 2.0)):
        collectives.append(graph.call_function(_c10d.all_gather_into_tensor.default, (source, 2, "0")))
        graph.call_function(_c10d.wait_tensor.default, (collectives[-1],))
    graph.output((h,))
    gm = torch.fx.GraphModule({}, graph)

    assert launch_from_inputs_first(gm, {"primals_1"}) == 1
    order = _index(gm)
    waits = [n for n in gm.graph.nodes if n.target is _c10d.wait_tensor.default]
    assert order[collectives[0]] < order[h] < order[waits[0]]
    assert order[h] < order[collectives[1]]


def _regather(graph: torch.fx.Graph, source: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """An all_gather of ``source`` as AOT's partition recomputes it in backward (tagged ``MUST_RECOMPUTE``), and
    its wait."""
    from torch.utils.checkpoint import CheckpointPolicy

    gather = graph.call_function(_c10d.all_gather_into_tensor.default, (source, 2, "0"))
    gather.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return gather, graph.call_function(_c10d.wait_tensor.default, (gather,))


def test_a_regathered_activation_runs_beside_a_matmul() -> None:
    """A backward regather (sequence parallelism's norm output, gathered again for the weight gradient) is
    launched, with the op computing it from the saved shard, before the matmul ahead of it (an input gradient),
    its wait left in place; where that matmul computes its input, the next matmul that does not read it runs
    before its wait instead. One not tagged for recomputation (a gradient's gather, which the step needs at
    once), and one between a wait and the graph's end, stay."""
    from autopar.passes.lower_buckets import launch_regathers_ahead

    graph = torch.fx.Graph()
    grad, w = _placeholder(graph, "tangents_1", torch.randn(4, 4)), _placeholder(graph, "primals_1", torch.randn(4, 4))
    shard, scale = _placeholder(graph, "mul", torch.randn(2, 4)), _placeholder(graph, "rsqrt", torch.randn(2, 1))
    input_grad = _call(graph, _aten.mm.default, grad, w)
    normed = _call(graph, _aten.mul.Tensor, shard, scale)
    ahead, ahead_wait = _regather(graph, normed)
    weight_grad = graph.call_function(_aten.mm.default, (_call(graph, _aten.t.default, grad), ahead_wait))
    fed, fed_wait = _regather(graph, weight_grad)
    independent = _call(graph, _aten.mm.default, grad, w)
    another = _call(graph, _aten.mm.default, grad, w)
    gradient_gather = graph.call_function(_c10d.all_gather_into_tensor.default, (grad, 2, "0"))
    gradient_wait = graph.call_function(_c10d.wait_tensor.default, (gradient_gather,))
    blocked, blocked_wait = _regather(graph, shard)
    graph.output((input_grad, fed_wait, independent, another, gradient_wait, blocked_wait))
    gm = torch.fx.GraphModule({}, graph)

    assert launch_regathers_ahead(gm) == 2
    order = _index(gm)
    assert order[normed] < order[ahead] < order[input_grad] < order[ahead_wait] < order[weight_grad]
    assert order[weight_grad] < order[fed] < order[independent] < order[fed_wait]
    assert order[another] < order[gradient_gather] < order[gradient_wait] < order[blocked] < order[blocked_wait]


@pytest.mark.dist
@pytest.mark.slow
def test_a_sequence_parallel_backward_gathers_the_norm_outputs_again_beside_a_matmul(runs) -> None:
    """Under sequence parallelism the lowered backward gathers each layer's two normed inputs again (for the
    projections' and the MLP's weight gradients; ``passes/rematerialize.py``), and the final norm's output for
    the head's, each beside a matmul (``lower_buckets.launch_regathers_ahead``), as the plan prices them:
    beside backward's compute, in the gradient sync."""
    name, constraints = CONFIGS[2][3]
    assert (name, constraints) == ("tiny-gpt", {"tp": 2, "sp": 1})
    from autopar.models import build_model

    run = runs[2][3]
    layers = build_model(name).model.config.layers
    assert run["regathers"] == {"recomputed": 2 * layers + 1, "beside_a_matmul": 2 * layers + 1}


@pytest.mark.dist
@pytest.mark.slow
def test_a_data_parallel_step_reduces_the_loss_mean_without_gathering_tokens(runs) -> None:
    """Under data parallelism the lowered forward all-reduces the loss's two numbers (the sum of the
    per-token losses and the count of targets) and gathers nothing; the backward all-reduces the
    gradients' buckets and nothing else."""
    name, constraints = CONFIGS[2][0]
    assert (name, constraints) == ("tiny-gpt", {"dp": 2})
    run = runs[2][0]
    buckets = len(run["buckets"]["backward"]["all_reduce"])
    assert run["graphs"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": buckets}}
    assert run["buckets"]["forward"] == {"summed_gather": [1, 1]}


@pytest.mark.dist
@pytest.mark.slow
def test_the_forward_returns_before_the_losss_sum_is_reduced_and_step_reads_it_after_backward(runs) -> None:
    """Under data parallelism the lowered forward graph waits only on the count of targets (launched at
    its start, read by backward); the loss's all-reduced sum is waited on in the deferred graph, which
    ``step`` runs after backward and ``forward()`` before it returns: both report the same loss for the
    same batch on every rank."""
    run = runs[2][0]
    assert CONFIGS[2][0] == ("tiny-gpt", {"dp": 2})
    assert run["waits"] == {"forward": 1, "deferred": 1}
    for rank in run["ranks"]:
        assert rank["step_loss"] == rank["forward_loss"] == run["forward_loss"]


@pytest.mark.dist
@pytest.mark.slow
def test_gradient_buckets_are_waited_on_at_the_end_of_backward_after_their_gradients_are_filed(runs) -> None:
    """Where the gradients of a bucket leave the backward graph only as its views (data parallelism, FSDP's
    replicated parameters, tensor + sequence parallelism's norms), the graph waits on none of its buckets;
    each is waited on when autograd's engine ends the backward pass (``lower_buckets.defer_bucket_waits``),
    so nothing launched is left in flight after a step, and the gradients are views of the buckets (one
    storage for data parallelism's one bucket: accumulated into their leaves without a copy, which read
    the buffer before its wait). A step onto gradients already held waits before adding to them: the
    same gradients again. Where a cast reads the bucket after its reduction (bf16 reductions of fp32
    gradients) the wait stays in the graph."""
    deferred = {("tiny-gpt", "{'dp': 2}"), ("tiny-gpt", "{'dp': 2, 'fsdp': 3}"), ("tiny-gpt", "{'tp': 2, 'sp': 1}")}
    for (name, constraints), run in zip(CONFIGS[2], runs[2]):
        buckets = len(run["buckets"].get("backward", {}).get("all_reduce", []))
        if (name, str(constraints)) in deferred:
            assert buckets and run["bucket_waits"] == {"in_graph": 0, "at_backward_end": buckets}, (name, constraints)
        if constraints.get("reduce_dtype") == "bf16":
            assert run["bucket_waits"] == {"in_graph": buckets, "at_backward_end": 0}
        for rank in run["ranks"]:
            assert rank["in_flight"] == 0 and rank["held_added"], (name, constraints)
    assert runs[2][0]["gradient_storages"] == 1 < runs[2][0]["parameters"]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_parameters_the_graph_reduces_are_read_as_local_tensors_and_get_placed_gradients(runs, world: int) -> None:
    """Under data parallelism and FSDP (the gradient sync in the backward graph) every parameter is
    traced as its local tensor and its gradient stored as a DTensor in the parameter's placements, in
    the rank's first program as in those it traces after (each rank runs every configuration in one
    process: the bf16 plan is its seventh); under gradient accumulation (sync outside the graph, from the
    parameters' accumulation hooks) every parameter is read as its local tensor too, its gradient handed
    to the hooks unreduced (``hooked_gradients``); no trace with local parameters fails, and every
    configuration leaves each gradient in its parameter's placements."""
    all_local = [("tiny-gpt", {"dp": 2}), ("tiny-gpt", {"dp": 2, "fsdp": 3}),
                 ("tiny-gpt", {"dp": 2, "fsdp": 3, "checkpointing": "selective"}),
                 ("tiny-gpt", {"dp": 2, "dtype": "bf16", "reduce_dtype": "bf16"})]
    for (name, constraints), run in zip(CONFIGS[world], runs[world]):
        if (name, constraints) in all_local and world == 2:
            assert run["local_parameters"] == run["parameters"], (name, constraints)
        if constraints.get("microbatches", 1) > 1:
            assert run["local_parameters"] == run["parameters"], (name, constraints)
        assert run["dtensor_parameters"] is None, (name, constraints, run["dtensor_parameters"])
        assert run["gradients_placed"], (name, constraints)


def test_a_gather_summed_whole_becomes_an_all_reduce_of_the_local_sum(two_fake_ranks) -> None:
    """A gathered value read only by a sum of all its elements (through the slice that keeps every
    row) becomes the local sum, all-reduced where the gather was launched and waited where the sum
    was; a gather summed over one dim only stays (a fake group's all_reduce leaves the value as it is)."""
    import torch.distributed as dist

    from autopar.passes.lower_buckets import reduce_gathered_sums

    group = dist.group.WORLD.group_name
    graph = torch.fx.Graph()
    x = _placeholder(graph, "x", torch.randn(4, 3))
    gathered = []
    for source in (x, _call(graph, _aten.mul.Tensor, x, 2.0)):
        node = graph.call_function(_c10d.all_gather_into_tensor.default, (source, 2, group))
        node.meta["val"] = torch.cat([source.meta["val"]] * 2)
        wait = graph.call_function(_c10d.wait_tensor.default, (node,))
        wait.meta["val"] = node.meta["val"]
        gathered.append(wait)
    h = _call(graph, _aten.mul.Tensor, x, 3.0)
    total = _call(graph, _aten.sum.dim_IntList, _call(graph, _aten.slice.Tensor, gathered[0], 0, 0, 8), [])
    per_column = _call(graph, _aten.sum.dim_IntList, gathered[1], [0])
    graph.output((_call(graph, _aten.mul.Tensor, total, 2.0), per_column, h))
    gm = torch.fx.GraphModule({}, graph)

    assert reduce_gathered_sums(gm) == 1
    order = _index(gm)
    (reduce,) = [n for n in gm.graph.nodes if n.target is _c10d.all_reduce.default]
    assert len([n for n in gm.graph.nodes if n.target is _c10d.all_gather_into_tensor.default]) == 1
    assert reduce.args[0].target is _aten.sum.dim_IntList and reduce.args[0].args[0].name == "x"
    (wait,) = reduce.users
    assert order[reduce] < order[h] < order[wait]
    inputs = torch.randn(4, 3)
    torch.testing.assert_close(gm(inputs)[0], inputs.sum() * 2)


def test_simplifying_drops_ops_that_compute_nothing_and_keeps_the_values() -> None:
    """Identity views, detaches, a transpose of a transpose, a view of a view, a whole filled buffer
    cut to one piece and an attention forward no op reads: removed or made smaller; the outputs equal."""
    from autopar.passes.lower_simplify import simplify_local_ops

    graph = torch.fx.Graph()
    x = _placeholder(graph, "x", torch.randn(4, 6))
    q = _placeholder(graph, "q", torch.randn(1, 2, 4, 8))
    same = _call(graph, _aten.detach.default, _call(graph, _aten.view.default, x, [4, 6]))
    back = _call(graph, _aten.permute.default, _call(graph, _aten.t.default, same), [1, 0])
    twice = _call(graph, _aten.view.default, _call(graph, _aten.view.default, back, [24]), [6, 4])
    zeros = _call(graph, _aten.split.Tensor, _call(graph, _aten.new_zeros.default, x, [8, 6]), 4)
    piece = _call(graph, _aten.clone.default, _call(graph, operator.getitem, zeros, 0))
    _call(graph, _aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q, 0.0, True)
    graph.output((_call(graph, _aten.mm.default, twice, _call(graph, _aten.add.Tensor, back, piece)),))
    gm = torch.fx.GraphModule({}, graph)
    inputs = (torch.randn(4, 6), torch.randn(1, 2, 4, 8))
    expected = gm(*inputs)

    assert simplify_local_ops(gm) == 9
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [_aten.view.default, _aten.new_zeros.default, _aten.add.Tensor, _aten.mm.default]
    (fill,) = [n for n in gm.graph.nodes if n.target is _aten.new_zeros.default]
    assert list(fill.args[1]) == [4, 6]
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def test_aten_calls_made_through_torchs_bindings_give_the_same_values_and_gradients() -> None:
    """``call_through_bindings``: every overload of its table, traced from eager code, called through its
    binding instead; the graph's outputs and, run under autograd, its inputs' gradients are the same."""
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.passes.lower_simplify import _BINDINGS, call_through_bindings

    def every_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, table: torch.Tensor, ids: torch.Tensor):
        h = F.gelu(F.linear(x, w, b), approximate="tanh")  # linear, gelu
        h = torch.addmm(b, h.view(6, 4), w.t()) - torch.mm(h.view(6, 4), w.t()) / 3  # addmm, view, t, mm, sub, div
        s = torch.bmm(h.view(2, 3, 4), h.view(2, 3, 4).transpose(1, 2))  # bmm, transpose
        n = torch.native_layer_norm(h.permute(1, 0).clone(), [6], None, None, 1e-5)[0]  # permute, clone
        e = torch.embedding(table, ids) * -h.unsqueeze(0).expand(2, 6, 4).sum([0])  # embedding, mul, neg, sum
        buffer = torch.empty(24)
        buffer.copy_(e.reshape(24).detach() + e.reshape(24))  # copy_, detach, add
        parts = torch.split_with_sizes(buffer, [8, 16])
        return [s.sum() + n.sum() + parts[0].sum() * parts[1].sum()]

    torch.manual_seed(0)
    inputs = [torch.randn(6, 4), torch.randn(4, 4), torch.randn(4), torch.randn(10, 4), torch.randint(0, 10, (6,))]
    with torch.no_grad():
        gm = make_fx(every_op)(*inputs)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    x, w, b = [n for n in gm.graph.nodes if n.op == "placeholder"][:3]
    with gm.graph.inserting_before(output):  # a trace decomposes it; ``lower_eager.fuse_linear_layers`` makes it
        linear = gm.graph.call_function(_aten.sum.dim_IntList, (gm.graph.call_function(_aten.linear.default, (x, w, b)), []))
        total = gm.graph.call_function(_aten.add.Tensor, (output.args[0][0], linear))
    output.args = ([total],)
    gm.recompile()
    assert set(_BINDINGS) <= {n.target for n in gm.graph.nodes}, "the example calls every overload of the table"

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        (out,) = gm(*leaves)
        out.backward()
        return out.detach(), [leaf.grad for leaf in leaves[:4]]

    expected = run()
    calls = sum(n.target in _BINDINGS for n in gm.graph.nodes if n.op == "call_function")
    assert call_through_bindings(gm) == calls
    assert not set(_BINDINGS) & {n.target for n in gm.graph.nodes}
    out, grads = run()
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
    for got, want in zip(grads, expected[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_every_fused_attention_forward_no_op_reads_is_dropped_unless_it_draws_dropout() -> None:
    """The GPU kernels too (cuDNN's ran twice per layer on an H200 when only the CPU and flash kernels
    were known): an unread forward without dropout goes, one with dropout stays (it advances the
    generator). Not run, only simplified: the CUDA kernels have no CPU implementation."""
    from autopar.passes.lower_simplify import simplify_local_ops

    graph = torch.fx.Graph()
    q = _placeholder(graph, "q", torch.randn(1, 2, 4, 8))
    for kernel in (_aten._scaled_dot_product_cudnn_attention.default,
                   _aten._scaled_dot_product_efficient_attention.default):
        graph.call_function(kernel, (q, q, q, None, True, 0.0, True))
    graph.call_function(_aten._scaled_dot_product_flash_attention.default, (q, q, q, 0.0, True))
    kept = graph.call_function(_aten._scaled_dot_product_cudnn_attention.default, (q, q, q, None, True, 0.1))
    graph.output((q,))
    gm = torch.fx.GraphModule({}, graph)

    assert simplify_local_ops(gm) == 3
    assert [n for n in gm.graph.nodes if n.op == "call_function"] == [kept]


def test_the_first_gradient_bucket_is_ddps_one_megabyte_and_the_rest_the_bucket_size() -> None:
    """``gradient_sync.buckets`` (GradientSync's, the lowered graphs' and the plan's count): the first
    bucket closes past 1 MB, the later ones past the bucket size; a bucket size under 1 MB applies to
    every bucket."""
    from autopar.passes.gradient_sync import buckets

    mb = 2**20
    assert buckets([0.4 * mb, 0.4 * mb, 0.4 * mb, 10 * mb, 10 * mb, 10 * mb]) == [[0, 1], [2, 3, 4], [5]]
    assert buckets([60.0, 60.0, 60.0], bucket_bytes=150) == [[0, 1], [2]]


def test_the_losss_wait_and_what_follows_move_out_of_the_forward_graph(two_fake_ranks) -> None:
    """A loss = (all-reduced sum) / count, the count also saved for backward: the forward graph keeps
    the sum's launch and returns, in the loss's slot, an empty tensor, then the unwaited sum and the
    count; the graph returned waits and divides, giving the loss the graph computed before. An output
    computed with no wait stays."""
    import torch.distributed as dist

    from autopar.passes.lower_buckets import defer_output_waits

    group = dist.group.WORLD.group_name
    graph = torch.fx.Graph()
    x = _placeholder(graph, "x", torch.randn(4, 3))
    count = _call(graph, _aten.sum.default, _call(graph, _aten.ne.Scalar, x, 0.0))
    reduced = _call(graph, _c10d.all_reduce.default, _call(graph, _aten.sum.default, x), "sum", group)
    loss = _call(graph, _aten.div.Tensor, _call(graph, _c10d.wait_tensor.default, reduced), count)
    graph.output((loss, count))
    gm = torch.fx.GraphModule({}, graph)
    inputs = torch.randn(4, 3)
    (expected, _) = gm(inputs)

    epilogue = defer_output_waits(gm)
    assert epilogue is not None
    assert not [n for n in gm.graph.nodes if n.target is _c10d.wait_tensor.default]
    assert [n.target for n in epilogue.graph.nodes if n.op == "call_function"] == [_c10d.wait_tensor.default,
                                                                                   _aten.div.Tensor]
    empty, saved, *read = gm(inputs)
    assert empty.shape == expected.shape and len(read) == 2 and saved in read
    torch.testing.assert_close(epilogue(*read), expected, rtol=0, atol=0)
    assert defer_output_waits(gm) is None, "an output computed with no wait stays"


@pytest.mark.slow
def test_a_second_program_of_the_process_reads_its_parameters_as_local_tensors(two_fake_ranks) -> None:
    """Two lowered programs traced one after the other in one process (a data-parallel plan in fp32,
    then in bf16, each on a mesh of its own, equal to the other's): both trace their parameters as
    local tensors. Before ``lower._forget_propagated_meshes``, DTensor's sharding propagation cache
    handed the second program its loss on the first program's mesh and that trace failed."""
    import autopar
    from autopar.testing.parity import batches, build

    programs = []
    for constraints in ({"dp": 2}, {"dp": 2, "dtype": "bf16", "reduce_dtype": "bf16"}):
        bundle = build("tiny-gpt", None, BATCH, None, seed=0)
        pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                     example_targets=bundle.example_targets, constraints=constraints, lowered=True)
        pm.step(*batches(bundle, 1, seed=0)[0])
        programs.append(pm)
    first, second = programs
    assert first.mesh == second.mesh and first.mesh is not second.mesh
    for pm in programs:
        assert pm.program.fallback is None and pm.program.dtensor_parameters is None
        assert len(pm.program.local) == len(list(pm.parameters()))


# ---- the default runtime ----------------------------------------------------------------------------
LONG = {"seq": 256}
NO_DROP = {"drop_tokens": False}


def _plan(name: str, overrides: dict | None, cluster: str, constraints: dict) -> Any:
    import warnings

    import autopar
    from autopar.models import build_model

    bundle = build_model(name, overrides=overrides, global_batch=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn, constraints,
                            example_targets=bundle.example_targets)


def test_the_default_runtime_is_lowered_but_for_zero_bubble_and_ring_attention() -> None:
    """``autoparallelize(lowered=None)`` lowers what the lowered runtime runs, and leaves on DTensor the plans
    it would run there anyway: a zero-bubble pipeline and ring attention."""
    from autopar.api import lowered_by_default

    assert lowered_by_default(_plan("tiny-gpt", None, "1x2xcpu", {"dp": 2}))
    assert lowered_by_default(_plan("tiny-gpt", None, "1x2xcpu", {"pp": 2, "microbatches": 4, "schedule": "1f1b"}))
    assert lowered_by_default(_plan("tiny-llama", LONG, "1x2xcpu", {"cp": 2, "cp_attention": "allgather"}))
    assert not lowered_by_default(_plan("tiny-gpt", None, "1x2xcpu", {"pp": 2, "microbatches": 4,
                                                                     "schedule": "zero_bubble"}))
    assert not lowered_by_default(_plan("tiny-llama", LONG, "1x2xcpu", {"cp": 2, "cp_attention": "ring"}))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_by_default_expert_and_context_parallel_plans_run_lowered_and_ring_attention_on_dtensor() -> None:
    """``autoparallelize`` without ``lowered=``: expert parallelism (tiny-moe, ep=2: its all_to_alls in the
    graphs) and context parallelism gathering keys and values (tiny-llama at 256 tokens, cp=2) run lowered,
    with no fallback; ring attention runs on DTensor, never traced. Each matches single-process training."""
    from autopar.testing.parity import train_parallel_many

    runs = [("tiny-moe", NO_DROP, {"ep": 2}), ("tiny-llama", LONG, {"cp": 2, "cp_attention": "allgather"}),
            ("tiny-llama", LONG, {"cp": 2, "cp_attention": "ring"})]
    specs = [dict(name=name, overrides=overrides, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                  constraints=constraints, lowered=None) for name, overrides, constraints in runs]
    expert, gathered, ring = train_parallel_many(2, specs)
    for result in (expert, gathered):
        assert result.lowered["programs"] == 1 and not result.lowered["fallbacks"], result.lowered
        assert result.lowered["local_parameters"] > 0, result.lowered
    assert ring.lowered["programs"] == 0, ring.lowered
    for (name, overrides, _), result in zip(runs, (expert, gathered, ring)):
        result.assert_matches(train_single(name, overrides, BATCH, None, STEPS))
