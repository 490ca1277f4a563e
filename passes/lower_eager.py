"""A pipeline chunk's lowered forward run under eager autograd, its backward in autograd's C++ engine.

``lower.LoweredProgram`` runs a program as AOT autograd's forward and backward graphs: every op of both
is a dispatch from Python, and AOT's runtime wrapper adds its own per call. A pipeline chunk runs once
per microbatch, forward and backward, so that host work repeats ``m`` times a step, on the critical path
of the schedule. Where the chunk's backward graph runs no collective (its gradients are reduced after the
schedule, outside it; its forward may gather or sum over data parallelism, the loss, whose gradients are
local: ``with_local_gradients``) and nothing in it is recomputed, the backward graph is nothing but
autograd's derivative of the forward's local ops, so the forward can run op by op under autograd instead and
autograd's engine computes the same gradients in C++ (measured on the benchmark's GPT: one whole-model
microbatch, forward and backward, 14.8 ms through AOT's graphs, 13.2 ms eager, as the native module).

``EagerForward.traced`` traces the chunk's DTensor program once more, forward only, with ``make_fx`` over
the local tensors of its arguments (each made a DTensor of its spec inside the trace, as AOT's wrapper
does): DTensor's dispatch is traced through, leaving the local ops. A call then reads each DTensor
argument as its local tensor (``to_local``, whose backward gives the gradient the placements the AOT
trace recorded for it, ``LoweredProgram.input_gradient_placements``), runs the graph, and makes each
output the DTensor of its traced spec. The parameters are the program's local leaves, as under AOT:
their gradients, accumulated by the engine, are stored by the same hooks in the placements the AOT trace
recorded (``lower._store_gradient``).

The loss of a pipeline's last stage under data parallelism is a global mean: all_reduced sums of its
per-token losses and of its counted targets (``lower_buckets.reduce_gathered_sums``, as under AOT). The
count reads only targets, which a step has before its schedule runs: it leaves the graph, which reads it
reduced as an input (``take_out_input_sums``), and the pipeline reduces every microbatch's count in one
all_reduce before the schedule (``InputReductions``), where each microbatch's forward waited on its own. The
sum's reduction leaves the graph (``defer_reduced_output``): its gradient needs neither its
value nor its reduction, so the chunk's ranks do not meet there every microbatch; ``EagerForward.finish``
reduces the sums of all the step's microbatches in one all_reduce after the schedule and writes the losses'
values (measured on the benchmark's pp 2 x dp 2, 4 ranks: lowered / native 1.12-1.17 with one all_reduce a
microbatch left unwaited, where waiting on both in forward gave 1.18-1.24; one all_reduce a step against one
a microbatch, alternated in one process: 0.97-1.01 of the step, 1-2 ms less CPU a step on each rank of the
last stage).

``eager_refusal`` says why a program keeps AOT's graphs: compiled by inductor, collectives in its backward
graph or others than gathers and sums in its forward (tensor parallelism, FSDP, expert and context
parallelism: their placement rules and bucketing live in the AOT graphs), recomputed layers (eager autograd
would save what the plan recomputes), parameters read as DTensors, or an output partial over a mesh dim (its
gradient's placements then depend on AOT's handling of tangents, which this path does not repeat).
"""

from __future__ import annotations

import contextlib
import operator
from collections import defaultdict
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Partial, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from .checkpoint import CheckpointedLayer
from .dtensor_backward import keep_derivatives
from .lower_buckets import (COLLECTIVES, from_inputs_alone, graph_of, launch_from_inputs_first, read_only_by,
                            recompiled, reduce_gathered_sums)
from .lower_simplify import call_through_bindings, erase_unused, simplify_local_ops

_aten = torch.ops.aten
_FLATTENING_VIEWS = frozenset({_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default})


class EagerRefused(Exception):
    """Why a program's forward does not run under eager autograd (``eager_refusal``, ``EagerForward.traced``)."""


