"""``autopar.passes.build_program``, the one ordered list of graph passes, on tiny-gpt planned for
``1x2xcpu``, in one process: a fake 2-rank process group gives the meshes (no collective runs).

* an FSDP plan with full checkpointing: one stage program, the whole step; a redistribute before
  exactly the op inputs whose planned placement changes, moving them to the op's; every such move
  of a parameter turned into a gather made again in backward (the reshard pass ran after the
  insertion); the program runs under ``ResavedParameters`` around its checkpointed layers;
* a pipeline plan (pp=2): two stage programs whose outputs are the next one's inputs, with the same
  placements and the microbatch's shape on both sides, each parameter read by one stage only; run
  one after the other on the 1-rank stage mesh, they give the loss eager PyTorch computes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx
from torch.utils._pytree import tree_leaves

import autopar
from autopar.ir.capture import CapturedGraph, capture
from autopar.ir.layers import tensor_inputs
from autopar.models import ModelBundle, build_model
from autopar.passes import Program, build_program, shard_tensor
from autopar.passes.checkpoint import CheckpointedLayer
from autopar.passes.insert_redistributes import as_replicated, produced_placements, redistribute
from autopar.passes.layout import gradient_in_spec_layout, in_captured_layout
from autopar.passes.rematerialize import recomputed_op
from autopar.passes.reshard import ResavedParameters, gather_parameter, parameter_values
from autopar.passes.run_locally import run_local_op
from autopar.runtime.parallel_module import mesh_for_plan
from autopar.runtime.pipeline import pipeline_meshes

BATCH = 8
MOVES = (redistribute, gather_parameter)


@pytest.fixture(scope="module")
def gpt() -> ModelBundle:
    return build_model("tiny-gpt", global_batch=BATCH, device="cpu", seed=0)


def _plan(bundle: ModelBundle, constraints: dict[str, Any]) -> autopar.Plan:
    return autopar.plan(bundle.model, bundle.example_inputs, cluster="1x2xcpu", loss_fn=bundle.loss_fn,
                        example_targets=bundle.example_targets, constraints=constraints)


def _captured(bundle: ModelBundle, rows: int) -> CapturedGraph:
    """The step captured on the first ``rows`` rows of the batch (a pipeline program runs a microbatch)."""
    return capture(bundle.model, tuple(x[:rows] for x in bundle.example_inputs), bundle.example_targets[:rows],
                   bundle.loss_fn)


def _value_name(node: fx.Node) -> str:
    """The name a value has in ``produced_placements``: ``op.i`` for output i of a multi-output op."""
    if getattr(node.target, "__name__", "") == "getitem":
        return f"{node.args[0].name}.{node.args[1]}"
    return node.name


def _read_in_place_of(captured: fx.Node, rewritten: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(captured tensor input, the node the rewritten op reads in its place) for each input of an op; a view's
    layout guards (``layout.gradient_in_spec_layout``, ``in_captured_layout``, which pass values through) seen
    through."""
    local = recomputed_op(rewritten) is run_local_op  # run_locally made its args (op, mesh, outputs, layouts, *args)
    args = rewritten.args[4:] if local else rewritten.args
    pairs = zip(tree_leaves((captured.args, captured.kwargs)), tree_leaves((args, rewritten.kwargs)))
    return [(old, _unguarded(new)) for old, new in pairs if old in tensor_inputs(captured)]


def _unguarded(node: fx.Node) -> fx.Node:
    """The value ``node`` passes on: the guarded value for a layout guard (a view's gradient guard, a view's
    input laid out as traced), else ``node``."""
    while recomputed_op(node) in (gradient_in_spec_layout, in_captured_layout):  # made again in backward or not
        node = node.args[0]
    return node


def _reads_unmoved(old: fx.Node, new: fx.Node) -> bool:
    """Whether the rewritten op reads the captured value itself (a factory's output wrapped as a
    replicated DTensor included)."""
    return new.name == old.name or (new.target is as_replicated and new.args[0].name == old.name)


@pytest.fixture(scope="module")
def fsdp(two_fake_ranks: None, gpt: ModelBundle) -> tuple[autopar.Plan, CapturedGraph, Program]:
    plan = _plan(gpt, {"dp": 2, "fsdp": 3, "checkpointing": "full"})
    captured = _captured(gpt, BATCH)
    return plan, captured, build_program(plan, captured, mesh_for_plan(plan))


def test_a_plan_without_pipeline_is_one_stage_program_of_the_whole_step(fsdp) -> None:
    plan, captured, program = fsdp
    (stage,) = program.stages
    placeholders = [n.name for n in captured.graph.nodes if n.op == "placeholder"]
    assert stage.program.placeholders == placeholders
    assert (stage.program.inputs, stage.program.outputs, stage.received) == ([], [captured.loss_node], ())


