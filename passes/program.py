"""``build_program``: the one ordered list of graph passes, from a Plan and the captured step to the
stage programs a runtime runs.

Every runtime (``ParallelModule``, ``PipelineParallelModule``) builds its program here, so the order is
written once. ``build_program`` reads as the recipe, one line per transformation (as torchtitan's
``parallelize_llama``): the captured graph is copied, then rewritten in place by the passes that change
what the program communicates and computes, then cut into stage programs, and each stage program is
wrapped for how it keeps activations for backward. A runtime may then lower a one-stage program to
graphs of local ops with explicit collectives (``lower.py``, ``ParallelModule(lowered=True)``).

Where we diverge from FX's pass infrastructure (``torch.fx.passes.infra``: ``PassBase`` returns a
``PassResult(graph_module, modified)``, ``PassManager`` runs a list of them): our passes take the plan's
arguments besides the graph module, so each is a plain function called on its line, and it returns
what it did (how many nodes it rewrote, where FX returns ``modified``) or the new modules it made. The
split turns one graph into several, which a ``PassManager`` of graph-to-graph passes cannot express.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.core.placement import strs_to_placements
from autopar.core.plan import Plan
from autopar.ir.bind import bind_ops
from autopar.ir.capture import VIEWS, CapturedGraph
from autopar.ir.float8 import float8_linears

from .checkpoint import checkpoint_layers, recomputed_with_layer
from .dropout_mode import follow_mode
from .dtensor_backward import keep_derivatives
from .float8 import StepCasts, cast_weights_once_a_step, run_in_float8
from .insert_redistributes import insert_redistributes, produced_placements
from .layout import guard_view_gradients
from .mixed_precision import cast_parameters
from .rematerialize import Rematerialized, recompute_in_backward, regathered_moves
from .reshard import ResavedParameters, parameter_values, reshard_after_forward
from .retarget_devices import retarget_devices
from .run_locally import run_locally
from .sequence_layout import balance_sequence
from .split_stages import Boundary, StageProgram, boundary_of, split_program, whole_program


@dataclass(frozen=True)
class Stage:
    """One stage program ready to run: ``module(*received, *placeholders)`` returns the values sent
    (the last stage's: the loss)."""

    program: StageProgram  # its graph and what it reads and sends, by value name
    module: nn.Module  # what runs: the graph, layers checkpointed as planned, re-gathering parameters in backward
    received: tuple[Boundary, ...]  # how each of ``program.inputs`` arrives
    sent: tuple[Boundary, ...]  # how each of ``program.outputs`` leaves


@dataclass(frozen=True)
class Program:
    """The per-rank program of a plan."""

    stages: tuple[Stage, ...]  # the whole program (one stage), or a pipeline plan's chunks in order
    redistributes: int  # redistribute nodes inserted (before the split)
    regathers_parameters: bool  # parameters gathered for an op are gathered again in backward
    dropout_ops: int  # ops that drop while training, off in eval mode (``dropout_mode.follow_mode``)
    step_casts: StepCasts  # float8 weights the stages read cast once a step, made by the runtime before the first
    # microbatch (``float8.cast_weights_once_a_step``)


def build_program(plan: Plan, captured: CapturedGraph, mesh: DeviceMesh) -> Program:
    """The captured step rewritten by the graph passes, in order, for one rank of ``mesh`` (a pipeline
    plan's: one stage's submesh)."""
    plan = bind_ops(plan, captured)
    program = fx.GraphModule(captured.graph_module, copy_graph(captured.graph))
    retarget_devices(program, mesh.device_type)
    produced = produced_placements(captured, plan)
    redistributes = insert_redistributes(program, plan.ops, produced, mesh)
    balance_sequence(program, plan, produced, parameter_values(captured))
    mode_of = _checkpointing_of(plan, captured.leading_layers)
    float8 = _float8_nodes(plan, captured)
    regathered = regathered_moves(program, produced, parameter_values(captured), tuple(mesh.shape),
                                  functools.partial(_keeps, captured, float8), recomputed_with_layer(program, mode_of))
    gathers = reshard_after_forward(program, parameter_values(captured))
    cast_parameters(program, parameter_values(captured), plan.precision)
    step_casts = StepCasts()
    if plan.precision.fp8 is not None:
        run_in_float8(program, float8, captured.gradient_kinds())
        step_casts = cast_weights_once_a_step(program, captured.params)
    dropping = follow_mode(program)  # before run_locally, which keeps the arguments it rewrites
    run_locally(program, plan.ops, mesh, plan.cp_layout)
    guard_view_gradients(program, VIEWS)
    keep_derivatives(program)
    remade = captured.saved_for_backward(float8).recomputed
    recomputed = recompute_in_backward(program, remade | regathered)
    pieces = (split_program(program, plan.pipeline.stages, captured.params, captured.user_inputs, captured.buffers)
              if _pipelined(plan) else [whole_program(program)])
    stages = tuple(_ready_to_run(piece, program, plan, mode_of, regathers=gathers > 0, recomputes=recomputed > 0)
                   for piece in pieces)
    return Program(stages, redistributes, gathers > 0, dropping, step_casts)


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` to rewrite, leaving the captured one as it is."""
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _whole_output(node: fx.Node, plan: Plan) -> bool:
    """Whether the plan leaves no output of ``node`` partial (selective checkpointing keeps only such
    outputs of the ops it keeps: ``checkpoint.py``)."""
    outputs = plan.ops.get(node.name, {}).get("outputs") or []
    return not any(p is not None and any(x.is_partial() for x in strs_to_placements(p)) for p in outputs)


def _pipelined(plan: Plan) -> bool:
    """Whether the plan cuts the program into pipeline stages."""
    return plan.degrees.pp > 1


def _keeps(captured: CapturedGraph, float8: frozenset[str], reader: str, value: str) -> bool:
    """Whether the captured op ``reader`` keeps for backward the value of node ``value`` it reads (False for
    nodes the passes inserted, which the captured step does not have)."""
    return (captured.has_node(reader) and captured.has_node(value)
            and captured.keeps_what_it_reads(captured.node(reader), captured.node(value), float8))


def _float8_nodes(plan: Plan, captured: CapturedGraph) -> frozenset[str]:
    """The nodes a plan runs as float8 matmuls (none without ``precision.fp8``)."""
    return float8_linears(captured) if plan.precision.fp8 is not None else frozenset()


def _checkpointing_of(plan: Plan, leading: tuple[str, ...]) -> Callable[[str], str]:
    """Each layer's activation checkpointing mode: the plan's, except for the ``leading`` layers that do not
    repeat, priced as the code before the layers is, never (``ir.layers.repeating_layers``)."""
    return lambda layer: "none" if layer in leading else plan.checkpointing_of(layer)


def _ready_to_run(piece: StageProgram, program: fx.GraphModule, plan: Plan, mode_of: Callable[[str], str],
                  regathers: bool, recomputes: bool) -> Stage:
    """``piece`` with its layers checkpointed as planned (``mode_of``), under ``Rematerialized`` when
    the program makes values again in backward and ``ResavedParameters`` when it gathers parameters (outside,
    so the first hooks hand it what they do not keep), and the placements of the values it receives and sends."""
    module = checkpoint_layers(piece.graph_module, mode_of, lambda node: _whole_output(node, plan))
    module = Rematerialized(module) if recomputes else module
    nodes = {node.name: node for node in program.graph.nodes}
    return Stage(piece, ResavedParameters(module) if regathers else module,
                 tuple(boundary_of(nodes[name], plan) for name in piece.inputs),
                 tuple(boundary_of(nodes[name], plan) for name in piece.outputs))
