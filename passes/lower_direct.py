"""A lowered program's forward and backward graphs called directly, as one autograd function, after its first call.

``lower.LoweredProgram`` runs a program as the graphs AOT autograd traced (``aot_module_simplified``), through
AOT's runtime wrapper: per call it unwraps each DTensor argument into its inner values, checks and saves the
forward's values for backward (detaching those that are views), wraps the outputs back into DTensors, and
in backward prepares the tangents and wraps the gradients. On a data-parallel step of the benchmark's GPT (2 gloo
ranks) the forward spent 0.54 ms a step outside its graph and the backward 0.76 ms outside its own and the
gradients' filing, most of it that wrapper's per-argument Python (72 arguments, 126 saved values).

``DirectGraphs.of`` reads, once, what that wrapper does for one program: the graphs' calling convention (a
DTensor argument flattens to its local tensor and its device mesh, ``DTensor.__tensor_flatten__``; the forward
returns the flattened outputs, then the values backward reads, in the order backward takes them; backward
takes those, then a tangent per flattened output, and returns a gradient per argument, none for a mesh) and
each output's spec, from the first call through AOT. It returns None, and the program keeps AOT's wrapper,
wherever the graphs do not read so: a DTensor argument with a gradient (its gradient would need wrapping), an
argument or output neither a tensor nor a DTensor, or graphs whose inputs and outputs do not add up so.
``DirectGraphs.__call__`` then runs ``_Graphs``, an ``autograd.Function`` whose forward calls the forward
graph and keeps what backward reads on its context, and whose backward calls the backward graph with the
gradient of each output; each output becomes a DTensor of its recorded spec by ``DTensor.from_local``, whose
backward hands the function its local gradient. Measured against the same program through AOT's wrapper,
alternated in one process (main-thread CPU a step, 60 steps): the data-parallel GPT 24.77 against 25.27 ms on
2 ranks, 14.85 against 15.31 on 4; Llama 13.80 against 14.12 on 4.

Where we diverge from torch: AOT's wrapper also handles input mutation, outputs aliasing inputs, functionalized
RNG, symbolic sizes and subclass tangents of another layout; a lowered program's graphs have none of those
(``build_program``'s programs are functional, their shapes static), and a tangent arrives in its output's
placements (the loss, replicated). Inductor-compiled graphs keep AOT's wrapper.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .lower_eager import from_local

Runner = Callable[[list[Any]], Any]
"""A graph called AOT's boxed way: one list of arguments (``lower._boxed``)."""


class DirectGraphs:
    """A program's forward and backward graphs (their runners) called as ``_Graphs``; see the module doc."""

    def __init__(self, forward: Runner, backward: Runner, flat_outputs: list[int], saved: int,
                 specs: list[DTensorSpec | None], meshes: list[bool]):
        self.forward_graph = forward
        self.backward_graph = backward
        self.flat_outputs = flat_outputs  # per output, how many values it flattens to (DTensor: 2, tensor: 1)
        self.locals = _first_of_each(flat_outputs)  # where each output's local tensor is among them
        self.saved = saved  # how many values the forward returns after the outputs, for backward
        self.specs = specs  # per output: the spec it is made a DTensor of, None: a plain tensor
        self.meshes = meshes  # per flattened argument: whether it is a DTensor's mesh (it has no gradient)

    @classmethod
    def of(cls, forward: fx.GraphModule, backward: fx.GraphModule, runners: tuple[Runner, Runner],
           args: Sequence[Any], outputs: Sequence[Any], returned: int) -> "DirectGraphs | None":
        """The program's graphs called directly, for arguments like ``args`` and outputs like ``outputs`` (a
        first call's, through AOT); ``returned``: how many values the forward runner returns (its graph's
        outputs, less those ``lower.LoweredProgram._deferring`` keeps). None where they do not read as the
        module doc says."""
        if any(isinstance(a, DTensor) and a.requires_grad for a in args) \
                or any(not isinstance(a, torch.Tensor) for a in args) \
                or any(not isinstance(o, torch.Tensor) for o in outputs):
            return None
        flat_args = sum(2 if isinstance(a, DTensor) else 1 for a in args)
        flat_outputs = [2 if isinstance(o, DTensor) else 1 for o in outputs]
        forward_inputs = [n for n in forward.graph.nodes if n.op == "placeholder"]
        backward_inputs = [n.name for n in backward.graph.nodes if n.op == "placeholder"]
        saved = [name for name in backward_inputs if not name.startswith("tangents_")]
        backward_output = next(n for n in backward.graph.nodes if n.op == "output").args[0]
        if len(forward_inputs) != flat_args or returned - sum(flat_outputs) != len(saved) \
                or backward_inputs[:len(saved)] != saved or len(backward_inputs) - len(saved) != sum(flat_outputs) \
                or len(backward_output) != len(args):
            return None
        tangents = [n for n in backward.graph.nodes if n.op == "placeholder"][len(saved):]
        firsts = _first_of_each(flat_outputs)  # each output's local tensor's tangent
        if any(t.users for i, t in enumerate(tangents) if i not in firsts):
            return None  # a mesh's tangent read: not the convention ``_Graphs.backward`` fills
        specs = [o._spec if isinstance(o, DTensor) else None for o in outputs]
        meshes = [mesh for a in args for mesh in ((False, True) if isinstance(a, DTensor) else (False,))]
        return cls(*runners, flat_outputs, len(saved), specs, meshes)

    def __call__(self, args: Sequence[Any]) -> tuple[Any, ...]:
        flat: list[Any] = []
        for a in args:
            flat += (a._local_tensor, a.device_mesh) if isinstance(a, DTensor) else (a,)
        tensors = _Graphs.apply(self, *flat)
        return tuple(from_local(t, spec.mesh, spec) if spec is not None else t for t, spec in zip(tensors, self.specs))


class _Graphs(torch.autograd.Function):
    """The forward graph, its values for backward kept on the context; the backward graph on them and the
    outputs' gradients (``DirectGraphs``)."""

    @staticmethod
    def forward(ctx: Any, graphs: DirectGraphs, *flat: Any) -> tuple[torch.Tensor, ...]:
        returned = list(graphs.forward_graph(list(flat)))
        outputs = sum(graphs.flat_outputs)
        ctx.graphs = graphs
        ctx.kept = returned[outputs:outputs + graphs.saved]
        return tuple(returned[i] for i in graphs.locals)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        graphs = ctx.graphs
        tangents: list[Any] = []
        for grad, n in zip(grads, graphs.flat_outputs):
            tangents += [grad] + [None] * (n - 1)  # a DTensor's mesh: no tangent the graph reads (``of``)
        kept = ctx.kept
        if not torch._C._autograd._get_current_graph_task_keep_graph():  # else a later backward reads them again
            ctx.kept = None
        result = iter(graphs.backward_graph([*kept, *tangents]))
        return (None, *(None if mesh else next(result) for mesh in graphs.meshes))


def _first_of_each(sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive groups of ``sizes`` values starts."""
    return [sum(sizes[:i]) for i in range(len(sizes))]
