"""Split the program into pipeline stage programs: one graph per model chunk, chained by the values
that cross from one chunk to the next.

A pipeline plan (``degrees["pp"] = p``) lists ``p v`` layer ranges in ``plan.pipeline.stages``
(chunk ``i`` runs on stage ``i mod p``). Each computing node of the rewritten program gets a chunk:

* a node of a repeated layer (``autopar.ir.layers.layer_of``) the chunk of its layer's range;
* a node fed by layers (final norm, head, loss) the latest chunk of its inputs;
* a node computed from parameters but not from layers (embedding, a weight's transpose, a
  redistribute of a weight) the earliest chunk that reads it.

Nodes that depend on no parameter (masks, positions, rotary tables: functions of inputs, buffers and
constants alone) get no chunk: each chunk that needs one computes it itself, so only tensors that
carry gradients cross a boundary. A buffer's write (``ir/buffer_writes.py``) computed so (a counter) is
the chunk of its layer, or outside layers the first chunk's, and computes its value there. A value
crosses from chunk ``a`` to chunk ``b > a`` through every chunk in between (each chunk's outputs are
all values made so far and read later). A parameter read by several chunks (weights tied across
stages) is a placeholder of each: the runtime gives every stage a copy and sums their gradients
(``tied_parameters.py``).

A value crossing a boundary travels as a plain local tensor (``torch.distributed.pipelining`` sends
tensors, not DTensors): ``Boundary`` is where the plan puts it on the stage mesh, with partial sums
reduced first (a partial value cannot be sent as shards), and its global microbatch shape, so that the
receiving chunk rebuilds the DTensor and the pipeline stage knows its static shapes.

A plan without pipeline stages is one chunk, the whole program (``whole_program``), so every runtime
runs stage programs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar.core.errors import BadInputError
from autopar.core.placement import strs_to_placements
from autopar.core.plan import Plan
from autopar.ir.layers import layer_of

from .insert_redistributes import PLACED_AS_INPUT, as_replicated, redistribute
from .lower_writes import written_value
from .reshard import gather_parameter
from .rematerialize import recomputed_op


@dataclass
class StageProgram:
    """One chunk of the program: ``graph_module(*inputs, *placeholders)`` returns ``outputs``.

    Chunk 0 also lists the placeholders nothing reads, so unused parameters belong to some stage.
    """

    index: int
    graph_module: fx.GraphModule
    inputs: list[str]  # values received from the previous chunk, in order (none for chunk 0)
    placeholders: list[str]  # program placeholders it reads: parameters, buffers, constants, user inputs
    outputs: list[str]  # values sent to the next chunk; the last chunk's is the loss


def split_program(program: fx.GraphModule, ranges: Sequence[Sequence[int]], params: Mapping[str, str],
                  user_inputs: Sequence[str], buffers: Mapping[str, str]) -> list[StageProgram]:
    """Cut ``program`` into ``len(ranges)`` chunks by layer range (``[first, last + 1)`` each).

    ``params`` and ``buffers`` map parameter and buffer placeholder names to their fqns; ``user_inputs``
    names the placeholders of the inputs and targets.
    """
    graph = program.graph
    last = len(ranges) - 1
    chunk = _assign_chunks(graph, _layer_chunks(graph, ranges), set(params), set(user_inputs), last)
    _check_forward_only(chunk)
    loss = _loss_node(graph)
    if chunk.get(loss) != last:
        raise BadInputError("the loss is not computed after the last pipeline stage's layers; "
                            "pipeline plans need the loss to follow the model's last layer")
    crossing = _values_crossing(graph, chunk, last)
    writers = {write[1]: chunk[n] for n in chunk if (write := written_value(n)) is not None}
    written_by = {p: writers[fqn] for p, fqn in buffers.items() if fqn in writers}  # a placeholder of the chunk
    stages = []
    for s in range(last + 1):
        inputs = crossing[s - 1] if s > 0 else []
        outputs = crossing[s] if s < last else [loss]
        if not outputs:
            raise BadInputError(f"pipeline chunk {s} computes nothing a later chunk reads (layer ranges "
                                f"{list(ranges)}): re-plan with fewer stages")
        stages.append(_stage_program(program, s, chunk, inputs, outputs, written_by))
    _refuse_buffers_written_across_chunks(stages, written_by, buffers)
    return stages


def _refuse_buffers_written_across_chunks(stages: Sequence[StageProgram], written_by: Mapping[str, int],
                                          buffers: Mapping[str, str]) -> None:
    """Refuse a buffer one chunk writes and another reads: each pipeline stage holds its own copy of what it reads,
    so the reader would read a copy the writer never updates."""
    for stage in stages:
        for name in stage.placeholders:
            if written_by.get(name, stage.index) != stage.index:
                raise BadInputError(
                    f"buffer {buffers[name]} is written in pipeline chunk {written_by[name]} and read in chunk "
                    f"{stage.index}: each stage holds its own copy of a buffer, so the reader's would go stale; keep "
                    "a written buffer within one layer (or before the layers), or plan without pp")


def whole_program(program: fx.GraphModule) -> StageProgram:
    """The one chunk of a plan without pipeline stages: the whole program, reading every placeholder."""
    placeholders = [n.name for n in program.graph.nodes if n.op == "placeholder"]
    return StageProgram(0, program, [], placeholders, [_loss_node(program.graph).name])


def _layer_chunks(graph: fx.Graph, ranges: Sequence[Sequence[int]]) -> dict[str, int]:
    """Chunk of each repeated layer (``blocks.3``), layers numbered in the order the graph runs them."""
    layers: list[str] = []
    for node in graph.nodes:
        layer = layer_of(node) if node.op == "call_function" else None
        if layer is not None and layer not in layers:
            layers.append(layer)
    if not ranges or ranges[-1][1] != len(layers):
        covered = ranges[-1][1] if ranges else 0
        raise BadInputError(f"the plan's pipeline stages cover {covered} layers, the program has {len(layers)} "
                            "repeated layers: re-plan for this model")
    return {layer: s for s, (first, end) in enumerate(ranges) for layer in layers[first:end]}


def _assign_chunks(graph: fx.Graph, layer_chunk: Mapping[str, int], param_names: set[str],
                   input_names: set[str], last: int) -> dict[fx.Node, int]:
    """Chunk of every node that depends on a parameter; parameter-free nodes stay unassigned."""
    feeds_layer = _feeding_a_layer(graph)
    chunk: dict[fx.Node, int] = {}
    from_layers: set[fx.Node] = set()  # nodes computed from a layer's output
    from_params = {n for n in graph.nodes if n.op == "placeholder" and n.name in param_names}
    from_inputs = {n for n in graph.nodes if n.op == "placeholder" and n.name in input_names}
    weights_only: set[fx.Node] = set()  # computed from parameters alone (a weight's view or redistribute)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        fed_by_layers = [i for i in inputs if i in from_layers]
        if any(i in from_inputs for i in inputs):
            from_inputs.add(node)
        if not fed_by_layers and not any(i in from_params for i in inputs):
            if written_value(node) is not None:  # a counter's write: its layer's chunk, outside layers the first
                layer = layer_of(node)
                chunk[node] = layer_chunk[layer] if layer is not None else 0
            continue  # parameter-free: recomputed by each chunk that reads it
        from_params.add(node)
        layer = layer_of(node)
        if layer is not None:
            chunk[node] = layer_chunk[layer]
            from_layers.add(node)
        elif fed_by_layers:  # after a layer: with the next layer's chunk's inputs, or after the last layer
            chunk[node] = max(chunk[i] for i in fed_by_layers) if node in feeds_layer else last
            from_layers.add(node)
        elif node in from_inputs:  # before the first layer (embedding)
            chunk[node] = 0
        else:
            weights_only.add(node)
    for node in reversed(graph.nodes):  # readers first: a weight's view joins its earliest reader
        if node in weights_only:
            chunk[node] = min(chunk.get(user, last) for user in node.users)
    return chunk


def _feeding_a_layer(graph: fx.Graph) -> set[fx.Node]:
    """Nodes some repeated layer's node reads, directly or through other nodes."""
    feeds: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if any(u in feeds or (u.op == "call_function" and layer_of(u) is not None) for u in node.users):
            feeds.add(node)
    return feeds


