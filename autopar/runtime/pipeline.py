"""Pipeline-parallel execution of a plan: the rank's program cut into stages, run by
``torch.distributed.pipelining``.

A plan with ``degrees["pp"] = p`` runs on ``p x (stage mesh)`` ranks, the stage dimension outermost
(global rank = stage * stage_mesh_size + rank_in_stage); ``plan.mesh`` is one stage's submesh and
``plan.pipeline["stages"]`` lists ``p v`` layer ranges (chunk ``i`` on stage ``i mod p``).

Design (docs/architecture.md "Execution", "pipeline stages are slices of that graph"):

1. **The program.** The captured forward+loss graph, at the microbatch shape, rewritten by the same
   passes ``ParallelModule`` applies (``insert_redistributes``, ``run_locally``): every value is a
   DTensor on the stage's submesh, so data and tensor parallelism inside a stage work as without a
   pipeline.
2. **The split** (``split_program``). Each computing node gets a chunk: a node of a repeated layer
   (``autopar.stages.layer_of``) the chunk of its layer's range; a node fed by layers (final norm,
   head, loss) the latest chunk of its inputs; a node computed from parameters but not from layers
   (embedding, a weight's transpose, a redistribute of a weight) the earliest chunk that reads it.
   Nodes that depend on no parameter (masks, positions, rotary tables: functions of inputs, buffers
   and constants alone) get no chunk: each chunk that needs one computes it itself, so only tensors
   that carry gradients cross a boundary. A value crosses from chunk ``a`` to chunk ``b > a`` through
   every chunk in between (each chunk's outputs are all values made so far and read later). A
   parameter read by two chunks (weights tied across stages) is refused.
3. **Running** (``PipelineParallelModule``). Each chunk is an ``nn.Module`` that takes and returns
   plain local tensors: received values become DTensors with the plan's placements of that value
   (``DTensor.from_local`` with the global shape), values it sends are brought off any ``Partial``
   placement and sent as local shards. ``torch.distributed.pipelining`` ``PipelineStage`` (with static
   shapes, so no shape-inference round) and ``ScheduleGPipe`` / ``Schedule1F1B`` /
   ``ScheduleInterleaved1F1B`` run the microbatches over the pipeline process group; afterwards the
   stage's gradients are synchronized in buckets over the stage mesh (``GradientSync``), as
   ``ParallelModule`` does.

Where we diverge from pipelining's usual use: the loss is part of the last chunk's graph (it was
captured with the model), so the schedule's ``loss_fn`` only scales it by ``1 / m``, the schedule's
``target`` is the microbatch index (unused), and ``scale_grads=False``: the sum of the ``m`` scaled
backward passes is the mean over the batch, exactly as ``ParallelModule.step`` accumulates it. User
inputs reach the first chunk as positional arguments; later chunks that read one (the targets, for the
loss) get it as a keyword argument, which pipelining hands to every chunk of a rank and splits into
microbatches like the positional ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar.passes import (GradientSync, ResavedParameters, checkpoint_layers, insert_redistributes,
                            reshard_after_forward, run_locally, shard_parameters, shard_tensor)
from autopar.passes.insert_redistributes import as_replicated, redistribute
from autopar.core.placement import strs_to_placements

from autopar.ir.capture import CapturedGraph
from autopar.core.errors import BadInputError
from autopar.core.plan import Plan
from autopar.runtime.parallel_module import copy_graph, microbatch_shape, parameter_values, produced_placements  # shared with ParallelModule
from autopar.ir.layers import layer_of

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


# ---- the split ------------------------------------------------------------------------------------
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
                  user_inputs: Sequence[str]) -> list[StageProgram]:
    """Cut ``program`` into ``len(ranges)`` chunks by layer range (``[first, last + 1)`` each).

    ``params`` maps parameter placeholder names to their fqns; ``user_inputs`` names the placeholders
    of the inputs and targets.
    """
    graph = program.graph
    last = len(ranges) - 1
    chunk = _assign_chunks(graph, _layer_chunks(graph, ranges), set(params), set(user_inputs), last)
    _check_forward_only(chunk)
    _check_parameters_owned_once(graph, chunk, params)
    loss = _loss_node(graph)
    if chunk.get(loss) != last:
        raise BadInputError("the loss is not computed after the last pipeline stage's layers; "
                            "pipeline plans need the loss to follow the model's last layer")
    crossing = _values_crossing(graph, chunk, last)
    stages = []
    for s in range(last + 1):
        inputs = crossing[s - 1] if s > 0 else []
        outputs = crossing[s] if s < last else [loss]
        if not outputs:
            raise BadInputError(f"pipeline chunk {s} computes nothing a later chunk reads (layer ranges "
                                f"{list(ranges)}): re-plan with fewer stages")
        stages.append(_stage_program(program, s, chunk, inputs, outputs))
    return stages


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


def _check_parameters_owned_once(graph: fx.Graph, chunk: Mapping[fx.Node, int], params: Mapping[str, str]) -> None:
    for node in graph.nodes:
        if node.op == "placeholder" and node.name in params:
            readers = sorted({chunk[u] for u in node.users if u in chunk})
            if len(readers) > 1:
                raise BadInputError(f"parameter {params[node.name]} is used by pipeline chunks {readers} (weights "
                                    "tied across stages): not supported; untie it or re-plan with pp=1")


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
                   outputs: list[fx.Node]) -> StageProgram:
    graph = program.graph
    members = [n for n in graph.nodes if chunk.get(n) == s]
    needed = _unassigned_inputs(members, chunk)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = g.placeholder(node.name)
        env[node].meta = dict(node.meta)
    unused = [n for n in graph.nodes if n.op == "placeholder" and not n.users] if s == 0 else []
    placeholders = [n for n in graph.nodes if n.op == "placeholder" and (n in needed or n in unused)]
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


# ---- running --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Boundary:
    """A value crossing stages: its planned placements (no ``Partial``) and global microbatch shape."""

    placements: tuple[Placement, ...]
    shape: torch.Size
    dtype: torch.dtype

    def local_meta(self, mesh: DeviceMesh) -> torch.Tensor:
        """A meta tensor shaped like this rank's shard (``PipelineStage``'s static shapes)."""
        local, _ = compute_local_shape_and_global_offset(self.shape, mesh, self.placements)
        return torch.empty(local, dtype=self.dtype, device="meta", requires_grad=self.dtype.is_floating_point)

    def to_dtensor(self, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        return DTensor.from_local(local, mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=torch.empty(self.shape, device="meta").stride())

    def to_local(self, value: DTensor) -> torch.Tensor:
        if tuple(value.placements) != self.placements:
            value = value.redistribute(value.device_mesh, self.placements)
        return value.to_local().contiguous()


def boundary_of(node: fx.Node, plan: Plan) -> Boundary:
    """Where the plan puts ``node``'s value, with partial sums reduced (they cannot be sent as shards)."""
    placements = [Replicate() if isinstance(p, Partial) else p for p in strs_to_placements(_planned(node, plan))]
    val = _value_meta(node)
    return Boundary(tuple(placements), val.shape, val.dtype)


