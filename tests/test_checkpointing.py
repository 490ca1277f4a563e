"""Activation checkpointing in the runtime (``autopar.passes.checkpoint``): the plan's ``checkpointing``
field changes what is recomputed in backward, never the numbers.

* one process, a 1-rank gloo group: the same plan in every mode gives the same loss and gradients;
  full recomputes every op of a layer in backward (matmuls and attention included), selective only
  the cheap ones, save_dot_except_mlpwi those and the MLP's input projection and attention,
  core_attention only the attention core (``QK^T`` and softmax of unfused attention, the fused kernel),
  cut out of the layer into its own checkpoint; checkpointing keeps fewer tensors for backward;
* memory, one process: core_attention holds fewer bytes than none after forward (the ``s x s``
  scores of unfused attention), and the plan predicts it keeps less, by no more than it does;
  selective, priced with microbatches under tp + sp, keeps less than none (its kept outputs were
  once priced for the whole batch, not one microbatch);
* a mixed plan (each layer its own mode) wraps only its recomputed layers, with the same numbers;
* gloo at world 4 (2x2 dp x tp, and dp=4): 3 SGD steps of tiny-gpt and tiny-llama under full,
  selective and mixed (the planner's per-layer choice under a memory limit) checkpointing match
  single-process training within docs/architecture.md "Correctness"'s tolerances (gradients after
  the first backward, per-step losses, final parameters). Each test is one spawn of two runs;
  2x2 is the mesh with collectives inside the recomputed layers; tiny-llama's (selective, full) is
  in the extended tier;
* gloo at world 2: core_attention on tiny-gpt with unfused attention (``attention=eager``, as
  gpt-megatron) and on tiny-llama, each under tp=2 with sequence parallelism and under dp=2 (tiny-llama
  as 2 pipeline stages too), and save_dot_except_mlpwi on tiny-llama under tp=2 + sp, match
  single-process training likewise; under
  tp=2 + sp a core_attention step runs the collectives of a step without recomputation, no more.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.api import autoparallelize, resolve_cluster
from autopar.core.constraints import Constraints
from autopar.core.plan import CHECKPOINTING
from autopar.ir.capture import CapturedGraph, capture
from autopar.models import ModelBundle, build_model
from autopar.testing.counters import CollectiveCounter
from autopar.testing.launch import run_on_ranks
from autopar.testing.memory import LiveTensorBytes
from autopar.testing.parity import batches, build, train_parallel_many, train_single
from autopar.passes.checkpoint import CheckpointedLayer, program_layers
from autopar.planning.search import make_plan
from autopar.runtime.parallel_module import ParallelModule, mesh_for_plan

STEPS = 3
BATCH = 8
MODES = CHECKPOINTING
EAGER = {"attention": "eager"}  # tiny-gpt with materialized scores, as gpt-megatron


# ---- one process ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A 1-rank gloo process group in this process (the runtime needs one to build its mesh)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gpt(one_rank_group: None) -> tuple[CapturedGraph, dict[str, Any]]:
    """tiny-gpt's captured step and its plan for one CPU (captured and planned once: that is slow)."""
    bundle = _bundle()
    captured = capture(bundle.model, tuple(bundle.example_inputs), bundle.example_targets, bundle.loss_fn)
    return captured, make_plan(captured, resolve_cluster("1x1xcpu"), model_name="tiny-gpt").to_dict()


@pytest.fixture(scope="module")
def eager_gpt(one_rank_group: None) -> tuple[CapturedGraph, dict[str, Any]]:
    """As ``gpt``, with unfused attention."""
    bundle = _bundle(EAGER)
    captured = capture(bundle.model, tuple(bundle.example_inputs), bundle.example_targets, bundle.loss_fn)
    return captured, make_plan(captured, resolve_cluster("1x1xcpu"), model_name="tiny-gpt").to_dict()


def _bundle(overrides: dict[str, Any] | None = None) -> ModelBundle:
    return build_model("tiny-gpt", global_batch=BATCH, device="cpu", seed=0, overrides=overrides)


