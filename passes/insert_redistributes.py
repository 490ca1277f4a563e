"""Insert a redistribute before every op input whose placement the plan changes.

The plan gives each op the placements its tensor inputs must have (its strategy). Wherever the
producer's planned output differs, the pass inserts ``redistribute(x, placements)``: DTensor runs the
collective (all_gather, all_reduce, reduce_scatter, all_to_all, or a local slice) and its backward is
the dual collective. Ops whose inputs already match get no node, so the printed program shows exactly
where communication happens.

One redistribute per (value, placements, region): the readers of a value that need it in the same
placements within one region (``autopar.ir.layers.reader_regions``: a repeated layer, or the code
before or after the layers) read one redistribute node, inserted before the first of them. Under
sequence parallelism q, k and v read the sequence-split normed input through one all_gather, and
autograd sums their gradients before its one backward reduce_scatter (Megatron-LM's one "g" / "g-bar"
pair per attention); pricing charges such a move once (``autopar.planning.problem.SharedResharding``).
Readers in different regions get their own node, so a shared redistribute is recomputed with the
checkpointed layer that reads it (``checkpoint.py``) and never joins two pipeline stages
(``split_stages.py``: a region lies in one stage). A parameter gathered once for several readers is
still gathered again in backward for each reader that saved it (``reshard.py``).

Factory ops (no tensor inputs) produce plain tensors; the pass wraps them as replicated DTensors so
every value in the program is a DTensor.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from autopar.core.placement import strs_to_placements
from autopar.core.plan import Plan
from autopar.ir.capture import CapturedGraph
from autopar.ir.layers import reader_regions, tensor_inputs

from .layout import gradient_in_spec_layout, in_captured_layout, in_memory_order, memory_order


def redistribute(x: DTensor, placements: tuple[str, ...]) -> DTensor:
    """Move ``x`` to ``placements`` (no-op when it is there already).

    A change *to* a partial placement is left to the op's own DTensor dispatch, which turns a
    replicated input into the partial one its strategy needs without communication (public
    ``redistribute`` refuses it); we only bring such a dim to ``R`` first.
    """
    target = tuple(
        want if not want.is_partial() or have == want else Replicate()
        for have, want in zip(x.placements, strs_to_placements(placements))
    )
    if tuple(x.placements) == target:
        return x
    moved = x.redistribute(x.device_mesh, target)
    order = memory_order(x.to_local())
    if memory_order(moved.to_local()) == order:
        return moved
    # collectives return contiguous shards: restore the layout the captured graph saw, keeping the
    # redistribute's backward (a partial gradient reduce-scattered onto a shard) as DTensor runs it
    return in_memory_order(moved, order)


def as_replicated(x: Any, mesh: DeviceMesh) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return x


def insert_redistributes(
    gm: fx.GraphModule, ops: Mapping[str, Mapping[str, Any]], produced: Mapping[str, Sequence[str]],
    mesh: DeviceMesh,
) -> int:
    """Rewrite ``gm`` in place; returns how many redistribute nodes were inserted.

    ``produced`` maps a value (node name, or ``node.i`` for output i of a multi-output op) to the
    placements the plan says it has.
    """
    graph = gm.graph
    mesh_node = mesh_attr(gm, mesh)
    regions = reader_regions(graph)
    moves: dict[tuple[fx.Node, tuple[str, ...], str], fx.Node] = {}  # one per (value, placements, region)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.name not in ops:
            continue
        if not tensor_inputs(node):
            _wrap_factory(graph, node, mesh_node)
            continue
        wanted = [tuple(p) for p in ops[node.name]["inputs"]]
        for arg, placements in zip(tensor_inputs(node), wanted):
            if tuple(produced.get(value_name(arg), ())) == placements:
                continue
            key = (arg, placements, regions[node])
            if key not in moves:
                with graph.inserting_before(node):
                    moves[key] = graph.call_function(redistribute, (arg, placements))
            node.replace_input_with(arg, moves[key])
    moved_loss = _replicate_the_loss(graph, produced, mesh.ndim)
    graph.lint()
    gm.recompile()
    return len(moves) + moved_loss


def _replicate_the_loss(graph: fx.Graph, produced: Mapping[str, Sequence[str]], ndim: int) -> int:
    """Bring the loss the step returns to ``R`` on every mesh dim, as the planner's output decision reads it
    (``planning/problem.OUTPUT_KEY``, which prices this move): a loss the plan leaves partial (a mean over a
    batch split on an expert-parallel dim, ``Partial(avg)``) is reduced here, where each rank would
    otherwise return, and backpropagate from, its own share. Returns the redistributes inserted (0 or 1)."""
    output = graph.output_node()
    (loss,) = output.all_input_nodes
    whole = ("R",) * ndim
    if tuple(_placement_through_casts(loss, produced, whole)) == whole:
        return 0
    with graph.inserting_before(output):
        output.replace_input_with(loss, graph.call_function(redistribute, (loss, whole)))
    return 1


PLACED_AS_INPUT = (torch.ops.aten._to_copy.default, gradient_in_spec_layout, in_captured_layout)
"""Ops a program places as their first input where the plan has no placement of their own: a cast the plan
never saw (a program captured in a compute dtype may end in one: bf16's ``mse_loss`` upcasts, then casts its
mean back, which DTensor leaves placed as its input) and the layout guards put around reshaping views
(``layout.guard_view_gradients``). Here and in ``split_stages._planned``, which reads placements off the plan."""


def _placement_through_casts(node: fx.Node, produced: Mapping[str, Sequence[str]], default: Sequence[str]
                             ) -> Sequence[str]:
    """The planned placement of ``node``'s value, looking through ``PLACED_AS_INPUT`` nodes the plan never saw."""
    while value_name(node) not in produced and node.target in PLACED_AS_INPUT:
        node = node.args[0]
    return produced.get(value_name(node), default)