def _planned(node: fx.Node, plan: Plan) -> Sequence[str]:
    if node.target is redistribute:
        return node.args[1]
    if node.target is as_replicated:
        return ["R"] * len(plan.mesh["shape"])
    if getattr(node.target, "__name__", "") == "getitem":
        return plan.ops[node.args[0].name]["outputs"][node.args[1]]
    if node.name in plan.ops:
        return plan.ops[node.name]["outputs"][0]
    raise BadInputError(f"the plan gives no placement for {node.name}, which crosses a pipeline stage")


def _value_meta(node: fx.Node) -> torch.Tensor:
    """The captured value of ``node`` (nodes the passes inserted take their input's)."""
    while "val" not in node.meta:
        node = node.args[0]
    return node.meta["val"]


class StageModule(nn.Module):
    """One chunk as pipelining runs it: local tensors in and out, DTensors on the stage mesh inside.

    Positional inputs are the user inputs (first chunk) or the previous chunk's outputs; user inputs a
    later chunk reads arrive as keyword arguments. Parameters are this rank's shards of the chunk's.
    """

    def __init__(self, stage: StageProgram, program: nn.Module, values: Mapping[str, Any], inputs: list[Boundary],
                 outputs: list[Boundary], user_input: Callable[[str, torch.Tensor], DTensor], user_names: list[str],
                 mesh: DeviceMesh):
        super().__init__()
        self.index = stage.index
        self.program = program
        self.placeholders = stage.placeholders
        self.inputs, self.outputs = inputs, outputs
        self.stage_params = nn.ParameterList(v for v in values.values() if isinstance(v, nn.Parameter))
        self.values = dict(values)  # placeholder name -> parameter / buffer / constant (DTensors)
        self._user_input = user_input
        self.user_names = user_names
        self.reads = [n for n in stage.placeholders if n in user_names]  # user inputs this chunk reads
        self.mesh = mesh

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.index == 0:
            received, users = [], dict(zip(self.user_names, args))
        else:
            received, users = [b.to_dtensor(x, self.mesh) for b, x in zip(self.inputs, args)], kwargs
        values = [self.values[n] if n in self.values else self._user_input(n, users[n]) for n in self.placeholders]
        outs = tuple(b.to_local(v) for b, v in zip(self.outputs, self.program(*received, *values)))
        return outs[0] if len(outs) == 1 else outs