def _module(gpt: tuple[CapturedGraph, dict[str, Any]], checkpointing: str, recomputed: dict[str, str] | None = None
            ) -> tuple[ParallelModule, tuple[torch.Tensor, ...]]:
    """A fresh tiny-gpt under its plan with ``checkpointing`` (and ``recomputed_layers``) set, and one
    training batch."""
    captured, plan = gpt
    the_plan = autopar.Plan.from_dict({**plan, "checkpointing": checkpointing, "recomputed_layers": recomputed or {}})
    bundle = _bundle(EAGER if _eager(captured) else None)
    pm = ParallelModule(bundle.model, captured, the_plan, mesh_for_plan(the_plan))
    return pm, batches(bundle, 1, seed=0)[0]


def _eager(captured: CapturedGraph) -> bool:
    return any(node.target is torch.ops.aten._softmax.default for node in captured.graph.nodes)


def test_checkpointing_wraps_each_layer_and_none_keeps_the_program(gpt: tuple[CapturedGraph, dict[str, Any]]) -> None:
    none, _ = _module(gpt, "none")
    assert not any(isinstance(m, CheckpointedLayer) for m in none.program.modules())
    for mode in ("full", "selective", "save_dot_except_mlpwi"):
        pm, _ = _module(gpt, mode)
        wrapped = [m for m in pm.program.modules() if isinstance(m, CheckpointedLayer)]
        assert [m.layer_name for m in wrapped] == ["blocks.0", "blocks.1"]
        assert {m.checkpointing for m in wrapped} == {mode}


def test_a_one_device_plan_runs_without_redistributes(gpt: tuple[CapturedGraph, dict[str, Any]]) -> None:
    """Every tensor is whole on one device (``strategies.fits_mesh``), so the program relabels none."""
    pm, batch = _module(gpt, "none")
    assert pm.redistributes == 0
    assert torch.isfinite(pm.step(*batch))


@pytest.mark.parametrize("model", ["gpt", "eager_gpt"])
def test_core_attention_checkpoints_each_attention_core_alone(model: str, request: pytest.FixtureRequest) -> None:
    """Megatron-LM's selective recomputation: one checkpoint per layer around its attention core (the
    fused kernel; or ``QK^T`` through ``AV``), the rest of the layer as under none."""
    pm, _ = _module(request.getfixturevalue(model), "core_attention")
    wrapped = [m for m in pm.program.modules() if isinstance(m, CheckpointedLayer)]
    assert [(m.layer_name, m.checkpointing) for m in wrapped] == [("blocks.0", "core_attention"),
                                                                   ("blocks.1", "core_attention")]
    ops = {str(node.target) for m in wrapped for node in m.layer.graph.nodes if node.op == "call_function"}
    assert not any(op.startswith(("aten.addmm", "aten.native_layer_norm", "aten.gelu")) for op in ops), ops


MIXED = {"blocks.1": "full"}  # a mixed plan: blocks.0 keeps its activations, blocks.1 recomputes
MIXED_CORE = {"blocks.0": "core_attention", "blocks.1": "full"}  # one layer's core cut out, the other wrapped


def test_mixed_checkpointing_wraps_only_the_recomputed_layers(gpt: tuple[CapturedGraph, dict[str, Any]]) -> None:
    pm, _ = _module(gpt, "mixed", MIXED)
    wrapped = [m for m in pm.program.modules() if isinstance(m, CheckpointedLayer)]
    assert [(m.layer_name, m.checkpointing) for m in wrapped] == [("blocks.1", "full")]


