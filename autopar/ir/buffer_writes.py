"""Buffers a training step writes: BatchNorm's running statistics, a step counter, an EMA kept in a buffer.

``torch.export`` lists each write to a buffer as one more output of the functional graph, the buffer's new
value (BatchNorm's ``_native_batch_norm_legit_functional`` returns its new running mean and variance;
``num_batches_tracked += 1`` is an ``add``). Capture turns each such output into an op,
``autopar::write_buffer(value, name)``, inserted right after the value is computed and in its module (so a
layer's writes belong to the layer: tied across repeated layers, cut into the layer's pipeline stage, never
moved to the end of the graph), reading the value through a ``detach`` (no gradient flows into a buffer);
the step's outputs are then the model's alone, the loss first (``keep_buffer_writes``).

The planner places the op as one that runs whole (``strategies.WHOLE_OPS``): the value is brought to
``R`` on every mesh dim, as the buffer is placed (``written``: a written buffer is offered ``R`` only), a
few bytes a channel. At run time the op copies the value into the buffer it names, this rank's copy,
while the runtime holds ``writing_buffers`` open around a forward; anywhere else (planning traces, a
recomputation of the forward in backward, AOT autograd's trace on fake tensors) it writes nothing. The
program reads a fresh copy of each written buffer (``reading_copies``): ops save what they read for
backward (BatchNorm saves its running statistics), and autograd refuses a saved tensor written in place.
So each forward writes the buffer itself and the next forward reads what it wrote: microbatches in order,
on each pipeline stage as on one, as eager gradient accumulation does. (A torch ``nn.Module`` wrapped by
``DistributedDataParallel`` keeps each rank's own running statistics, computed on its own shard of the
batch; autopar computes them over the whole microbatch, as one process does, because BatchNorm's batch
statistics run whole: DTensor has no strategy that splits the batch of ``_native_batch_norm_legit``.)
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Mapping, Sequence

import torch
from torch import fx
from torch.distributed.tensor import DTensor

from autopar.core.errors import BadInputError


@torch.library.custom_op("autopar::write_buffer", mutates_args=())
def write_buffer(value: torch.Tensor, name: str) -> None:
    """Copy ``value`` into the buffer ``name`` of the ``writing_buffers`` open, if any (this rank's copy)."""
    write_values([name], [value])


@write_buffer.register_fake
def _write_buffer_fake(value: torch.Tensor, name: str) -> None:
    return None


WRITE_BUFFER = torch.ops.autopar.write_buffer.default
torch.fx.node.has_side_effect(WRITE_BUFFER)  # no output: kept by fx's dead-code elimination


_TARGETS: contextvars.ContextVar[Mapping[str, torch.Tensor] | None] = contextvars.ContextVar(
    "autopar_written_buffers", default=None)


def write_values(names: Sequence[str], values: Sequence[torch.Tensor]) -> None:
    """Copy each value into its buffer (``names``, in order) of the ``writing_buffers`` open, if any: a lowered
    program's written values, which leave its graphs as outputs (``passes/lower_writes.py``)."""
    targets = _TARGETS.get()
    if targets is None:
        return
    with torch.no_grad():
        for name, value in zip(names, values):
            target = targets.get(name)
            if target is not None:
                local = target.to_local() if isinstance(target, DTensor) else target
                local.copy_(value.to_local() if isinstance(value, DTensor) else value)


@contextlib.contextmanager
def writing_buffers(targets: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """While open, ``write_buffer`` ops write into ``targets`` (buffer name -> the rank's buffer)."""
    token = _TARGETS.set(targets)
    try:
        yield
    finally:
        _TARGETS.reset(token)


def written(graph: fx.Graph) -> set[str]:
    """The names of the buffers ``graph`` writes (its ``write_buffer`` ops')."""
    return {node.args[1] for node in graph.nodes if node.op == "call_function" and node.target is WRITE_BUFFER}


def reading_copies(values: Mapping[str, torch.Tensor], names: set[str]) -> Mapping[str, torch.Tensor]:
    """``values`` (buffer name -> tensor) with a fresh copy of each buffer ``names`` lists, for one forward to read
    while it writes the buffers themselves; ``values`` itself where it lists none (most steps, every microbatch)."""
    if not names:
        return values
    return {name: value.detach().clone() if name in names else value for name, value in values.items()}


def refuse_evaluation_that_writes(training: bool, names: set[str], call: str) -> None:
    """A call of a module in eval mode refused where its captured step writes buffers ``names``: that step was
    captured in training mode, where BatchNorm normalizes by the batch's statistics and updates its running
    ones; eval mode normalizes by the running statistics, a program autopar has not captured."""
    if training or not names:
        return
    raise BadInputError(
        f"{call} of a module in eval mode, whose step was captured in training mode writing its buffers "
        f"({', '.join(sorted(names))}: BatchNorm normalizes by each batch's statistics there and updates its running "
        "ones); in eval mode it would normalize by the running statistics, which the captured step does not: call "
        "pm.train(), or call model.eval() before autoparallelize to capture (and train) the model with its running "
        "statistics frozen; to evaluate, load pm's weights and buffers (pm.state_dict()) into the model")


def keep_buffer_writes(gm: fx.GraphModule, writes: Mapping[int, str]) -> None:
    """Turn the graph's outputs at the positions ``writes`` lists (position -> buffer name) into ``write_buffer``
    ops after their values, and drop them from the graph's outputs."""
    if not writes:
        return
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    (returned,) = output.args
    for position, buffer in writes.items():
        value = returned[position]
        with graph.inserting_after(value):
            cut = graph.call_function(torch.ops.aten.detach.default, (value,))
        with graph.inserting_after(cut):
            write = graph.call_function(WRITE_BUFFER, (cut, buffer))
        for node, val in ((cut, value.meta.get("val")), (write, None)):
            node.meta.update({k: v for k, v in value.meta.items() if k not in ("val", "tensor_meta")})
            node.meta["val"] = val
    output.args = (tuple(v for i, v in enumerate(returned) if i not in writes),)
    gm.recompile()