class PipelineParallelModule(nn.Module):
    """This rank's pipeline stage(s) of a plan with ``pp > 1``; ``parameters()`` are only its stages'.

    ``step`` runs the plan's schedule over ``m`` microbatches (forward, loss, backward), synchronizes
    the stage's gradients, and returns the global mean loss on every rank.
    """

    def __init__(self, model: nn.Module, captured: CapturedGraph, plan: Plan, device_type: str | None = None):
        super().__init__()
        self.plan, self.captured = plan, captured
        self.world_mesh, self.mesh = pipeline_meshes(plan, device_type)
        self.pp_group = self.world_mesh.get_group("pp")
        self.pp_rank, self.pp_size = self.world_mesh.get_local_rank("pp"), self.world_mesh.size(0)
        program = fx.GraphModule(captured.graph_module, copy_graph(captured.graph))
        self.redistributes = insert_redistributes(program, plan.ops, produced_placements(captured, plan), self.mesh)
        self._gathers = reshard_after_forward(program, parameter_values(captured))
        run_locally(program, plan.ops, self.mesh)
        stages = split_program(program, plan.pipeline["stages"], captured.params, captured.user_inputs)
        self.chunks = nn.ModuleList(self._stage_module(stages[i], program, model)
                                    for i in range(self.pp_rank, len(stages), self.pp_size))
        self._local_inputs = False
        self.schedule = self._schedule(len(stages))
        self._grad_sync = GradientSync(self.parameters())

    # ---- parameters ---------------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        fqn = self.captured.params
        for chunk in self.chunks:
            for name in chunk.placeholders:
                if name in fqn:
                    yield prefix + fqn[name], chunk.values[name]

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model (all stages) gathered to its full value, on every rank."""
        mine = {fqn: p.detach().full_tensor() for fqn, p in self.named_parameters()}
        per_stage: list[Any] = [None] * self.pp_size
        dist.all_gather_object(per_stage, mine, group=self.pp_group)
        return {fqn: t for state in per_stage for fqn, t in state.items()}

    # ---- running ------------------------------------------------------------------------------
    @property
    def microbatches(self) -> int:
        return int(self.plan.pipeline["microbatches"])

    def step(self, *args: torch.Tensor, local: bool = False) -> torch.Tensor:
        """Forward, loss and backward of the global batch (or this rank's slice with ``local=True``)
        through the pipeline; gradients are left on ``parameters()``, synchronized within the stage."""
        names = self.captured.user_inputs
        if len(args) != len(names):
            raise BadInputError(f"step() takes {len(names)} tensors (inputs then targets), got {len(args)}")
        by_name = dict(zip(names, args))
        self._local_inputs = local
        first = args if self.chunks[0].index == 0 else ()
        later = {n: by_name[n] for chunk in self.chunks if chunk.index > 0 for n in chunk.reads}
        losses: list[torch.Tensor] = []
        self.schedule.step(*first, target=torch.arange(self.microbatches), losses=losses, return_outputs=False,
                           **later)
        self._grad_sync()
        return self._broadcast_loss(sum(l.detach() for l in losses) if losses else torch.zeros(()))

    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.reshape(()).clone()
        last_stage_rank = dist.get_global_rank(self.pp_group, self.pp_size - 1)
        dist.broadcast(loss, src=last_stage_rank, group=self.pp_group)
        return loss

    # ---- building -----------------------------------------------------------------------------
    def _stage_module(self, stage: StageProgram, program: fx.GraphModule, model: nn.Module) -> StageModule:
        by_name = {n.name: n for n in program.graph.nodes}
        inputs = [boundary_of(by_name[n], self.plan) for n in stage.inputs]
        outputs = [boundary_of(by_name[n], self.plan) for n in stage.outputs]
        stage_program = checkpoint_layers(stage.graph_module, self.plan.checkpointing_of)
        return StageModule(stage, ResavedParameters(stage_program) if self._gathers else stage_program,
                           self._placeholder_values(stage, model), inputs, outputs, self._user_input,
                           self.captured.user_inputs, self.mesh)

    def _placeholder_values(self, stage: StageProgram, model: nn.Module) -> dict[str, Any]:
        """Parameters (sharded), buffers and constants the chunk reads, by placeholder name."""
        cg, plan = self.captured, self.plan
        named_params, named_buffers = dict(model.named_parameters()), dict(model.named_buffers())
        values: dict[str, Any] = {}
        for name in stage.placeholders:
            if name in cg.params:
                fqn = cg.params[name]
                values[name] = shard_parameters({fqn: named_params[fqn]}, {fqn: plan.placements[fqn]}, self.mesh)[fqn]
            elif name in cg.buffers:
                values[name] = shard_tensor(named_buffers[cg.buffers[name]], self.mesh, plan.buffers[cg.buffers[name]])
            elif name in cg.constants:
                values[name] = shard_tensor(cg.constants[name], self.mesh, ["R"] * self.mesh.ndim)
        return values

    def _user_input(self, name: str, x: torch.Tensor) -> DTensor:
        """One microbatch of a user input as a DTensor with the plan's placements (as ``ParallelModule``)."""
        spec = self.plan.inputs[name]
        shape = microbatch_shape(spec["shape"], self.microbatches)
        if self._local_inputs:
            return DTensor.from_local(x, self.mesh, strs_to_placements(spec["placements"]), run_check=False,
                                      shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
        if list(x.shape) != shape:
            raise BadInputError(f"input {name} has shape {list(x.shape)} per microbatch, the plan was made for "
                                f"{shape} (pass local=True for per-rank slices)")
        return shard_tensor(x, self.mesh, spec["placements"])

    def _schedule(self, num_chunks: int) -> Any:
        kind = self.plan.pipeline["schedule"]
        if kind not in SCHEDULES:
            raise BadInputError(f"pipeline schedule {kind!r} is not one this runtime runs ({', '.join(SCHEDULES)})")
        device = torch.device(self.mesh.device_type)
        stages = [PipelineStage(chunk, chunk.index, num_chunks, device, group=self.pp_group,
                                input_args=self._example_inputs(chunk),
                                output_args=tuple(b.local_meta(self.mesh) for b in chunk.outputs))
                  for chunk in self.chunks]
        m = self.microbatches
        scale = lambda loss, _microbatch: loss / m  # noqa: E731  (the loss is computed in the last chunk)
        if kind == "interleaved":
            return ScheduleInterleaved1F1B(stages, m, loss_fn=scale, scale_grads=False)
        (stage,) = stages
        return SCHEDULES[kind](stage, m, loss_fn=scale, scale_grads=False)

    def _example_inputs(self, chunk: StageModule) -> tuple[torch.Tensor, ...]:
        if chunk.index > 0:
            return tuple(b.local_meta(self.mesh) for b in chunk.inputs)
        return tuple(torch.empty(microbatch_shape(self.plan.inputs[n]["shape"], self.microbatches),
                                 dtype=getattr(torch, self.plan.inputs[n]["dtype"]), device="meta")
                     for n in self.captured.user_inputs)


def pipeline_meshes(plan: Plan, device_type: str | None = None) -> tuple[DeviceMesh, DeviceMesh]:
    """The world mesh ``pp x (stage mesh)`` and this rank's stage submesh (the plan's mesh)."""
    if not dist.is_initialized():
        raise BadInputError("autoparallelize needs an initialized process group: run under torchrun, "
                            "or call torch.distributed.init_process_group first")
    pp, names = int(plan.degrees["pp"]), tuple(plan.mesh["dim_names"])
    shape = (pp, *plan.mesh["shape"])
    world = dist.get_world_size()
    if int(torch.tensor(shape).prod()) != world:
        raise BadInputError(f"the plan's pipeline of {pp} stages of mesh {list(plan.mesh['shape'])} needs "
                            f"{int(torch.tensor(shape).prod())} ranks, this job has {world}")
    device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    world_mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", *names))
    return world_mesh, world_mesh[names if len(names) > 1 else names[0]]