def _check_forward_only(chunk: Mapping[fx.Node, int]) -> None:
    for node, s in chunk.items():
        for i in node.all_input_nodes:
            if chunk.get(i, s) > s:
                raise BadInputError(f"{node.name} (pipeline stage chunk {s}) reads {i.name} from a later chunk "
                                    f"({chunk[i]}): the model's layers do not run in order")


def _loss_node(graph: fx.Graph) -> fx.Node:
    output = next(n for n in graph.nodes if n.op == "output")
    values = output.args[0]
    (loss,) = values if isinstance(values, (list, tuple)) else (values,)
    return loss


def _values_crossing(graph: fx.Graph, chunk: Mapping[fx.Node, int], last: int) -> list[list[fx.Node]]:
    """Per boundary ``s -> s + 1``: the values made in chunks ``<= s`` and read in chunks ``> s``."""
    crossing: list[list[fx.Node]] = [[] for _ in range(last)]
    for node in graph.nodes:
        if node not in chunk:
            continue
        last_reader = max((chunk.get(u, last) for u in node.users), default=chunk[node])
        for s in range(chunk[node], last_reader):
            crossing[s].append(node)
    return crossing


def _stage_program(program: fx.GraphModule, s: int, chunk: Mapping[fx.Node, int], inputs: list[fx.Node],
                   outputs: list[fx.Node], written_by: Mapping[str, int]) -> StageProgram:
    """Chunk ``s``'s program. Its placeholders: what its nodes read, the buffers it writes (``written_by``:
    placeholder -> the chunk writing it, which holds it though it may not read it), and in the first chunk
    the placeholders nothing reads or writes (so that the model's every parameter and buffer has a stage)."""
    graph = program.graph
    members = [n for n in graph.nodes if chunk.get(n) == s]
    needed = _unassigned_inputs(members, chunk)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = g.placeholder(node.name)
        env[node].meta = dict(node.meta)
    unused = [n for n in graph.nodes if n.op == "placeholder" and not n.users and n.name not in written_by] \
        if s == 0 else []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"
                    and (n in needed or n in unused or written_by.get(n.name) == s)]
    for node in placeholders:
        env[node] = g.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in graph.nodes:
        if node.op != "placeholder" and (chunk.get(node) == s or node in needed):
            env[node] = g.node_copy(node, lambda a: env[a])
    g.output(tuple(env[n] for n in outputs))
    return StageProgram(s, fx.GraphModule(program, g), [n.name for n in inputs], [n.name for n in placeholders],
                        [n.name for n in outputs])