@pytest.mark.parametrize("model", ["gpt", "eager_gpt"])
def test_checkpointed_program_gives_the_same_loss_and_gradients(model: str, request: pytest.FixtureRequest) -> None:
    gpt = request.getfixturevalue(model)
    results = {}
    for mode in (*MODES, "mixed"):
        pm, batch = _module(gpt, mode, MIXED_CORE if mode == "mixed" else None)
        loss = pm.step(*batch)
        results[mode] = loss, {name: p.grad.full_tensor() for name, p in pm.named_parameters()}
    loss_none, grads_none = results["none"]
    for mode in (*MODES[1:], "mixed"):
        loss, grads = results[mode]
        torch.testing.assert_close(loss, loss_none, rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, grads_none[name], rtol=0, atol=0, msg=f"{mode}: {name}")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by packet name (``aten.addmm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops_and_saved(gpt: tuple[CapturedGraph, dict[str, Any]], checkpointing: str) -> tuple[Counter[str], int]:
    """Forward ops that run again during backward, and how many tensors forward saved for backward
    outside checkpointed regions (tensors saved inside them go to the checkpoint's own hooks)."""
    pm, batch = _module(gpt, checkpointing)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = pm.forward(*batch).to_local()
    with OpCounter() as counter:
        loss.backward()
    return counter.ops, len(saved)


def test_full_recomputes_every_layer_op_and_selective_keeps_matmuls(gpt: tuple[CapturedGraph, dict[str, Any]]) -> None:
    layer_forward_ops = ("aten.addmm", "aten._scaled_dot_product_flash_attention_for_cpu", "aten.gelu",
                         "aten.native_layer_norm")
    runs = {mode: _backward_ops_and_saved(gpt, mode) for mode in MODES}
    ops = {mode: {op.split(".")[1].strip("_"): counter[op] for op in layer_forward_ops}
           for mode, (counter, _) in runs.items()}
    layers = 2  # GELU's output is made again in backward without recomputation (ir/rematerialize.py)
    assert ops["none"] == {"addmm": 0, "scaled_dot_product_flash_attention_for_cpu": 0, "gelu": layers,
                           "native_layer_norm": 0}, ops["none"]
    assert all(ops["full"].values()), ops["full"]
    assert ops["selective"]["addmm"] == ops["selective"]["scaled_dot_product_flash_attention_for_cpu"] == 0
    assert ops["selective"]["gelu"] and ops["selective"]["native_layer_norm"], ops["selective"]
    # the MLP's input projection and attention of each layer, besides what selective recomputes
    assert ops["save_dot_except_mlpwi"] == {**ops["selective"], "addmm": layers,
                                            "scaled_dot_product_flash_attention_for_cpu": layers}
    assert ops["core_attention"] == {**ops["none"], "scaled_dot_product_flash_attention_for_cpu": layers}
    saved = {mode: n for mode, (_, n) in runs.items()}
    assert saved["full"] < saved["none"] and saved["selective"] < saved["none"], saved


def test_core_attention_of_unfused_attention_recomputes_scores_and_softmax_only(
        eager_gpt: tuple[CapturedGraph, dict[str, Any]]) -> None:
    """torch stops a recomputation once backward has what it needs: the ``QK^T`` batched matmul and the
    softmax run again, ``AV`` (whose output nothing in the core saves) does not."""
    counted = ("aten.bmm", "aten._softmax", "aten.addmm", "aten.gelu", "aten.native_layer_norm")
    none, core = ({op: _backward_ops_and_saved(eager_gpt, mode)[0][op] for op in counted}
                  for mode in ("none", "core_attention"))
    layers = 2
    assert core == {**none, "aten.bmm": none["aten.bmm"] + layers, "aten._softmax": layers}, (none, core)


def _held_after_forward(gpt: tuple[CapturedGraph, dict[str, Any]], checkpointing: str) -> int:
    """Bytes of the tensors a forward leaves alive for backward (the tracker sees the step's own)."""
    pm, batch = _module(gpt, checkpointing)
    pm.step(*batch)  # fills DTensor's caches, which would count as the step's
    tracker = LiveTensorBytes()
    with tracker:
        loss = pm.forward(*batch)
        held = tracker.current
    del loss
    return held


def _predicted_activations(gpt: tuple[CapturedGraph, dict[str, Any]], checkpointing: str) -> float:
    captured, _ = gpt
    plan = make_plan(captured, resolve_cluster("1x1xcpu"), model_name="tiny-gpt",
                     constraints=Constraints.from_mapping({"checkpointing": checkpointing}))
    return plan.predicted["memory_bytes"]["activations"]


@pytest.mark.parametrize("model", ["gpt", "eager_gpt"])
def test_core_attention_keeps_less_than_none_as_priced(model: str, request: pytest.FixtureRequest) -> None:
    """Unfused attention: the scores and softmax of every layer are dropped (measured) and priced as one
    layer's working set instead of every layer's (predicted: a smaller saving, never a larger one). Fused
    attention: only its log-sum-exp, as its output stays saved by the output projection (priced as
    none)."""
    gpt = request.getfixturevalue(model)
    measured = {mode: _held_after_forward(gpt, mode) for mode in ("none", "core_attention")}
    predicted = {mode: _predicted_activations(gpt, mode) for mode in ("none", "core_attention")}
    saved_measured = measured["none"] - measured["core_attention"]
    saved_predicted = predicted["none"] - predicted["core_attention"]
    assert 0 <= saved_predicted <= saved_measured, (measured, predicted)
    if model == "eager_gpt":
        layers, scores = 2, BATCH * 4 * 32 * 32 * 4  # batch x heads x seq x seq fp32: the softmax's output
        assert saved_measured == pytest.approx(layers * scores, rel=0.01), measured  # (the scalar fill stays kept)
        assert saved_predicted == pytest.approx((layers - 1) * scores, rel=0.01), predicted


def test_selective_keeps_less_than_none_with_microbatches_under_tensor_and_sequence_parallelism() -> None:
    """A Llama of 4 layers on 8 H100s, tp=4 with sequence parallelism, 4 microbatches: selective's kept
    linear outputs are one microbatch's (they were priced for the whole batch, 4x: more than none), and
    core_attention keeps at most none's. (Selective saves little here: without recomputation the norms'
    outputs and SwiGLU's are made again in backward already, ``ir/rematerialize.py``.)"""
    bundle = build_model("llama3-8b", global_batch=32, overrides=dict(layers=4, hidden=2048, heads=16, kv_heads=8,
                                                                      ffn_hidden=5632, vocab=32000, seq=2048))
    activations = {}
    for mode in ("none", "core_attention", "selective"):
        plan = autopar.plan(bundle.model, bundle.example_inputs, "1x8xH100", bundle.loss_fn,
                            example_targets=bundle.example_targets,
                            constraints={"tp": 4, "dp": 2, "sp": 1, "microbatch_size": 4, "checkpointing": mode})
        assert plan.pipeline.microbatches == 4
        activations[mode] = plan.predicted["memory_bytes"]["activations"]
    assert activations["selective"] < activations["none"], activations
    assert activations["core_attention"] <= activations["none"], activations


def test_inserted_nodes_join_the_layer_of_the_op_they_feed() -> None:
    """A redistribute (no module path) before an op of ``blocks.1`` is recomputed with ``blocks.1``."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = _op_in(graph, torch.relu, x, "model.blocks.0.mlp")
    moved = graph.call_function(torch.clone, (a,))  # as inserted by a pass: no nn_module_stack
    b = _op_in(graph, torch.neg, moved, "model.blocks.1.attn")
    head = _op_in(graph, torch.sum, b, "model.head")
    graph.output(head)
    layers = program_layers(graph)
    assert [layers[n] for n in (a, moved, b, head)] == ["blocks.0", "blocks.1", "blocks.1", None]


def _op_in(graph: fx.Graph, fn: Any, arg: fx.Node, path: str) -> fx.Node:
    node = graph.call_function(fn, (arg,))
    node.meta["nn_module_stack"] = {path: (path, object)}
    return node


# ---- gloo, 4 ranks ----------------------------------------------------------------------------------
FOUR_LAYERS = {"layers": 4}
MIXED_RUN = {"dp": 4, "fsdp": 0, "microbatches": 1, "memory_gb": 0.00475}
"""Memory between what tiny-gpt with 4 layers needs on dp=4 with full recomputation (4.14 MB) and
without (4.78 MB): the planner recomputes some layers only (``mixed``, selective on 3 of 4)."""
COVERAGE = {  # each model under both modes, each mode on both meshes; two runs per spawn keeps a test short
    "tiny-gpt": [({"dp": 2, "tp": 2, "checkpointing": "full"}, None), (MIXED_RUN, FOUR_LAYERS)],
    "tiny-llama": [({"dp": 2, "tp": 2, "checkpointing": "selective"}, None), ({"dp": 4, "checkpointing": "full"}, None)],
}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", ["tiny-gpt", pytest.param("tiny-llama", marks=pytest.mark.extended)])
def test_checkpointed_training_matches_single_process(name: str) -> None:
    runs = [dict(name=name, overrides=o, global_batch=BATCH, seq=None, steps=STEPS, plan=None, constraints=c)
            for c, o in COVERAGE[name]]
    results = train_parallel_many(4, runs)
    for (constraints, overrides), result in zip(COVERAGE[name], results):
        reference = train_single(name, overrides, BATCH, None, STEPS)
        assert result.plan["checkpointing"] == constraints.get("checkpointing", "mixed")
        result.assert_matches(reference)


# ---- gloo, 2 ranks ----------------------------------------------------------------------------------
RECOMPUTED_CORES = {  # (model overrides, constraints per run): one spawn per model
    "tiny-gpt": (EAGER, [{"tp": 2, "sp": 1, "checkpointing": "core_attention"},
                         {"dp": 2, "checkpointing": "core_attention"}]),
    "tiny-llama": (None, [{"tp": 2, "sp": 1, "checkpointing": "core_attention"},
                          {"dp": 2, "checkpointing": "core_attention"},
                          {"pp": 2, "microbatches": 2, "checkpointing": "core_attention"},
                          {"tp": 2, "sp": 1, "checkpointing": "save_dot_except_mlpwi"}]),
}
assert sorted(RECOMPUTED_CORES) == ["tiny-gpt", "tiny-llama"]  # the parametrization below names them


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", ["tiny-gpt", pytest.param("tiny-llama", marks=pytest.mark.extended)])
def test_core_attention_training_matches_single_process(name: str) -> None:
    overrides, cases = RECOMPUTED_CORES[name]
    runs = [dict(name=name, overrides=overrides, global_batch=BATCH, seq=None, steps=STEPS, plan=None, constraints=c)
            for c in cases]
    reference = train_single(name, overrides, BATCH, None, STEPS)
    for constraints, result in zip(cases, train_parallel_many(2, runs)):
        assert result.plan["checkpointing"] == constraints["checkpointing"]
        result.assert_matches(reference)


def _collectives_rank(rank: int, world: int) -> dict[str, dict[str, int]]:
    counts = {}
    for name, overrides in (("tiny-gpt", EAGER), ("tiny-llama", None)):
        for mode in ("none", "core_attention"):
            bundle = build(name, overrides, BATCH, None, seed=0)
            pm = autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets,
                                 constraints={"tp": 2, "sp": 1, "checkpointing": mode})
            batch = batches(bundle, 1, seed=0)[0]
            pm.step(*batch)
            with CollectiveCounter() as counter:
                pm.step(*batch)
            counts[f"{name} {mode}"] = counter.counts
    return counts


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.dist
def test_core_attention_runs_no_collective_again() -> None:
    """Megatron's selective recomputation re-runs no collective: the attention core of a tensor-parallel
    layer works on its heads, with sequence parallelism's gathers and reductions outside it."""
    counts = run_on_ranks(_collectives_rank, 2)[0]
    for name in ("tiny-gpt", "tiny-llama"):
        assert counts[f"{name} none"] and counts[f"{name} core_attention"] == counts[f"{name} none"], counts
