"""Passes on the lowered graphs (``lower.py``): collectives bucketed, issued early, waited on late.

**Gradient all_reduces.** Data parallelism's gradient reductions (DP, HSDP's replica dim, an FSDP
plan's replicated parameters) are ``GradientSync``'s work in the DTensor runtime, after autograd has
produced each gradient. In a lowered program the backward is one graph, so the gradients would reach
``GradientSync`` only when it ends; instead the reduction moves into the graph:

* **marking** (``reduced_in_graph``): before tracing, each parameter ``GradientSync`` reduces passes
  through ``_ReducedInGraph``, an identity whose backward finds the gradient's partial mesh dims
  (known while tracing: DTensor placements are static) and replaces the gradient by
  ``autopar::reduce_gradient`` of its local tensor (the sync's semantics: summed on each partial dim
  in the reduction dtype, divided by the dim's size where the placement averages, cast back), labelled
  with the parameter's placements. The AOT wrapper then hands out reduced gradients, which
  ``GradientSync`` only stores;
* **bucketing** (``bucket_gradient_reductions``): in the backward graph the marked reductions of one
  kind (same mesh dims, divisors and reduction dtype) are cut into buckets in the order the graph
  produces their gradients, by ``gradient_sync.buckets``' rule (DDP's: a first bucket of 1 MB, then
  ``GradientSync.bucket_bytes``, 25 MB), and each bucket becomes one flat buffer the gradients are
  copied into, all-reduced in place (``_c10d_functional.all_reduce_``) per partial dim, launched right
  after its last gradient is produced and waited on just before the graph returns (DDP's overlap with
  the rest of backward); the gradients leave the graph as views of it, as DDP's are views of its
  bucket. Where nothing but those views reads it after its reduction (no division, no cast back), its
  wait leaves the graph for the end of the backward pass (``defer_bucket_waits``: DDP's final
  callback). A bucket is the collective ``GradientSync`` would issue for the same gradients, so the
  count per step is the plan's prediction (``autopar.inspect.collectives``).

**FSDP.** DTensor gathers every sharded parameter on its own, right before its reader, and its backward
reduce-scatters every gradient on its own. Per *unit* (a parameter's repeated layer, ``blocks.3``, or
outside layers its module, as ``fully_shard`` wraps each block and the root):

* ``bucket_parameter_gathers``: the unit's parameter all_gathers (same group and dtype) become one
  all_gather of their flattened inputs concatenated, launched right after the previous unit's wait
  (one unit ahead: it runs while that unit computes), its inputs' computation (a cast, a transposed
  copy: they read the parameter alone) moved up with it, and waited on right before the unit's first
  reader; each parameter's gathered value is cut out of the rank-major result. The same pass runs on
  the backward graph, whose regathers (reshard after forward) come in reverse unit order;
* ``bucket_gradient_scatters``: the unit's gradient reduce_scatters (those whose result becomes one
  parameter's gradient) become one reduce_scatter of the inputs' rank-major rows concatenated,
  launched right after the unit's last gradient input is produced, waited on when the graph ends.

**Sums of gathers** (``reduce_gathered_sums``): a gathered value read only by the sum of all its
elements (the loss's global mean gathers its per-token losses and its mask of counted targets so) is
replaced by the all_reduce of the local value's sum: one number per rank instead of every token's.

**Early launch** (``launch_from_inputs_first``): a collective of the forward graph whose input is computed
from graph inputs alone, none a parameter (the all_gather of the loss's mask of counted targets), is
launched at the graph's start, its wait left where it was, so no rank waits on it there. Not in backward,
whose inputs are the saved activations: sequence parallelism's gathers of them would all be in flight,
every layer's gathered copy alive, from backward's first op.

**Regathers launched ahead** (``launch_regathers_ahead``): in backward, an activation gathered again for the
ops that kept it (``rematerialize.py``: sequence parallelism's norm output, context parallelism's keys and
values; AOT's partition recomputes the all_gather right before its first reader) is launched before the
last op with FLOPs ahead of it (a matmul: ``torch.utils.flop_counter``'s registry), with the ops computing
its input from the saved shard, and waited on where it was: the gather runs beside that op, as
Megatron-LM's sequence-parallel linear layer issues its input's all_gather before its input-gradient GEMM.
Where no such op is ahead of it (the head's gather, first in backward), the next op with FLOPs that does not
read it (the input-gradient matmul) runs before its wait, Megatron-LM's order.
Not past another collective or its wait (the links carry collectives in launch order: the step's waits on
the others would then wait for it too), nor past an op that writes in place.

**Deferred loss** (``defer_output_waits``): the ops only the loss reads, from the wait on its
all-reduced sum on, move out of the forward graph into a graph of their own, run after backward, so
no rank waits for the others at the end of its forward.

A unit's bucket is one collective where the plan (priced per parameter on either runtime) counts one per
parameter; ``LoweredProgram.buckets`` records how many each merged.

Where we diverge from torch: inductor's own bucketing passes (``torch._inductor.fx_passes.bucketing``)
bucket by size (``bucket_cap_mb``) in compiled graphs; ours run on every lowered program, compiled or
not, and bucket gathers by the unit FSDP2 would wrap, so a layer's gathered parameters are alive no
longer than they are with ``fully_shard``.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from .gradient_sync import BUCKET_BYTES, buckets

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten


@torch.library.custom_op("autopar::reduce_gradient", mutates_args=())
def reduce_gradient(grad: torch.Tensor, groups: str, divisors: list[int], reduce_dtype: torch.dtype
                    ) -> torch.Tensor:
    """A partial gradient's local tensor reduced as ``GradientSync`` reduces it: in ``reduce_dtype``,
    summed over each of ``groups`` (process group names, comma-separated) in turn and divided by its
    divisor (the dim's size where the placement averages, else 1), cast back.
    ``bucket_gradient_reductions`` replaces every call in a backward graph; this is its meaning."""
    value = grad.to(reduce_dtype)
    for group, divisor in zip(groups.split(","), divisors):
        value = _c10d.wait_tensor(_c10d.all_reduce(value, "sum", group))
        if divisor != 1:
            value = value / divisor
    return value.to(grad.dtype)


@reduce_gradient.register_fake
def _(grad: torch.Tensor, groups: str, divisors: list[int], reduce_dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(grad)


REDUCE_GRADIENT = torch.ops.autopar.reduce_gradient.default


class _ReducedInGraph(torch.autograd.Function):
    """Identity forward; backward reduces a partial gradient with ``reduce_gradient`` (placements
    without the partial dims) and passes any other through."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.reduce_dtype = reduce_dtype
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if not isinstance(grad, DTensor):
            return grad, None
        partial = [(d, p.reduce_op) for d, p in enumerate(grad.placements) if isinstance(p, Partial)]
        if not partial:
            return grad, None
        mesh = grad.device_mesh
        local = grad.to_local()
        reduced = reduce_gradient(local, ",".join(mesh.get_group(d).group_name for d, _ in partial),
                                  [mesh.size(d) if op == "avg" else 1 for d, op in partial],
                                  ctx.reduce_dtype or local.dtype)
        placements = [Replicate() if isinstance(p, Partial) else p for p in grad.placements]
        return DTensor.from_local(reduced, mesh, placements, run_check=False), None


def reduced_in_graph(value: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    """``value`` (a parameter the program reads) marked so that its gradient leaves the backward graph
    reduced over its partial mesh dims, in ``reduce_dtype`` (None: the gradient's own)."""
    return _ReducedInGraph.apply(value, reduce_dtype)


def bucket_gradient_reductions(gm: fx.GraphModule, bucket_bytes: float = BUCKET_BYTES) -> list[int]:
    """Replace the ``reduce_gradient`` calls of ``gm`` (a backward graph) by bucketed flat all_reduces,
    in place; returns each bucket's gradient count, in launch order."""
    graph = gm.graph
    kinds: dict[tuple[Any, ...], list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.target is REDUCE_GRADIENT:
            _, groups, divisors, reduce_dtype = node.args
            kinds[(tuple(groups.split(",")), tuple(divisors), reduce_dtype)].append(node)
    output = next(n for n in graph.nodes if n.op == "output")
    order = {n: i for i, n in enumerate(graph.nodes)}
    made: list[tuple[int, int]] = []
    for (groups, divisors, reduce_dtype), nodes in kinds.items():
        nodes.sort(key=lambda n: order[n.args[0]])  # autograd runs the marks last; their gradients are earlier
        sizes = [_value(n.args[0]).numel() * reduce_dtype.itemsize for n in nodes]
        for bucket in buckets(sizes, bucket_bytes):
            members = [nodes[i] for i in bucket]
            ready = members[-1].args[0]
            _reduce_bucket(graph, members, ready, groups, divisors, reduce_dtype, output)
            made.append((order[ready], len(members)))
    return _bucket_sizes(gm, made)


def _bucket_sizes(gm: fx.GraphModule, made: list[tuple[int, int]]) -> list[int]:
    """``gm`` recompiled where a pass merged collectives (``made``: each bucket's (position, members)),
    and the members of each bucket in graph order."""
    recompiled(gm, len(made))
    return [count for _, count in sorted(made)]


def _reduce_bucket(graph: fx.Graph, members: Sequence[fx.Node], ready: fx.Node, groups: Sequence[str],
                   divisors: Sequence[int], reduce_dtype: torch.dtype, output: fx.Node) -> None:
    """One bucket, as DDP fills its own: a flat buffer in the reduction dtype, made when the bucket's first
    gradient is produced, each gradient copied (and cast) into its slice in the row-major layout of its
    shape as soon as it is produced (it dies there, where copies made at the end would hold every gradient
    of the bucket beside the buffer: a second copy of the gradients at that moment, which the plan's memory
    does not count), the first dim's all_reduce launched on the buffer in place after the last
    (``ready``); waited on (and reduced over any further dim, divided) before ``output``, cut into the
    members' slices viewed in their shapes and cast back, which the marks' users (moved after) read
    instead (copied out where some of them are read on: ``_copied_out``).

    One copy a gradient, where a ``cat`` of the flattened gradients, the functional ``all_reduce``
    (which clones its input) and an out-of-place division write three. Row-major is the parameters'
    layout, which ``AccumulateGrad``'s gradient layout contract asks for
    (torch/csrc/autograd/functions/accumulate_grad.h): the views are stored as the gradients, as DDP's
    bucket views are. The in-place all_reduce (``all_reduce_``, not in ``COLLECTIVES``: no pass moves it)
    reads what the copies before it wrote."""
    grads = [n.args[0] for n in members]  # in graph order: ``ready`` last
    users = _users_before(members, output)
    copied_out = _copied_out([_only_viewed_out(n) for n in members])
    with graph.inserting_before(grads[0].next):
        bucket = graph.call_function(_aten.empty.memory_format, ([sum(_value(g).numel() for g in grads)],),
                                     {"dtype": reduce_dtype, "device": _value(ready).device})
        slots = _slices(graph, bucket, grads)
        copied = graph.call_function(_aten.copy_.default, (slots[0], grads[0]))
    for slot, grad in zip(slots[1:], grads[1:]):
        with graph.inserting_before(grad.next):
            copied = graph.call_function(_aten.copy_.default, (slot, grad))
    with graph.inserting_before(copied.next):  # after the last gradient's copy
        value = graph.call_function(_c10d.all_reduce_.default, (bucket, "sum", groups[0]))
    with graph.inserting_before(output):
        for i, (group, divisor) in enumerate(zip(groups, divisors)):
            if i > 0:
                value = graph.call_function(_c10d.all_reduce_.default, (value, "sum", group))
            value = graph.call_function(_c10d.wait_tensor.default, (value,))
            if divisor != 1:
                value = graph.call_function(_aten.div_.Scalar, (value, divisor))
        for node, grad, piece, copy in zip(members, grads, _slices(graph, value, grads), copied_out):
            if copy and _value(grad).dtype == reduce_dtype:  # else the cast back copies it
                piece = graph.call_function(_aten.clone.default, (piece,))
            node.replace_all_uses_with(_cast(graph, piece, _value(grad).dtype, reduce_dtype))
    for node in members:
        graph.erase_node(node)
    for node in users:
        output.prepend(node)


WAITS_AT_BACKWARD_END = "waits_at_backward_end"
"""The submodule ``defer_bucket_waits`` gives a graph (``BackwardEndWaits``)."""
_BUCKET_VIEWS = frozenset({_aten.split_with_sizes.default, operator.getitem, _aten.view.default})


def defer_bucket_waits(gm: fx.GraphModule, first: Callable[[], None]) -> int:
    """Leave the waits on the gradient buckets of ``gm`` (a backward graph, ``bucket_gradient_reductions``'
    in-place all_reduces) to the end of the backward pass that runs it, in place: each wait whose value
    leaves the graph only through views (the bucket cut into its gradients: no division, no cast, no
    second reduction reads it) becomes a call of ``gm.waits_at_backward_end`` (``BackwardEndWaits``),
    which returns the buffer still in flight and, once autograd's engine has run the rest of the pass,
    runs ``first`` (the loss's end, ``LoweredProgram.finish``: its reduction, launched in forward, long
    done) and waits on it. Returns how many.

    DDP's ranks wait for their last bucket in autograd's final callback; a wait in the graph also
    kept the host work after it (the gradients' accumulation into their leaves and their filing as the
    parameters', ``lower._store_gradient``: a Python hook a gradient, 2.7 us of which making and storing its
    DTensor, by ``timeit``) off the bucket's flight. Only for a graph whose gradients reach leaves whose
    filing ``lower._store_gradient`` does (the program's local parameters): autograd's accumulation takes a gradient into an empty leaf without reading it (the
    bucket views obey the gradient layout contract), and the filing waits first where it adds to a
    gradient already held. Uncompiled graphs only (inductor compiles no module call).

    Measured (2 and 4 gloo ranks, the benchmark's data-parallel GPT and Llama, a program lowered with and
    one without this pass alternating step by step in one process, the median of their paired step times'
    ratios over 30-60 steps): on 2 ranks GPT 0.948-0.961, Llama 0.985-0.992; on 4, GPT 0.918 and 0.961, Llama
    1.022."""
    graph = gm.graph
    waits = [n for n in graph.nodes if n.target is _c10d.wait_tensor.default
             and n.args[0].target is _c10d.all_reduce_.default and _only_viewed_out(n)]
    if not waits:
        return 0
    gm.add_submodule(WAITS_AT_BACKWARD_END, BackwardEndWaits(first))
    for wait in waits:
        with graph.inserting_before(wait):
            deferred = graph.call_module(WAITS_AT_BACKWARD_END, (wait.args[0],))
        deferred.meta["val"] = wait.meta.get("val")
        wait.replace_all_uses_with(deferred)
        graph.erase_node(wait)
    return recompiled(gm, len(waits))


def _only_viewed_out(node: fx.Node) -> bool:
    """Whether every path from ``node`` to its graph's output runs through views alone."""
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user.op == "output":
            continue
        if user.op != "call_function" or user.target not in _BUCKET_VIEWS:
            return False
        stack.extend(user.users)
    return True


class BackwardEndWaits(nn.Module):
    """Called by a backward graph with a bucket it launched, instead of waiting on it there: returns the
    bucket, its reduction still in flight, and in a final callback of autograd's engine (where DDP waits on
    its own), after the gradients' accumulation, runs ``first`` and waits on every bucket of the pass; run
    outside the engine (a graph called directly), waits at once. A pass that failed before its callback
    ran left its buckets here: the next pass waits on them first."""

    def __init__(self, first: Callable[[], None]) -> None:
        super().__init__()
        self.first = first
        self.pending: list[torch.Tensor] = []
        self._pass = -1  # the engine's graph task whose callback waits on ``pending``

    def forward(self, bucket: torch.Tensor) -> torch.Tensor:
        current = torch._C._current_graph_task_id()
        if current == -1:
            return _c10d.wait_tensor(bucket)
        if current != self._pass:
            self.wait()
            self._pass = current
            torch.autograd.Variable._execution_engine.queue_callback(self.first_then_wait)
        self.pending.append(bucket)
        return bucket

    def first_then_wait(self) -> None:
        self.first()
        self.wait()

    def wait(self) -> None:
        for bucket in self.pending:
            _c10d.wait_tensor(bucket)
        self.pending.clear()


def _slices(graph: fx.Graph, flat: fx.Node, like: Sequence[fx.Node]) -> list[fx.Node]:
    """``flat`` cut into consecutive pieces of the sizes of ``like``'s values, each viewed (row-major) in
    its shape (a 1-D piece is already)."""
    values = [_value(n) for n in like]
    pieces = graph.call_function(_aten.split_with_sizes.default, (flat, [v.numel() for v in values]))
    cut = [graph.call_function(operator.getitem, (pieces, i)) for i in range(len(values))]
    return [piece if v.ndim == 1 else graph.call_function(_aten.view.default, (piece, list(v.shape)))
            for piece, v in zip(cut, values)]


def _users_before(members: Sequence[fx.Node], output: fx.Node) -> list[fx.Node]:
    """Every node that reads ``members`` (directly or not) other than ``output``, in graph order."""
    found: dict[fx.Node, None] = {}
    stack = list(members)
    while stack:
        for user in stack.pop().users:
            if user is not output and user not in found:
                found[user] = None
                stack.append(user)
    order = {n: i for i, n in enumerate(output.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _cast(graph: fx.Graph, node: fx.Node, dtype: torch.dtype, current: torch.dtype | None = None) -> fx.Node:
    """``node`` converted to ``dtype`` (itself when it already has it)."""
    if (current or _value(node).dtype) == dtype:
        return node
    return graph.call_function(torch.ops.prims.convert_element_type.default, (node, dtype))


def _value(node: fx.Node) -> torch.Tensor:
    """The example (fake) value AOT autograd recorded for ``node``."""
    return node.meta["val"]


@dataclass
class _Gather:
    """A parameter's all_gather in a lowered graph: the collective, its wait, and the ops computing its
    input from the parameter alone (a cast, a transpose's copy), in graph order."""

    gather: fx.Node
    wait: fx.Node
    chain: list[fx.Node]


def bucket_parameter_gathers(gm: fx.GraphModule, units: Mapping[str, str]) -> list[int]:
    """Gather each unit's parameters (``units``: parameter placeholder name -> its layer, or its module
    outside layers) with one flat all_gather per mesh dim and dtype, in place: each unit's launched
    right after the previous unit's wait (one unit ahead; the first where it was), waited on right
    before its first use. Returns each bucket's gather count, in launch order."""
    graph = gm.graph
    found: dict[tuple[Any, ...], list[_Gather]] = defaultdict(list)
    for node in graph.nodes:
        if node.target is not _c10d.all_gather_into_tensor.default or not _waited_once(node):
            continue
        source = _from_one_parameter(node.args[0], units)
        if source is not None:
            placeholder, chain = source
            _, size, group = node.args
            found[(units[placeholder.name], size, group, _value(node.args[0]).dtype)].append(
                _Gather(node, next(iter(node.users)), chain))
    order = {n: i for i, n in enumerate(graph.nodes)}
    ordered = sorted(found.items(), key=lambda item: order[item[1][0].gather])
    previous_wait: fx.Node | None = None
    for (_, size, group, _), members in ordered:
        launch = previous_wait.next if previous_wait is not None else members[0].gather
        previous_wait = _gather_bucket(graph, members, launch, size, group)
    recompiled(gm, len(ordered))
    return [len(members) for _, members in ordered]


def _gather_bucket(graph: fx.Graph, members: Sequence[_Gather], launch: fx.Node, size: int, group: str) -> fx.Node:
    """One unit's gathers as one: inputs computed and flattened, concatenated and gathered before
    ``launch``; waited on before the first member's wait, each member's gathered value cut out of the
    rank-major result. Returns the new wait."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted({n for m in members for n in m.chain}, key=order.__getitem__):
        if order[node] > order[launch]:
            launch.prepend(node)
    inputs = [m.gather.args[0] for m in members]
    with graph.inserting_before(launch):
        flat = [graph.call_function(_aten.reshape.default, (x, [-1])) for x in inputs]
        gathered = graph.call_function(_c10d.all_gather_into_tensor.default,
                                       (graph.call_function(_aten.cat.default, (flat,)), size, group))
    first_wait = min((m.wait for m in members), key=order.__getitem__)
    numels = [_value(x).numel() for x in inputs]
    with graph.inserting_before(first_wait):
        wait = graph.call_function(_c10d.wait_tensor.default, (gathered,))
        rows = graph.call_function(_aten.view.default, (wait, [size, sum(numels)]))
        pieces = graph.call_function(_aten.split_with_sizes.default, (rows, numels, 1))
        for i, (member, x) in enumerate(zip(members, inputs)):
            shape = list(_value(x).shape)
            piece = graph.call_function(operator.getitem, (pieces, i))
            if len(members) > 1:  # a column block of the rows: made contiguous, as the gathered value it replaces was
                piece = graph.call_function(_aten.clone.default, (piece,), {"memory_format": torch.contiguous_format})
            member.wait.replace_all_uses_with(
                graph.call_function(_aten.view.default, (piece, [size * shape[0], *shape[1:]])))
    for member in members:
        graph.erase_node(member.wait)
        graph.erase_node(member.gather)
    return wait


def bucket_gradient_scatters(gm: fx.GraphModule, units: Mapping[str, str]) -> list[int]:
    """Reduce-scatter each unit's parameter gradients (``units`` as ``bucket_parameter_gathers``'; the
    backward graph's outputs are the gradients of the forward's ``primals_<i+1>``, in order) with one
    flat reduce_scatter per mesh dim, reduction and dtype, in place: launched right after the unit's
    last gradient is produced, waited on just before the graph returns. Returns each bucket's
    reduce_scatter count, in launch order."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    found: dict[tuple[Any, ...], list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.target is not _c10d.reduce_scatter_tensor.default or not _waited_once(node):
            continue
        unit = units.get(_gradient_of(next(iter(node.users)), output) or "")
        if unit is not None:
            _, op, size, group = node.args
            found[(unit, op, size, group, _value(node.args[0]).dtype)].append(node)
    made = []
    for (_, op, size, group, _), members in found.items():
        # ordered afresh: a gradient split on two mesh dims is scattered on one, then on the other, whose input
        # an earlier bucket of the first dim may have remade
        order = {n: i for i, n in enumerate(graph.nodes)}
        ready = max((m.args[0] for m in members), key=order.__getitem__)
        _scatter_bucket(graph, members, ready, op, size, group, output)
        made.append((ready, len(members)))
    order = {n: i for i, n in enumerate(graph.nodes)}
    return _bucket_sizes(gm, [(order[ready], count) for ready, count in made])


def _scatter_bucket(graph: fx.Graph, members: Sequence[fx.Node], ready: fx.Node, op: str, size: int, group: str,
                    output: fx.Node) -> None:
    """One unit's reduce_scatters as one: each input's rank-major rows concatenated right after
    ``ready``, reduce-scattered; waited on before ``output``, each member's shard cut out, what read
    the members' waits moved after; where some members are read on (a gradient split on two mesh dims,
    reduce-scattered on the other next), the others' shards are copied out (``_copied_out``). (Filled as
    each input is produced instead, as ``_reduce_bucket`` fills its buffer, each unit's buffer is held
    from its first input on: measured, tiny-gpt's FSDP step on 2 ranks then peaked at 3.54 MB where this
    concatenation peaks at 2.91 MB, benchmarks/README.md.)"""
    waits = [next(iter(m.users)) for m in members]
    users = _users_before(waits, output)
    copied_out = _copied_out([_only_viewed_out(w) for w in waits])
    inputs = [m.args[0] for m in members]
    with graph.inserting_before(ready.next):
        rows = [graph.call_function(_aten.reshape.default, (x, [size, -1])) for x in inputs]
        flat = graph.call_function(_aten.reshape.default, (graph.call_function(_aten.cat.default, (rows, 1)), [-1]))
        scattered = graph.call_function(_c10d.reduce_scatter_tensor.default, (flat, op, size, group))
    with graph.inserting_before(output):
        wait = graph.call_function(_c10d.wait_tensor.default, (scattered,))
        shapes = [list(_value(w).shape) for w in waits]
        pieces = graph.call_function(_aten.split_with_sizes.default, (wait, [_value(w).numel() for w in waits]))
        for i, (old, shape) in enumerate(zip(waits, shapes)):
            piece = graph.call_function(operator.getitem, (pieces, i))
            if copied_out[i]:
                piece = graph.call_function(_aten.clone.default, (piece,))
            old.replace_all_uses_with(graph.call_function(_aten.view.default, (piece, shape)))
    for old, member in zip(waits, members):
        graph.erase_node(old)
        graph.erase_node(member)
    for node in users:
        output.prepend(node)


def _copied_out(handed_out: Sequence[bool]) -> list[bool]:
    """Per member of a bucket, whether its slice leaves the graph as a copy: a gradient handed out as a view
    of the bucket (``handed_out``) holds all of it, so where other members are read on (cut to a shard,
    reduced again on another dim) the handed-out slices are copied and the bucket dies once those reads
    are done; where every member is handed out, the views together are the bucket, as DDP's are."""
    return [out and not all(handed_out) for out in handed_out]


def _waited_once(collective: fx.Node) -> bool:
    """Whether ``collective``'s only reader is its ``wait_tensor``."""
    users = list(collective.users)
    return len(users) == 1 and users[0].target is _c10d.wait_tensor.default


def _from_one_parameter(node: fx.Node, units: Mapping[str, str]) -> tuple[fx.Node, list[fx.Node]] | None:
    """The parameter placeholder ``node`` is computed from alone (one of ``units``) by local ops, and the
    ops in between; None when it reads anything else, or another collective's result (a parameter split on
    two mesh dims is gathered on one, then on the other: the second gather waits for the first, and the
    first's bucket replaces its nodes)."""
    found = _computed_from(node, lambda current: current.op != "call_function"
                           or getattr(current.target, "namespace", None) == "_c10d_functional")
    if found is None or len(found[1]) != 1:
        return None
    chain, (placeholder,) = found
    return (placeholder, chain) if placeholder.name in units else None


def _computed_from(node: fx.Node, ends: Callable[[fx.Node], bool]) -> tuple[list[fx.Node], set[fx.Node]] | None:
    """``node`` and the ops upstream of it, and the placeholders they read; None where an op upstream
    ``ends`` the walk."""
    chain: list[fx.Node] = []
    placeholders: set[fx.Node] = set()
    stack, seen = [node], {node}
    while stack:
        current = stack.pop()
        if current.op == "placeholder":
            placeholders.add(current)
            continue
        if ends(current):
            return None
        chain.append(current)
        for source in current.all_input_nodes:
            if source not in seen:
                seen.add(source)
                stack.append(source)
    return chain, placeholders


def _gradient_of(node: fx.Node, output: fx.Node) -> str | None:
    """The forward placeholder (``primals_<i+1>``) whose gradient ``node`` alone becomes: the one
    backward output it reaches, through its readers."""
    stack, seen = [node], {node}
    while stack:
        for user in stack.pop().users:
            if user is not output and user not in seen:
                seen.add(user)
                stack.append(user)
    reached = {i for i, value in enumerate(output.args[0]) if value in seen}
    return f"primals_{reached.pop() + 1}" if len(reached) == 1 else None


_FULL_SUMS = frozenset({_aten.sum.dim_IntList, _aten.sum.default})


def reduce_gathered_sums(gm: fx.GraphModule) -> int:
    """Replace every all_gather whose gathered value is only summed whole by the all_reduce of the local
    value's sum, in place: launched where the gather was, waited on where the sum was. Returns how
    many.

    A rank-major gather concatenates the ranks' values along dim 0, so the sum of all its elements is
    the sum of the ranks' sums. The plan gathers a global mean's per-token values this way (DTensor
    offers no partial strategy for ``sum.dim_IntList(x, [])``, the form the loss's ``mean`` takes in the
    captured graph); an all_reduce of one number instead moves no per-token data and skips the
    gathered buffer. The sum's order of additions changes (ranks' sums added last), not its value
    beyond rounding."""
    graph = gm.graph
    replaced = 0
    for gather in list(graph.nodes):
        if gather.target is not _c10d.all_gather_into_tensor.default or not _waited_once(gather):
            continue
        total = _summed_whole(next(iter(gather.users)))
        if total is None:
            continue
        source, _, group = gather.args
        with graph.inserting_before(gather):
            local = graph.call_function(total.target, (source, *total.args[1:]), dict(total.kwargs))
            reduced = graph.call_function(_c10d.all_reduce.default, (local, "sum", group))
        with graph.inserting_before(total):
            wait = graph.call_function(_c10d.wait_tensor.default, (reduced,))
        for node in (local, reduced, wait):
            node.meta["val"] = total.meta["val"]
        total.replace_all_uses_with(wait)
        dropped = [total]
        while dropped[-1] is not gather:
            dropped.append(dropped[-1].args[0])
        for node in dropped:
            graph.erase_node(node)
        replaced += 1
    return recompiled(gm, replaced)


def _summed_whole(wait: fx.Node) -> fx.Node | None:
    """The sum of every element of the gathered value ``wait`` (read alone, maybe through a slice of
    dim 0 that keeps every row), when that is its only reader; else None."""
    value = wait
    (reader,) = value.users if len(value.users) == 1 else (None,)
    if reader is not None and reader.target is _aten.slice.Tensor and _keeps_all_rows(reader):
        value = reader
        (reader,) = value.users if len(value.users) == 1 else (None,)
    if reader is None or reader.target not in _FULL_SUMS or reader.args[0] is not value:
        return None
    if reader.target is _aten.sum.dim_IntList:
        dims = reader.args[1] if len(reader.args) > 1 else reader.kwargs.get("dim")
        keepdim = reader.args[2] if len(reader.args) > 2 else reader.kwargs.get("keepdim", False)
        ndim = _value(value).ndim
        if keepdim or sorted(d % max(ndim, 1) for d in (dims or [])) not in ([], list(range(ndim))):
            return None
    return reader


def _keeps_all_rows(node: fx.Node) -> bool:
    """Whether ``node`` (``aten.slice.Tensor``) keeps every row of its input's dim 0, in order."""
    if node.kwargs:
        return False
    source, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    rows = _value(source).shape[0]
    return dim == 0 and (start or 0) == 0 and (end is None or end >= rows) and step == 1


def recompiled(gm: fx.GraphModule, changes: int) -> int:
    """After a pass made ``changes`` rewrites of ``gm``'s graph (none: nothing to do), check the graph and
    regenerate its code; returns ``changes``."""
    if changes:
        gm.graph.lint()
        gm.recompile()
    return changes


COLLECTIVES = frozenset({_c10d.all_gather_into_tensor.default, _c10d.all_reduce.default,
                         _c10d.reduce_scatter_tensor.default, _c10d.all_to_all_single.default})


def launch_from_inputs_first(gm: fx.GraphModule, parameters: Collection[str]) -> int:
    """Launch every collective computed from graph inputs alone, none of them a parameter (in the
    forward, the loss's mask of counted targets), at the graph's start, with the ops computing its
    input, in place; its wait stays where it was. Returns how many moved."""
    graph = gm.graph
    cursor = next(n for n in graph.nodes if n.op != "placeholder")
    moved = 0
    for node in list(graph.nodes):
        if node.target not in COLLECTIVES or not _waited_once(node):
            continue
        chain = from_inputs_alone(node, parameters)
        if chain is None:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        for step in sorted(chain, key=order.__getitem__):
            if step is cursor:
                cursor = cursor.next
            elif order[step] > order[cursor]:
                cursor.prepend(step)
        moved += 1
    return recompiled(gm, moved)


def from_inputs_alone(collective: fx.Node, parameters: Collection[str]) -> list[fx.Node] | None:
    """``collective`` and the ops computing its inputs when they read graph inputs alone, none in
    ``parameters``; else None."""
    found = _computed_from(collective, lambda current: current.op != "call_function" or (
        current is not collective and current.target in COLLECTIVES))
    if found is None or any(p.name in parameters for p in found[1]):
        return None
    return found[0]


def launch_regathers_ahead(gm: fx.GraphModule) -> int:
    """Run each regathered activation's all_gather (one AOT's partition recomputes in backward, tagged
    ``MUST_RECOMPUTE`` by ``rematerialize.tag_recomputed``) beside an op with FLOPs, in place: launched before
    the one ahead of it, with the ops computing its input, its wait left where it was; where there is none (the
    head's, first in backward), the next one that does not read it runs before its wait. Returns how many."""
    moved = 0
    for node in list(gm.graph.nodes):
        if (node.target is _c10d.all_gather_into_tensor.default and _waited_once(node)
                and node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE):
            moved += _beside_compute(node)
    return recompiled(gm, moved)


def _beside_compute(collective: fx.Node) -> bool:
    """Launch ``collective`` before the op with FLOPs ahead of it (``_compute_ahead``), or else run the next one
    that does not read it before its wait (``_compute_behind``: Megatron-LM's order, the input-gradient GEMM
    between the input's gather and the weight-gradient GEMM); False where neither can move."""
    anchor = _compute_ahead(collective)
    if anchor is not None and _moved_before(collective, anchor):
        return True
    wait = next(iter(collective.users))
    later = _compute_behind(wait)
    return later is not None and _moved_before(later, wait)


def _moved_before(node: fx.Node, anchor: fx.Node) -> bool:
    """Move ``node`` and the ops computing its inputs that lie after ``anchor`` before ``anchor``, keeping their
    order; False (nothing moved) where ``anchor`` is among them."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    chain, stack = {node}, [node]
    while stack:
        for source in stack.pop().all_input_nodes:
            if source is anchor:
                return False
            if order[source] > order[anchor] and source not in chain:
                chain.add(source)
                stack.append(source)
    for moved in sorted(chain, key=order.__getitem__):
        anchor.prepend(moved)
    return True


def _compute_behind(wait: fx.Node) -> fx.Node | None:
    """The nearest op after ``wait`` that has FLOPs and does not read its value, directly or through other ops,
    where no collective, wait or in-place write lies between them; else None."""
    reading, current = {wait}, wait.next
    while current.op == "call_function" and not _orders_communication(current):
        if any(source in reading for source in current.all_input_nodes):
            reading.add(current)
        elif _has_flops(current):
            return current
        current = current.next
    return None


def _compute_ahead(node: fx.Node) -> fx.Node | None:
    """The nearest op before ``node`` that has FLOPs (``torch.utils.flop_counter``'s registry: matmuls,
    attention, convolutions), where no collective, wait or in-place write lies between them; else None."""
    current = node.prev
    while current.op == "call_function" and not _orders_communication(current):
        if _has_flops(current):
            return current
        current = current.prev
    return None


def _has_flops(node: fx.Node) -> bool:
    """Whether ``node`` is an op ``torch.utils.flop_counter`` counts FLOPs of (matmuls, attention, convolutions)."""
    return getattr(node.target, "overloadpacket", None) in flop_registry


def _orders_communication(node: fx.Node) -> bool:
    """Whether ops may not move across ``node``: a collective or its wait (``_c10d_functional``), or an op
    that writes in place (what is moved above it would read the value before the write)."""
    schema = getattr(node.target, "_schema", None)
    return (getattr(node.target, "namespace", None) == "_c10d_functional"
            or (schema is not None and schema.is_mutable))


def defer_output_waits(gm: fx.GraphModule, slot: int = 0) -> fx.GraphModule | None:
    """Move the end of the computation of ``gm``'s output ``slot`` (the loss) out of ``gm``, from the waits
    of its collectives on, in place: the ops only that output reads (up to, not including, collective
    launches), when they wait on a collective. ``gm`` then returns in that slot an empty tensor of the
    output's shape and dtype, and after its own outputs the values those ops read (the launched, unwaited
    collective among them); returns the moved ops as a graph of those values (in that order) to the
    output's value, or None (nothing moved) when no wait is among them.

    The forward's last op is the loss's global mean, a division of its all-reduced sum: waiting there
    makes every rank wait for the slowest one at the end of its forward, where DDP's ranks meet only
    in the gradient buckets' waits at the end of backward. Run the returned graph after backward and
    write its value into the slot (``LoweredProgram.finish``), and the loss costs no wait of its own."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    value = outputs[slot]
    if not isinstance(value, fx.Node) or value.op != "call_function" or len(value.users) != 1 or outputs.count(value) != 1:
        return None
    tail = read_only_by(value)
    if not any(n.target is _c10d.wait_tensor.default for n in tail):
        return None
    epilogue, moved, inputs = graph_of(tail, value)
    fake = _value(value)
    with graph.inserting_before(output):
        empty = graph.call_function(_aten.empty.memory_format, (list(fake.shape),),
                                    {"dtype": fake.dtype, "device": fake.device})
    empty.meta["val"] = fake
    outputs[slot] = empty
    output.args = (tuple(outputs) + tuple(inputs),)
    for node in reversed(moved):
        graph.erase_node(node)
    recompiled(gm, 1)
    return fx.GraphModule(gm, epilogue)


def graph_of(nodes: Collection[fx.Node], value: fx.Node | Sequence[fx.Node]
             ) -> tuple[fx.Graph, list[fx.Node], list[fx.Node]]:
    """A graph computing ``value`` (or a list of values) by ``nodes`` (of one graph), their order kept, from a
    placeholder for each value they read from outside them (a value not among them is one); and those nodes
    and those values, in order."""
    values = [value] if isinstance(value, fx.Node) else list(value)
    order = {n: i for i, n in enumerate(values[0].graph.nodes)}
    moved = sorted(nodes, key=order.__getitem__)
    inputs = sorted({i for n in moved for i in n.all_input_nodes if i not in nodes}
                    | {v for v in values if v not in nodes}, key=order.__getitem__)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta["val"] = node.meta.get("val")
    for node in moved:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[value] if isinstance(value, fx.Node) else [env[v] for v in values])
    return graph, moved, inputs


def read_only_by(value: fx.Node) -> set[fx.Node]:
    """``value`` and the ops upstream of it that nothing else reads, collective launches excluded."""
    tail = {value}
    nodes = list(value.graph.nodes)
    for node in reversed(nodes[:nodes.index(value)]):
        if node.op == "call_function" and node.target not in COLLECTIVES and node.users and set(node.users) <= tail:
            tail.add(node)
    return tail