def produced_placements(captured: CapturedGraph, plan: Plan) -> dict[str, list[str]]:
    """Placement of every value as the plan produces it (parameters, buffers, inputs, op outputs; an
    output of a multi-output op as ``name.i``): what ``insert_redistributes`` reshards from."""
    produced: dict[str, list[str]] = {}
    for name, fqn in captured.params.items():
        produced[name] = plan.placements[fqn]
    for name, fqn in captured.buffers.items():
        produced[name] = plan.buffers[fqn]
    for name, spec in plan.inputs.items():
        produced[name] = spec["placements"]
    for name, op in plan.ops.items():
        outs = op["outputs"]
        if len(outs) == 1:
            produced[name] = outs[0]
        for i, out in enumerate(outs):
            if out is not None:
                produced[f"{name}.{i}"] = out
    return produced


MESH_ATTR = "autopar_mesh"


def mesh_attr(gm: fx.GraphModule, mesh: DeviceMesh) -> fx.Node:
    """A ``get_attr`` node for the mesh (FX code cannot spell a DeviceMesh as a constant)."""
    setattr(gm, MESH_ATTR, mesh)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target == MESH_ATTR:
            return node
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FX warns that a DeviceMesh is not a module/parameter/buffer
        return gm.graph.get_attr(MESH_ATTR)


def _wrap_factory(graph: fx.Graph, node: fx.Node, mesh: fx.Node) -> None:
    with graph.inserting_after(node):
        wrapped = graph.call_function(as_replicated, (node, mesh))
    wrapped.meta["val"] = node.meta.get("val")  # still the factory's value: readers match inputs by tensor_inputs
    node.replace_all_uses_with(wrapped, delete_user_cb=lambda user: user is not wrapped)


def value_name(arg: fx.Node) -> str:
    """The plan's name of the value ``arg`` carries: ``node.i`` for an output of a multi-output op, the
    factory op's own name through its ``as_replicated`` wrapper."""
    if arg.op == "call_function" and getattr(arg.target, "__name__", "") == "getitem":
        return f"{arg.args[0].name}.{arg.args[1]}"
    if arg.op == "call_function" and arg.target is as_replicated:
        return arg.args[0].name
    return arg.name