def test_redistributes_move_exactly_the_inputs_whose_placement_changes(fsdp) -> None:
    plan, captured, program = fsdp
    produced = produced_placements(captured, plan)
    rewritten = {n.name: n for n in program.stages[0].program.graph_module.graph.nodes}
    moved = 0
    for node in captured.graph.nodes:
        if node.op != "call_function" or node.name not in plan.ops:
            continue
        for (old, new), wanted in zip(_read_in_place_of(node, rewritten[node.name]), plan.ops[node.name]["inputs"]):
            if _reads_unmoved(old, new):
                assert tuple(produced[_value_name(old)]) == tuple(wanted), f"{node.name} reads {old.name} unmoved"
                continue
            moves = recomputed_op(new) in MOVES and _unguarded(new.args[0]).name == old.name
            assert moves, f"{node.name}: {new.name} is not a move"
            assert tuple(new.args[1]) == tuple(wanted) != tuple(produced[_value_name(old)])
            moved += 1
    assert moved == program.redistributes > 0


def test_parameter_moves_become_gathers_made_again_in_backward_around_checkpointed_layers(fsdp) -> None:
    plan, captured, program = fsdp
    params = parameter_values(captured)
    moves = [n for n in program.stages[0].program.graph_module.graph.nodes if recomputed_op(n) in MOVES]
    gathers = [n for n in moves if n.target is gather_parameter]
    assert gathers and all(n.args[0].name in params for n in gathers)
    assert not [n for n in moves if n.target is redistribute and n.args[0].name in params]
    assert program.regathers_parameters
    module = program.stages[0].module
    assert isinstance(module, ResavedParameters)
    layers = [m.layer_name for m in module.program.modules() if isinstance(m, CheckpointedLayer)]
    assert layers == ["blocks.0", "blocks.1"]