@contextlib.contextmanager
def _refusing_partitioned_sums() -> Iterator[None]:
    """While a forward is traced through DTensor: a replicated value made a partial sum (an op's strategy
    reading it ``Partial``, as a row-parallel linear layer reads its bias) raises ``EagerRefused``. DTensor
    makes it by dividing each rank's copy by the ranks (``Partial._partition_value``) and, in backward, keeps
    the gradient replicated and whole (``_redistribute_backward``: no Replicate to Partial in backward); eager
    autograd over the traced local ops would divide the gradient by the ranks as well (a bias gradient half
    its value on two ranks). The AOT backward follows DTensor's."""
    partition = Partial._partition_value

    def refuse(self: Partial, tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
        if tensor.is_floating_point() and mesh.size(mesh_dim) > 1:
            raise EagerRefused("a replicated value is made a partial sum (its gradient would be divided)")
        return partition(self, tensor, mesh, mesh_dim)

    Partial._partition_value = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        Partial._partition_value = partition  # type: ignore[method-assign]


def eager_refusal(program: nn.Module, graphs: Mapping[str, fx.GraphModule], collectives: Mapping[str, Any],
                  parameters: Sequence[int], local: Mapping[int, DTensorSpec], compiled: bool) -> str | None:
    """Why the lowered ``program`` (its AOT ``graphs`` with grad, their ``collectives`` per graph, the argument
    positions of its ``parameters`` and of those it reads as ``local`` leaves) keeps its AOT graphs; None
    where its forward may run under eager autograd."""
    if compiled:
        return "compiled by inductor"
    if set(graphs) != {"forward", "backward"}:
        return "no backward graph was traced"
    if collectives.get("backward"):
        return "its backward graph runs collectives"
    unfit = set(collectives.get("forward", {})) - _LOCAL_GRADIENT_KINDS
    if unfit:
        return f"its forward graph runs {', '.join(sorted(unfit))}"
    if any(isinstance(m, CheckpointedLayer) for m in program.modules()):
        return "it recomputes checkpointed layers in backward"
    if not set(parameters) <= set(local):
        return "it reads parameters as DTensors"
    return None


class EagerForward:
    """A program's forward over local tensors (``traced``), called as the program is (``__call__``)."""

    def __init__(self, graph: fx.GraphModule, positions: list[int], input_specs: dict[int, DTensorSpec],
                 gradient_placements: dict[int, tuple[Placement, ...]], outputs: pytree.TreeSpec,
                 output_specs: list[DTensorSpec | None], deferred: "DeferredLoss | None" = None,
                 reductions: "InputReductions | None" = None):
        self.graph = graph
        self.positions = positions  # the tensor arguments, in the graph's input order
        self.input_specs = input_specs  # of the DTensor arguments (not the parameters' leaves)
        self.gradient_placements = gradient_placements  # of DTensor arguments, as their gradients leave
        self.outputs = outputs
        self.output_specs = output_specs  # per flat output: the DTensor it is made, None: a plain value
        self.deferred = deferred  # the loss's end (``defer_reduced_output``), else None
        self.pending: list[tuple[torch.Tensor, list[Any]]] = []  # per call since ``finish``: its loss, what ends it
        self.reductions = reductions  # the sums of its inputs alone, taken out of the graph (``take_out_input_sums``)
        self.microbatch: int | None = None  # of the next call, set by the pipeline (``InputReductions.values``)

    @classmethod
    def traced(cls, program: nn.Module, args: Sequence[Any], local: Mapping[int, DTensorSpec],
               gradient_placements: Mapping[int, tuple[Placement, ...]]) -> "EagerForward":
        """``program`` traced over the local tensors of ``args`` (its arguments, DTensors and the local leaves
        of the parameters at ``local``'s positions, which it reads as DTensors of those specs), with fake
        tensors; ``gradient_placements``: per DTensor argument, its gradient's placements as AOT traced
        them. Raises ``EagerRefused`` where an output is partial over a mesh dim of several ranks or the
        traced graph runs a collective other than a gather or a sum (``with_local_gradients``)."""
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        specs = {i: local[i] if i in local else args[i]._spec for i in positions
                 if i in local or isinstance(args[i], DTensor)}
        traced: dict[str, Any] = {}

        def local_program(*tensors: torch.Tensor) -> list[Any]:
            values = list(args)
            for i, tensor in zip(positions, tensors):
                values[i] = from_local(tensor, specs[i].mesh, specs[i]) if i in specs else tensor
            flat, traced["outputs"] = pytree.tree_flatten(program(*values))
            traced["specs"] = [v._spec if isinstance(v, DTensor) else None for v in flat]
            return [v.to_local() if isinstance(v, DTensor) else v for v in flat]

        examples = [(args[i]._local_tensor if isinstance(args[i], DTensor) else args[i]).detach() for i in positions]
        with torch.no_grad(), _refusing_partitioned_sums():
            graph = make_fx(local_program, tracing_mode="fake")(*examples)
        for spec in traced["specs"]:
            if spec is not None and any(p.is_partial() and spec.mesh.size(d) > 1 for d, p in enumerate(spec.placements)):
                raise EagerRefused(f"an output is partial over a mesh dim ({spec.placements})")
        fuse_linear_layers(graph)  # before the views are simplified: it reads a linear layer's views as traced
        simplify_local_ops(graph, under_autograd=True)
        fuse_token_losses(graph)  # after: DTensor's identity views split its pattern
        reduce_gathered_sums(graph)  # the loss's global mean: all_reduces of local sums, as under AOT
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        differentiable = {node.name for node, i in zip(placeholders, positions) if i in local or args[i].requires_grad}
        deferred = defer_reduced_output(graph, differentiable)
        reductions = take_out_input_sums(graph, differentiable)  # the loss's count of targets
        launch_from_inputs_first(graph, differentiable)  # any other collective of inputs alone, waited where read
        with_local_gradients(graph, differentiable)
        keep_derivatives(graph)  # the trace ran through the program's own (``dtensor_backward.py``): its ops again
        call_through_bindings(graph)  # last: the passes above match aten overloads
        kept = {i: tuple(p) for i, p in gradient_placements.items() if i not in local}
        inputs = {i: spec for i, spec in specs.items() if i not in local}
        return cls(graph, positions, inputs, kept, traced["outputs"], traced["specs"], deferred, reductions)

    def __call__(self, inputs: Sequence[Any], local_outputs: bool = False) -> Any:
        """The program's outputs for ``inputs`` (its arguments, the parameters as their local leaves; a
        DTensor argument may come as its local tensor where ``reads_locally`` says so), with autograd
        recording every op; ``local_outputs``: each output as its local tensor (where ``writes_locally``)."""
        tensors = [_read_locally(inputs[i], self.gradient_placements.get(i)) for i in self.positions]
        if self.reductions is not None:
            tensors += self.reductions.values(self.microbatch, [tensors[i] for i in self.reductions.reads])
        flat = self.graph(*tensors)
        if self.deferred is not None:
            flat, ending = flat[:len(self.output_specs)], flat[len(self.output_specs):]
            self.pending.append((flat[0], ending))
        if not local_outputs:
            flat = [from_local(v, spec.mesh, spec) if spec is not None else v
                    for v, spec in zip(flat, self.output_specs)]
        return pytree.tree_unflatten(flat, self.outputs)

    def finish(self) -> None:
        """Write into each loss returned since the last ``finish`` its value (``DeferredLoss.values``: their
        sums reduced together). Its gradient needed neither: backward may have run already."""
        pending, self.pending = self.pending, []
        if pending:
            with torch.no_grad():
                for (loss, _), value in zip(pending, self.deferred.values([ending for _, ending in pending])):
                    loss.copy_(value)

    def reads_locally(self, position: int, placements: Sequence[Placement]) -> bool:
        """Whether the DTensor argument at ``position``, where it would be made from a local tensor in
        ``placements``, may come as that local tensor: the traced argument is placed so and its gradient
        leaves so (``DTensor.from_local``'s backward would then move nothing)."""
        spec = self.input_specs.get(position)
        return spec is not None and _alike(spec.placements, placements, spec) \
            and _alike(self.gradient_placements.get(position, spec.placements), placements, spec)

    def writes_locally(self, placements: Sequence[Sequence[Placement]], written: int = 0) -> bool:
        """Whether the flat outputs, each to be sent as its local tensor in ``placements`` (in order), may
        leave as local tensors: each is a DTensor placed so. ``written``: how many more outputs follow, the
        values the program writes into buffers (``lower_writes.py``), read as local tensors too."""
        return len(placements) + written == len(self.output_specs) and all(
            spec is not None and _alike(spec.placements, wanted, spec)
            for spec, wanted in zip(self.output_specs, placements))


def take_out_input_sums(gm: fx.GraphModule, differentiable: Collection[str]) -> "InputReductions | None":
    """Take the all_reduced sums that ``gm`` (a chunk's forward) computes from its inputs alone, none with a
    gradient (the placeholders named in ``differentiable``), out of it, in place: each wait on one is replaced
    by a placeholder after the others, which the caller fills with the reduced value (``InputReductions``);
    returns what computes and reduces them, or None where there is none.

    The loss of a pipeline's last stage under data parallelism divides by the count of targets over the dp
    ranks, an all_reduce each microbatch waited on in its forward: the stage's ranks meet there ``m`` times a
    step, on the schedule's critical path. The counts read only the targets, which the step has before its
    schedule starts, so it reduces every microbatch's in one all_reduce then, while the schedule runs
    (``PipelineParallelModule._reduce_inputs_ahead``). Measured on the benchmark's pp 2 x dp 2 (4 gloo ranks,
    4 microbatches), alternated in one process with forwards that each wait on their own count: 0.3-0.5 ms
    less main-thread CPU a step in three runs (GPT, Llama, GPT), the step at 0.966, 0.954 and 1.010 of the
    time."""
    graph = gm.graph
    found = [(node, chain) for node in graph.nodes
             if node.target is _c10d.all_reduce.default and node.args[1] == "sum" and len(node.users) == 1
             and next(iter(node.users)).target is _c10d.wait_tensor.default
             and (chain := from_inputs_alone(node, differentiable)) is not None]
    if not found:
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    summed = [collective.args[0] for collective, _ in found]
    prologue, _, read = graph_of({n for _, chain in found for n in chain} - {c for c, _ in found}, summed)
    last = placeholders[-1]
    for k, (collective, _) in enumerate(found):
        wait = next(iter(collective.users))
        with graph.inserting_after(last):
            last = graph.placeholder(f"reduced_input_sum_{k}")
        last.meta.update(wait.meta)
        wait.replace_all_uses_with(last)
        graph.erase_node(wait)
        graph.erase_node(collective)
    erase_unused(graph)  # what only the sums read
    recompiled(gm, len(found))
    return InputReductions(fx.GraphModule(gm, prologue), [placeholders.index(n) for n in read],
                           [c.args[2] for c, _ in found])


class InputReductions:
    """Sums of a chunk's inputs alone, all_reduced, taken out of its forward graph (``take_out_input_sums``):
    ``prologue`` computes them from the graph's inputs at ``reads`` (indexes), each reduced over its process
    group (``groups``, by name); the graph reads the reduced values as its last inputs. ``launch`` reduces
    those of several microbatches at once, asynchronously (a pipeline step, before its schedule); ``values``
    hands a call its microbatch's, or reduces its own there and then where none was launched for it."""

    def __init__(self, prologue: fx.GraphModule, reads: list[int], groups: list[str]):
        self.prologue = prologue
        self.reads = reads
        self.groups = groups
        output = next(n for n in prologue.graph.nodes if n.op == "output")
        self._shapes = [tuple(v.meta["val"].shape) for v in output.args[0]]  # of the sums, reduced flat
        self._launched: dict[int, Callable[[], list[torch.Tensor]]] = {}

    def launch(self, microbatches: Mapping[int, Sequence[torch.Tensor]]) -> None:
        """Start reducing the sums of each microbatch (microbatch -> the graph's inputs at ``reads``): one
        all_reduce per process group and dtype for all of them."""
        with torch.no_grad():
            local = {mb: [v.reshape(-1) for v in self.prologue(*inputs)] for mb, inputs in microbatches.items()}
        by_group: dict[tuple[str, torch.dtype], list[tuple[int, int]]] = defaultdict(list)
        for mb, values in local.items():
            for k, value in enumerate(values):
                by_group[(self.groups[k], value.dtype)].append((mb, k))
        reduced: dict[int, list[Any]] = {mb: [None] * len(values) for mb, values in local.items()}
        works = []
        for (group, _), slots in by_group.items():
            flat = torch.cat([local[mb][k] for mb, k in slots])
            works.append(dist.all_reduce(flat, group=_resolve_process_group(group), async_op=True))
            for (mb, k), piece in zip(slots, flat.split([local[mb][k].numel() for mb, k in slots])):
                reduced[mb][k] = piece

        def waited(mb: int) -> list[torch.Tensor]:
            for work in works:
                work.wait()
            return [piece.view(shape) for piece, shape in zip(reduced[mb], self._shapes)]
        self._launched.update({mb: (lambda mb=mb: waited(mb)) for mb in local})

    def values(self, microbatch: int | None, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The reduced sums of ``microbatch`` (launched for it; None: a call of no microbatch), else those of
        ``inputs`` (the graph's inputs at ``reads``), reduced now."""
        if microbatch is None or microbatch not in self._launched:
            self.launch({-1: inputs})
            microbatch = -1
        return self._launched.pop(microbatch)()

    def forget(self) -> None:
        """Drop what was launched for microbatches that did not run (a step that stopped early)."""
        self._launched.clear()


def _alike(a: Sequence[Placement], b: Sequence[Placement], spec: DTensorSpec) -> bool:
    """Whether placements ``a`` and ``b`` put the same data on every rank of ``spec``'s mesh: equal on each
    dim of more than one rank."""
    return len(a) == len(b) and all(x == y for d, (x, y) in enumerate(zip(a, b)) if spec.mesh.size(d) > 1)


def from_local(local: torch.Tensor, mesh: DeviceMesh, spec: DTensorSpec) -> DTensor:
    """``local`` as this rank's shard of the DTensor of ``spec`` on ``mesh`` (differentiable, no check across
    ranks); its gradient leaves in ``spec``'s placements (what a reduced gradient has: ``DTensor.from_local``'s
    backward redistributes to them otherwise). ``lower.py`` passes the traced mesh, here ``spec``'s own."""
    return DTensor.from_local(local, mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)


def _read_locally(value: Any, gradient_placements: tuple[Placement, ...] | None) -> Any:
    """A DTensor argument's local tensor, its gradient leaving in ``gradient_placements`` (None: its own);
    any other argument as it is."""
    if isinstance(value, DTensor):
        return value.to_local(grad_placements=gradient_placements)
    return value


_LOCAL_GRADIENT_KINDS = frozenset({"all_gather", "all_reduce"})
"""Collectives (``lower.COLLECTIVE_KINDS``) a forward run under eager autograd may issue: where the AOT backward
graph has none, their gradient is local (``with_local_gradients``)."""


def with_local_gradients(gm: fx.GraphModule, differentiable: Collection[str]) -> int:
    """Each collective of ``gm`` (a forward traced through DTensor, its backward traced by AOT without any
    collective) that reads a value with a gradient (computed from the placeholders named in
    ``differentiable``) run with the gradient DTensor's backward gives it, in place; returns how many.

    Functional collectives have no derivative of their own; under DTensor a value's gradient comes from the
    redistribute that moved it, and where the AOT backward graph holds no collective, none moved a gradient:
    an ``all_gather_into_tensor`` (``Shard(0)`` to ``Replicate``) hands back this rank's chunk of its
    replicated gradient (DTensor's ``Replicate`` to ``Shard``, a slice), an ``all_reduce`` of partial sums
    (``Partial`` to ``Replicate``) its gradient as it is (DTensor keeps it ``Replicate``, Megatron-LM's ``g``).
    So a pipeline's last stage under data parallelism, whose loss sums its per-token losses and targets,
    runs eagerly too. Any other collective with a gradient raises ``EagerRefused``; those without one (a
    gather of inputs alone; the loss's count of targets has left the graph, ``take_out_input_sums``) stay
    functional collectives, launched and waited on where the graph says, and so does a launched collective
    the graph returns unwaited (``defer_reduced_output``'s)."""
    carrying = _carrying_gradients(gm, differentiable)
    rewritten = 0
    for wait in list(gm.graph.nodes):
        if wait.op != "call_function" or wait.target is not _c10d.wait_tensor.default:
            continue
        collective = wait.args[0]
        if getattr(collective, "target", None) in COLLECTIVES and not any(
                source in carrying for source in collective.all_input_nodes):
            continue
        local_gradient = _LOCAL_GRADIENTS.get(getattr(collective, "target", None))
        if local_gradient is None or len(collective.users) != 1 \
                or collective.target is _c10d.all_reduce.default and collective.args[1] != "sum":
            raise EagerRefused(f"its forward runs {getattr(collective, 'target', collective)} (a gradient DTensor "
                               f"would move)")
        with gm.graph.inserting_before(wait):
            replaced = gm.graph.call_function(local_gradient, tuple(collective.args))
        replaced.meta.update(wait.meta)
        wait.replace_all_uses_with(replaced)
        gm.graph.erase_node(wait)
        gm.graph.erase_node(collective)
        rewritten += 1
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if any(n.target in COLLECTIVES and not any(u is output or u.target is _c10d.wait_tensor.default for u in n.users)
           for n in gm.graph.nodes):
        raise EagerRefused("its forward runs a collective it does not wait on")
    return recompiled(gm, rewritten)


def _carrying_gradients(gm: fx.GraphModule, differentiable: Collection[str]) -> set[fx.Node]:
    """The nodes of ``gm`` computed from the placeholders named in ``differentiable``."""
    carrying: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.name in differentiable and node.op == "placeholder" or any(i in carrying for i in node.all_input_nodes):
            carrying.add(node)
    return carrying


def defer_reduced_output(gm: fx.GraphModule, differentiable: Collection[str]) -> "DeferredLoss | None":
    """Leave the all_reduces that end ``gm``'s first output (the loss) out of ``gm``, in place, where its
    gradient does not need them; returns what finishes its value (``DeferredLoss``), or None (nothing
    deferred). ``differentiable``: the placeholders whose values have gradients.

    The loss of data parallelism is a global mean: the all_reduced sum of the per-token losses over the
    all_reduced count of targets. Waiting on that sum in forward makes the ranks meet there, mid-step, each
    microbatch (a pipeline's last stage: ``m`` times a step), where DDP's ranks meet only in the gradient
    buckets. Its gradient needs neither its value nor the reduction: the sum's is the identity (DTensor's,
    ``with_local_gradients``) and the ops after it are linear in it (a division by the count, casts, views),
    so their derivatives do not read it. So ``gm`` computes its loss from the local partial sum instead (the
    value autograd differentiates, with the same gradient) and returns, after its own outputs, what the
    true value is computed from: the partial sum, not reduced (``DeferredLoss.values`` reduces the sums of
    every microbatch of a step at once: one all_reduce a step where each microbatch launched one, each a
    round of messages between the ranks), and the other values the ops after it read. ``EagerForward.finish``
    writes that value into the loss (``lower_buckets.defer_output_waits`` does the same for AOT's graphs,
    where the wait simply leaves the forward graph)."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else []
    value = outputs[0] if outputs else None
    if not isinstance(value, fx.Node) or outputs.count(value) != 1:
        return None
    carrying = _carrying_gradients(gm, differentiable)
    tail = read_only_by(value)
    order = {n: i for i, n in enumerate(graph.nodes)}
    deferred = [n for n in tail if n.target is _c10d.wait_tensor.default and _sums_gradients(n.args[0], carrying)]
    chain = set(deferred)
    for node in sorted(tail, key=order.__getitem__):
        if any(i in chain for i in node.all_input_nodes):
            chain.add(node)
    if value not in chain or value in deferred \
            or not all(_linear_in(node, chain, carrying) for node in chain - set(deferred)):
        return None
    epilogue, _, inputs = graph_of(chain - set(deferred), value)  # the waits' values are its inputs
    returned, summed = [], []
    for index, node in enumerate(inputs):
        if node not in deferred:
            returned.append(node)
            continue
        partial, _, group = node.args[0].args
        with graph.inserting_before(output):
            returned.append(graph.call_function(_aten.detach.default, (partial,)))
        returned[-1].meta.update(partial.meta)
        summed.append((index, group))
    for wait in deferred:
        collective = wait.args[0]
        wait.replace_all_uses_with(collective.args[0])
        graph.erase_node(wait)
        graph.erase_node(collective)
    output.args = (tuple(outputs) + tuple(returned),)
    recompiled(gm, 1)
    return DeferredLoss(fx.GraphModule(gm, epilogue), summed)


class DeferredLoss:
    """The end of a loss ``defer_reduced_output`` left out of its graph: ``epilogue`` computes the loss's
    value from the values the graph returned after its own outputs, once those at the positions of
    ``summed`` (position, process group name) are summed over their group."""

    def __init__(self, epilogue: fx.GraphModule, summed: list[tuple[int, str]]):
        self.epilogue = epilogue
        self.summed = summed

    def values(self, endings: Sequence[Sequence[Any]]) -> list[torch.Tensor]:
        """The losses of several calls, each from what its graph returned (``endings``): their partial sums
        reduced in one all_reduce per group and dtype, then each call's epilogue."""
        endings = [list(ending) for ending in endings]
        by_group: dict[tuple[str, torch.dtype], list[int]] = defaultdict(list)
        for position, group in self.summed:
            by_group[(group, endings[0][position].dtype)].append(position)
        for (group, _), positions in by_group.items():
            slots = [(ending, position) for ending in endings for position in positions]
            flat = torch.cat([ending[position].reshape(-1) for ending, position in slots])
            dist.all_reduce(flat, group=_resolve_process_group(group))
            pieces = flat.split([ending[position].numel() for ending, position in slots])
            for (ending, position), piece in zip(slots, pieces):
                ending[position] = piece.view(ending[position].shape)
        return [self.epilogue(*ending) for ending in endings]


def _sums_gradients(collective: fx.Node, carrying: set[fx.Node]) -> bool:
    """Whether ``collective`` is an all_reduce of partial sums of a value with a gradient."""
    return collective.target is _c10d.all_reduce.default and collective.args[1] == "sum" \
        and collective.args[0] in carrying and len(collective.users) == 1


def _linear_in(node: fx.Node, chain: set[fx.Node], carrying: set[fx.Node]) -> bool:
    """Whether ``node`` is linear in the one value of ``chain`` it reads, as its first argument (or either
    of a product's), and reads nothing else with a gradient: its derivative does not read that value."""
    read = [a for a in node.args if isinstance(a, fx.Node)]
    if node.target in _LINEAR_IN_FIRST:
        through = node.args[0]
    elif node.target is _aten.mul.Tensor:
        through = next((a for a in read if a in chain), None)
    else:
        return False
    return through in chain and not any(a in chain or a in carrying for a in read if a is not through)


_LINEAR_IN_FIRST = frozenset({_aten.div.Tensor, _aten.div.Scalar, _aten.mul.Scalar, _aten.neg.default,
                              _aten._to_copy.default, _aten.view.default, _aten.reshape.default,
                              _aten._unsafe_view.default, _aten.clone.default})
"""Ops linear in their first argument when nothing else they read has a gradient (a division by a count,
casts, views), whose derivative does not read that argument."""


class _GatheredWithLocalGradient(torch.autograd.Function):
    """``all_gather_into_tensor`` (waited on) whose gradient is this rank's chunk of the gathered one."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
        ctx.group_size, ctx.rank = group_size, _resolve_process_group(group_name).rank()
        return _c10d.wait_tensor(_c10d.all_gather_into_tensor(local, group_size, group_name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.chunk(ctx.group_size)[ctx.rank], None, None


class _SummedWithLocalGradient(torch.autograd.Function):
    """``all_reduce`` of partial sums (waited on) whose gradient passes through to each partial sum."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
        return _c10d.wait_tensor(_c10d.all_reduce(partial, reduce_op, group_name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def _gathered_with_local_gradient(local: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return _GatheredWithLocalGradient.apply(local, group_size, group_name)


def _summed_with_local_gradient(partial: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    return _SummedWithLocalGradient.apply(partial, reduce_op, group_name)


_c10d = torch.ops._c10d_functional
_LOCAL_GRADIENTS = {_c10d.all_gather_into_tensor.default: _gathered_with_local_gradient,
                    _c10d.all_reduce.default: _summed_with_local_gradient}


def fuse_linear_layers(gm: fx.GraphModule) -> int:
    """Each linear layer the trace decomposed (an input flattened to a matrix, ``addmm`` or ``mm`` with the
    transposed weight, the product viewed back to the input's leading dims) as one ``aten.linear``, in place;
    returns how many. Under autograd every op of the graph is a dispatch from Python with its autograd node;
    ``linear`` runs the same matmul and records its derivative in C++, one dispatch for four."""
    def linear(node: fx.Node) -> tuple[fx.Node, Callable[[fx.Graph], fx.Node]] | None:
        parts = _linear_parts(node)
        if parts is None:
            return None
        x, weight, bias, end = parts
        args = (x, weight) if bias is None else (x, weight, bias)
        return end, lambda graph: graph.call_function(_aten.linear.default, args)
    return _fused(gm, linear)


def _fused(gm: fx.GraphModule, match: Callable[[fx.Node], tuple[fx.Node, Callable[[fx.Graph], fx.Node]] | None]
           ) -> int:
    """Each node ``match`` finds a pattern at (None: none there) rewritten in place: the pattern's last node
    replaced by what the builder it gives adds to the graph, the rest erased once unread; returns how many."""
    fused = 0
    for node in list(gm.graph.nodes):
        found = match(node)
        if found is None:
            continue
        replaced, build = found
        with gm.graph.inserting_before(replaced):
            made = build(gm.graph)
        made.meta.update(replaced.meta)
        replaced.replace_all_uses_with(made)
        fused += 1
    if fused:
        gm.graph.eliminate_dead_code()
    return recompiled(gm, fused)


def _linear_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, fx.Node] | None:
    """Where ``node`` is the matmul of a linear layer ``x @ weight.T (+ bias)``: ``x``, ``weight``, ``bias``
    (None for ``mm``) and the node that ends the layer (the view back to ``x``'s leading dims, or the matmul
    itself where ``x`` is a matrix); else None."""
    if node.op != "call_function" or node.kwargs or node.target not in (_aten.addmm.default, _aten.mm.default):
        return None
    bias, mat1, mat2 = node.args if node.target is _aten.addmm.default else (None, *node.args)
    weight = _transposed_matrix(mat2)
    if weight is None or not isinstance(mat1, fx.Node) or "val" not in mat1.meta:
        return None
    if bias is not None and not (isinstance(bias, fx.Node) and bias.meta.get("val") is not None
                                 and bias.meta["val"].ndim == 1):
        return None
    unflattened = _viewed_back(node, mat1)
    if unflattened is not None:
        return mat1.args[0], weight, bias, unflattened
    return (mat1, weight, bias, node) if mat1.meta["val"].ndim == 2 else None


def _viewed_back(matmul: fx.Node, mat1: fx.Node) -> fx.Node | None:
    """Where ``mat1`` flattens an input of three dims or more to a matrix and ``matmul``'s one reader views the
    product back to that input's leading dims: that reader; else None."""
    x = mat1.args[0] if mat1.target in _FLATTENING_VIEWS else None
    if not isinstance(x, fx.Node) or x.meta.get("val") is None or x.meta["val"].ndim < 3 \
            or x.meta["val"].shape[-1] != mat1.meta["val"].shape[-1] or len(matmul.users) != 1:
        return None
    end = next(iter(matmul.users))
    wanted = (*x.meta["val"].shape[:-1], matmul.meta["val"].shape[-1])
    return end if end.target in _FLATTENING_VIEWS and tuple(end.meta["val"].shape) == wanted else None


def fuse_token_losses(gm: fx.GraphModule) -> int:
    """Each cross entropy's per-token losses as the capture decomposed them (the log-probability of each
    target gathered and negated, zero where the target is ``ignore_index``: ten ops, and a gather's backward
    scattering into zeros) as one ``aten.nll_loss_forward`` without reduction, in place; returns how many. The
    same values, with ``nll_loss_backward``'s C++ kernel for their gradient (the decomposed loss's forward
    and backward took 355 us a microbatch on the benchmark's last stage, 128 tokens of 1,024 classes, where
    ``F.cross_entropy`` takes 178)."""
    def token_losses(node: fx.Node) -> tuple[fx.Node, Callable[[fx.Graph], fx.Node]] | None:
        parts = _token_loss_parts(node)
        if parts is None:
            return None
        log_probs, target, ignore_index = parts

        def build(graph: fx.Graph) -> fx.Node:
            nll = graph.call_function(_aten.nll_loss_forward.default, (log_probs, target, None, 0, ignore_index))
            return graph.call_function(operator.getitem, (nll, 0))
        return node, build
    return _fused(gm, token_losses)


def _token_loss_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """Where ``node`` is ``where(target != ii, -squeeze(gather(log_probs, 1, unsqueeze(where(target != ii,
    target, 0), 1)), [1]), 0)``, the decomposed per-token loss of ``log_probs`` (tokens x classes) at
    ``target`` (tokens): (log_probs, target, ii); else None."""
    kept = _where_target_kept(node)
    if kept is None:
        return None
    target, ignore_index, negated = kept
    if not _is_call(negated, _aten.neg.default) or not _is_call(squeezed := negated.args[0], _aten.squeeze.dims) \
            or list(squeezed.args[1]) != [1] or not _is_call(gathered := squeezed.args[0], _aten.gather.default) \
            or gathered.args[1] != 1 or len(gathered.args) != 3 or gathered.kwargs:
        return None
    log_probs, index = gathered.args[0], gathered.args[2]
    if not _is_call(index, _aten.unsqueeze.default) or index.args[1] != 1:
        return None
    inner = _where_target_kept(index.args[0])
    if inner is None or inner[0] is not target or inner[1] != ignore_index or inner[2] is not target:
        return None
    values = [getattr(n, "meta", {}).get("val") for n in (log_probs, target)]
    if any(v is None for v in values) or values[0].ndim != 2 or values[1].ndim != 1 or values[1].dtype != torch.int64:
        return None
    return log_probs, target, ignore_index


def _where_target_kept(node: object) -> tuple[fx.Node, int, Any] | None:
    """Where ``node`` is ``where(target != ii, kept, 0)``: (target, ii, kept); else None."""
    if not _is_call(node, _aten.where.self) or not _is_zero(node.args[2]):
        return None
    condition, kept = node.args[0], node.args[1]
    if not _is_call(condition, _aten.ne.Scalar) or not isinstance(condition.args[1], int):
        return None
    return condition.args[0], condition.args[1], kept


def _is_zero(node: object) -> bool:
    """Whether ``node`` makes the scalar 0 (``scalar_tensor(0)``)."""
    return _is_call(node, _aten.scalar_tensor.default) and node.args[0] == 0


def _is_call(node: object, target: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _transposed_matrix(node: object) -> fx.Node | None:
    """The matrix ``node`` transposes (``t``, or ``permute`` by ``[1, 0]``), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is _aten.t.default or node.target is _aten.permute.default and list(node.args[1]) == [1, 0]:
        source = node.args[0]
        return source if isinstance(source, fx.Node) and source.meta.get("val") is not None \
            and source.meta["val"].ndim == 2 else None
    return None
