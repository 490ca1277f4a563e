"""Activation checkpointing in the runtime (``autopar.passes.checkpoint``): the plan's ``checkpointing``
field changes what is recomputed in backward, never the numbers.

* one process, a 1-rank gloo group: the same plan with ``none``, ``full`` and ``selective`` gives the
  same loss and gradients; full recomputes every op of a layer in backward (matmuls and attention
  included), selective only the cheap ones; checkpointing keeps fewer tensors for backward;
* a mixed plan (each layer its own mode) wraps only its recomputed layers, with the same numbers;
* gloo at world 4 (2x2 dp x tp, and dp=4): 3 SGD steps of tiny-gpt and tiny-llama under full,
  selective and mixed (the planner's per-layer choice under a memory limit) checkpointing match
  single-process training within docs/architecture.md "Correctness"'s tolerances (gradients after
  the first backward, per-step losses, final parameters). Each test is one spawn of two runs;
  2x2 is the mesh with collectives inside the recomputed layers.
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
from autopar.api import resolve_cluster
from autopar.ir.capture import CapturedGraph, capture
from autopar.models import ModelBundle, build_model
from autopar.testing.parity import batches, train_parallel_many, train_single
from autopar.passes.checkpoint import CheckpointedLayer, program_layers
from autopar.planning.search import make_plan
from autopar.runtime.parallel_module import ParallelModule, mesh_for_plan

STEPS = 3
BATCH = 8
MODES = ("none", "full", "selective")


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


def _bundle() -> ModelBundle:
    return build_model("tiny-gpt", global_batch=BATCH, device="cpu", seed=0)


def _module(gpt: tuple[CapturedGraph, dict[str, Any]], checkpointing: str, recomputed: dict[str, str] | None = None
            ) -> tuple[ParallelModule, tuple[torch.Tensor, ...]]:
    """A fresh tiny-gpt under its plan with ``checkpointing`` (and ``recomputed_layers``) set, and one
    training batch."""
    captured, plan = gpt
    the_plan = autopar.Plan.from_dict({**plan, "checkpointing": checkpointing, "recomputed_layers": recomputed or {}})
    bundle = _bundle()
    pm = ParallelModule(bundle.model, captured, the_plan, mesh_for_plan(the_plan))
    return pm, batches(bundle, 1, seed=0)[0]


def test_checkpointing_wraps_each_layer_and_none_keeps_the_program(gpt: tuple[CapturedGraph, dict[str, Any]]) -> None:
    none, _ = _module(gpt, "none")
    assert not any(isinstance(m, CheckpointedLayer) for m in none.program.modules())
    for mode in ("full", "selective"):
        pm, _ = _module(gpt, mode)
        wrapped = [m for m in pm.program.modules() if isinstance(m, CheckpointedLayer)]
        assert [m.layer_name for m in wrapped] == ["blocks.0", "blocks.1"]
        assert {m.checkpointing for m in wrapped} == {mode}


def test_a_one_device_plan_runs_without_redistributes(gpt: tuple[CapturedGraph, dict[str, Any]]) -> None:
    """Every tensor is whole on one device (``strategies.fits_mesh``), so the program relabels none."""
    pm, batch = _module(gpt, "none")
    assert pm.redistributes == 0
    assert torch.isfinite(pm.step(*batch))


MIXED = {"blocks.1": "full"}  # a mixed plan: blocks.0 keeps its activations, blocks.1 recomputes


def test_mixed_checkpointing_wraps_only_the_recomputed_layers(gpt: tuple[CapturedGraph, dict[str, Any]]) -> None:
    pm, _ = _module(gpt, "mixed", MIXED)
    wrapped = [m for m in pm.program.modules() if isinstance(m, CheckpointedLayer)]
    assert [(m.layer_name, m.checkpointing) for m in wrapped] == [("blocks.1", "full")]


def test_checkpointed_program_gives_the_same_loss_and_gradients(gpt: tuple[CapturedGraph, dict[str, Any]]) -> None:
    results = {}
    for mode in (*MODES, "mixed"):
        pm, batch = _module(gpt, mode, MIXED if mode == "mixed" else None)
        loss = pm.step(*batch)
        results[mode] = loss, {name: p.grad.full_tensor() for name, p in pm.named_parameters()}
    loss_none, grads_none = results["none"]
    for mode in ("full", "selective", "mixed"):
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
    ops = {mode: {op: counter[op] for op in layer_forward_ops} for mode, (counter, _) in runs.items()}
    assert not any(ops["none"].values()), ops["none"]
    assert all(ops["full"].values()), ops["full"]
    assert ops["selective"]["aten.addmm"] == ops["selective"]["aten._scaled_dot_product_flash_attention_for_cpu"] == 0
    assert ops["selective"]["aten.gelu"] and ops["selective"]["aten.native_layer_norm"], ops["selective"]
    saved = {mode: n for mode, (_, n) in runs.items()}
    assert saved["full"] < saved["none"] and saved["selective"] < saved["none"], saved


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
MIXED_RUN = {"dp": 4, "fsdp": 0, "microbatches": 1, "memory_gb": 0.00489}
"""Memory between what tiny-gpt with 4 layers needs on dp=4 with full recomputation (4.22 MB) and
without (5.11 MB): the planner recomputes some layers only (``mixed``, selective on 3 of 4)."""
COVERAGE = {  # each model under both modes, each mode on both meshes; two runs per spawn keeps a test short
    "tiny-gpt": [({"dp": 2, "tp": 2, "checkpointing": "full"}, None), (MIXED_RUN, FOUR_LAYERS)],
    "tiny-llama": [({"dp": 2, "tp": 2, "checkpointing": "selective"}, None), ({"dp": 4, "checkpointing": "full"}, None)],
}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(COVERAGE))
def test_checkpointed_training_matches_single_process(name: str) -> None:
    runs = [dict(name=name, overrides=o, global_batch=BATCH, seq=None, steps=STEPS, plan=None, constraints=c)
            for c, o in COVERAGE[name]]
    results = train_parallel_many(4, runs)
    for (constraints, overrides), result in zip(COVERAGE[name], results):
        reference = train_single(name, overrides, BATCH, None, STEPS)
        assert result.plan["checkpointing"] == constraints.get("checkpointing", "mixed")
        result.assert_matches(reference)