@pytest.fixture(scope="module")
def pipeline(two_fake_ranks: None, gpt: ModelBundle) -> tuple[autopar.Plan, CapturedGraph, Program]:
    plan = _plan(gpt, {"pp": 2, "microbatches": 2})
    captured = _captured(gpt, BATCH // 2)
    _, stage_mesh = pipeline_meshes(plan)
    return plan, captured, build_program(plan, captured, stage_mesh)


def test_a_pipeline_plan_is_split_into_stage_programs_that_chain(pipeline) -> None:
    plan, captured, program = pipeline
    stages = program.stages
    assert [s.program.index for s in stages] == list(range(len(plan.pipeline["stages"]))) == [0, 1]
    assert stages[0].program.inputs == [] and stages[-1].program.outputs == [captured.loss_node]
    for sender, receiver in zip(stages, stages[1:]):
        assert sender.program.outputs == receiver.program.inputs and sender.program.outputs
        assert sender.sent == receiver.received
        assert all(b.shape[0] == BATCH // 2 for b in receiver.received), "values cross at the microbatch's shape"
    readers = [[s.program.index for s in stages if name in s.program.placeholders] for name in captured.params]
    assert all(len(r) == 1 for r in readers), "each parameter belongs to one stage"
    assert not program.regathers_parameters


@torch.no_grad()
def test_stage_programs_run_in_turn_give_the_eager_loss(pipeline, gpt: ModelBundle) -> None:
    plan, captured, program = pipeline
    _, mesh = pipeline_meshes(plan)
    rows = BATCH // 2
    inputs, targets = tuple(x[:rows] for x in gpt.example_inputs), gpt.example_targets[:rows]
    params, buffers = dict(gpt.model.named_parameters()), dict(gpt.model.named_buffers())
    values = {n: shard_tensor(params[fqn], mesh, plan.placements[fqn]) for n, fqn in captured.params.items()}
    values |= {n: shard_tensor(buffers[fqn], mesh, plan.buffers[fqn]) for n, fqn in captured.buffers.items()}
    values |= {n: shard_tensor(t, mesh, ["R"] * mesh.ndim) for n, t in captured.constants.items()}
    values |= {n: shard_tensor(x, mesh, plan.inputs[n]["placements"])
               for n, x in zip(captured.user_inputs, (*inputs, targets))}
    carried: tuple = ()
    for stage in program.stages:
        carried = stage.module(*carried, *(values[n] for n in stage.program.placeholders))
    (loss,) = carried
    torch.testing.assert_close(loss.full_tensor(), gpt.loss_fn(gpt.model(*inputs), targets), rtol=1e-6, atol=0)


def test_gradient_sync_makes_no_dtensor_conversion_per_gradient(two_fake_ranks: None, monkeypatch) -> None:
    """The sync reads each partial gradient's local tensor and wraps each reduced slice in a DTensor of a spec
    worked out once per gradient spec: no ``to_local`` or ``DTensor.from_local`` (autograd functions, 4.8 and
    21.3 us for a 128 x 128 gradient by ``timeit``), which pricing does not charge
    (``planning/pricing.Pricer._charge_gradient_collectives``). Two steps of two parameters: each gradient
    replicated, in the same spec object from step to step (worked out once per distinct gradient spec: the two
    weights' are equal, one entry)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from autopar.passes import GradientSync

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    weights = [torch.nn.Parameter(DTensor.from_local(torch.ones(4, 3), mesh, [Replicate()])) for _ in range(2)]
    sync = GradientSync(weights)
    specs = []
    for _ in range(2):
        x = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])  # the batch split on dp
        for w in weights:
            w.grad = None
        sum((x @ w).sum() for w in weights).backward()  # partial on dp
        with monkeypatch.context() as patched:
            for name in ("from_local", "to_local"):
                patched.setattr(DTensor, name, lambda *a, name=name, **k: pytest.fail(f"the sync called {name}"))
            sync()
        assert all(w.grad.placements == (Replicate(),) for w in weights)
        specs.append([w.grad._spec for w in weights])
    assert [a is b for a, b in zip(*specs)] == [True, True] and len(sync._specs) == 1


def test_armed_gradient_sync_files_each_gradient_after_its_last_accumulation(two_fake_ranks: None) -> None:
    """The pipeline runtime arms the sync for its m microbatches: a gradient joins its bucket (whose
    all_reduce starts once full, overlapping what backward is left) during the m-th backward that
    accumulates it, not before, and not only after backward; the sync then hands back gradients with the
    parameter's placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from autopar.passes import GradientSync

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    weight = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 3), mesh, [Replicate()]))
    sync = GradientSync([weight])
    sync.arm(3)
    filed = []
    for _ in range(3):
        x = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])  # the batch split on dp
        (x @ weight).sum().backward()  # the weight's gradient is partial on dp
        filed.append(sum(len(bucket) for bucket in sync._open.values()))
    assert filed == [0, 0, 1]
    sync()
    assert weight.grad.placements == (Replicate(),) and sync.collectives == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_copy_and_slice_scatter_replacements_compute_the_ops_values_and_derivatives(dtype: torch.dtype) -> None:
    """``passes/dtensor_backward.py``: ``aten.copy`` (no derivative of its own) broadcasts and casts ``src``
    into ``self``'s shape and dtype, its gradient summed back to ``src``; ``slice_scatter``'s derivatives are
    autograd's (here on plain tensors, which its own formula handles)."""
    from autopar.passes.dtensor_backward import copy_with_derivative, slice_scatter_keeping_dtensors

    dst = torch.randn(3, 4, 5, requires_grad=True)
    src = torch.randn(4, 1, dtype=dtype, requires_grad=True)
    weight = torch.randn(3, 4, 5)
    (copy_with_derivative(dst, src) * weight).sum().backward()
    reference = src.detach().clone().requires_grad_()
    (reference.expand(3, 4, 5).float() * weight).sum().backward()
    torch.testing.assert_close(copy_with_derivative(dst, src), src.expand(3, 4, 5).float())
    torch.testing.assert_close(src.grad, reference.grad)
    assert src.grad.dtype == dtype and torch.equal(dst.grad, torch.zeros_like(dst))

    base, part = torch.randn(2, 8, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    mine = slice_scatter_keeping_dtensors(base, part, 1, 2, 8, 2)
    (mine * weight.flatten()[:16].view(2, 8)).sum().backward()
    grads = base.grad.clone(), part.grad.clone()
    base.grad = part.grad = None
    theirs = torch.slice_scatter(base, part, 1, 2, 8, 2)
    (theirs * weight.flatten()[:16].view(2, 8)).sum().backward()
    torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(grads, (base.grad, part.grad))


def test_a_losss_gather_makes_its_gradient_in_its_rows_placement(two_fake_ranks: None) -> None:
    """``passes/dtensor_backward.gather_with_placed_gradient``: a loss picks each row's target with ``gather``
    from log-probabilities split on the batch (dp), and its gradient, the mean's replicated scalar expanded,
    comes back to each rank as its own rows: no buffer of the whole batch's (8 rows, where a rank holds 4) is
    made, as ``aten.gather``'s own derivative makes on DTensor, and the rows' gradient is single-process
    training's (the mean over all 8 rows)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.passes.dtensor_backward import gather_with_placed_gradient

    class Made(TorchDispatchMode):  # the shapes of the real (local) tensors the ops make
        def __init__(self) -> None:
            super().__init__()
            self.shapes: list[tuple[int, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and not isinstance(out, torch._subclasses.FakeTensor):
                self.shapes.append(tuple(out.shape))
            return out

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    rows, targets = torch.randn(4, 8), torch.randint(0, 8, (4, 1))  # this rank's half of 8 rows
    logits = DTensor.from_local(rows.clone(), mesh, [Shard(0)]).requires_grad_()
    picked_by = DTensor.from_local(targets, mesh, [Shard(0)])
    made = Made()
    with made:
        loss = -gather_with_placed_gradient(torch.log_softmax(logits, -1), 1, picked_by).mean()
        loss.backward()
    assert logits.grad.placements == (Shard(0),) and logits.grad.to_local().shape == (4, 8)
    assert (8, 8) not in made.shapes, made.shapes
    reference = rows.clone().requires_grad_()
    (-torch.gather(torch.log_softmax(reference, -1), 1, targets).sum() / 8).backward()
    torch.testing.assert_close(logits.grad.to_local(), reference.grad)