def _unassigned_inputs(members: list[fx.Node], chunk: Mapping[fx.Node, int]) -> set[fx.Node]:
    """Placeholders, attributes and parameter-free nodes the chunk's own nodes read (transitively)."""
    needed: set[fx.Node] = set()
    stack = [i for n in members for i in n.all_input_nodes if i not in chunk]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(i for i in node.all_input_nodes if i not in chunk)
    return needed


@dataclass(frozen=True)
class Boundary:
    """A value crossing stages: its planned placements (no ``Partial``) and global microbatch shape."""

    placements: tuple[Placement, ...]
    shape: torch.Size
    dtype: torch.dtype

    def local_meta(self, mesh: DeviceMesh) -> torch.Tensor:
        """A meta tensor shaped like this rank's shard (``PipelineStage``'s static shapes)."""
        # torch has no public function for a shard's local shape: DTensor's own helper is the one its
        # dispatch uses, so the shapes pipelining expects are the ones the stage's DTensors have
        local, _ = compute_local_shape_and_global_offset(self.shape, mesh, self.placements)
        return torch.empty(local, dtype=self.dtype, device="meta", requires_grad=self.dtype.is_floating_point)

    def to_dtensor(self, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        """The received local shard as the DTensor the chunk computes with."""
        return DTensor.from_local(local, mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=torch.empty(self.shape, device="meta").stride())

    def to_local(self, value: DTensor) -> torch.Tensor:
        """The value to send: moved off any partial placement, as this rank's contiguous shard."""
        if tuple(value.placements) != self.placements:
            value = value.redistribute(value.device_mesh, self.placements)
        return value.to_local().contiguous()


def boundary_of(node: fx.Node, plan: Plan) -> Boundary:
    """Where the plan puts ``node``'s value, with partial sums reduced (they cannot be sent as shards)."""
    placements = [Replicate() if isinstance(p, Partial) else p for p in strs_to_placements(_planned(node, plan))]
    val = _value_meta(node)
    return Boundary(tuple(placements), val.shape, val.dtype)


def _planned(node: fx.Node, plan: Plan) -> Sequence[str]:
    if recomputed_op(node) in (redistribute, gather_parameter):
        return node.args[1]
    if node.target is as_replicated:
        return ["R"] * plan.mesh.ndim
    if getattr(node.target, "__name__", "") == "getitem":
        return plan.ops[node.args[0].name]["outputs"][node.args[1]]
    if node.name in plan.ops:
        return plan.ops[node.name]["outputs"][0]
    if node.target in PLACED_AS_INPUT:  # a cast the plan never saw, or a layout guard the passes added
        return _planned(node.args[0], plan)
    raise BadInputError(f"the plan gives no placement for {node.name}, which crosses a pipeline stage")


def _value_meta(node: fx.Node) -> torch.Tensor:
    """The captured value of ``node`` (nodes the passes inserted take their input's)."""
    while "val" not in node.meta:
        node = node.args[0]
    return node.meta["val"]
