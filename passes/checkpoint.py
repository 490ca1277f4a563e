"""Activation checkpointing: run each repeated layer of the program under ``torch.utils.checkpoint``.

The plan says, per repeated layer, which activations it keeps for backward (``Plan.checkpointing_of``:
one mode for every layer, or each layer's own under ``mixed`` checkpointing, as the solver chose and
``autopar.planning.stages`` priced it); this pass makes the runtime keep exactly those:

* ``none``: the layer runs as captured (a program with no recomputed layer is returned unchanged);
* ``core_attention`` (Megatron-LM's selective recomputation): each attention core of the layer
  (``autopar.ir.layers.attention_cores``: ``QK^T`` to ``AV``, or one fused attention kernel, with the
  redistributes that feed only it) is cut out of the program into one submodule run under
  ``checkpoint(..., use_reentrant=False)`` with torch's default policy: it keeps its inputs (q, k, v,
  the mask), recomputes everything inside (the ``s x s`` scores, softmax, dropout, under the same RNG
  state) in backward, and the rest of the layer runs as under ``none``;
* ``full``: each layer runs inside ``checkpoint(..., use_reentrant=False)``, so only its inputs are
  kept and every op of the layer runs again in backward. The layer's output is saved by the ops
  that read it (the next layer's checkpoint keeps it as its input), as Megatron-LM's full recompute;
* ``selective``: the same, with torch's selective activation checkpointing
  (``create_selective_checkpoint_contexts``): linear-layer (``mm``/``addmm``) and fused-attention
  outputs are ``MUST_SAVE``, everything else, an unfused attention's ``s x s`` scores included,
  ``PREFER_RECOMPUTE`` (Korthikanti et al. 2022); except a matmul the plan leaves ``Partial`` (a
  row-parallel linear layer before its reduction): its output is as large as the unsharded
  activation and no backward needs it, so it is recomputed rather than kept, which keeps selective
  below no recomputation in memory under tensor parallelism;
* ``save_dot_except_mlpwi`` (MaxText's policy): as selective, with an MLP's input projections
  (``autopar.ir.layers.widens``) and fused attention recomputed too.

How: core_attention's cores first, each cut out by ``torch.fx``'s ``fuse_by_partitions`` into a
submodule called where it was (a core is convex: every path between two of its nodes stays inside it,
``attention_cores``). Then ``torch.fx.passes.split_module`` cuts the program into submodules, one per
contiguous run of nodes of the same layer (``autopar.ir.layers.layer_of``) or of nodes outside any layer; every layer
submodule is then replaced by a ``CheckpointedLayer`` wrapping it. Values in the program are
DTensors and the redistributes the earlier passes inserted are ordinary nodes, so a recomputed
layer re-runs its forward collectives in backward: on every rank, in the same order, which is what
the cost model prices (``stages._staged_edge``).

Where we diverge from splitting purely by ``layer_of``: nodes the earlier passes inserted
(``redistribute``, the replicated wrapping of factory ops) carry no module path (every captured op
does: ``torch.export`` records an ``nn_module_stack`` for each, the loss's included). Each joins the
layer of the ops that read it (a redistribute moves an op's input, so it belongs to that op, and a
collective feeding a recomputed op is recomputed with it), or, if those disagree, the layer of its
input. Partitions are numbered by contiguous runs rather than by layer name so that the code before
the first layer and after the last (embedding, head, loss) are separate partitions, which keeps the
partition graph acyclic even where layer membership is not contiguous.

The kept op set is ``autopar.ir.layers.KEPT_UNDER_SELECTIVE``, the list pricing uses. The policy sees
the op as dispatched at run time (after composite ops are decomposed), not the captured node, which is
why the list names the fused attention kernels as well as the composite. Which of a layer's kept-list
ops to save is decided per node from the plan (``keeps_output``); the policy sees no node, so it reads
those decisions in order, one per kept-list op dispatched (each such node dispatches one: DTensor runs
an ``mm`` node as one local ``mm``, ``run_locally`` a fused attention node as one kernel), counting the
forward and the recomputation apart. Were the count off, a different op would be saved: memory, never
numerics, would differ, since the recomputation replays the same decisions.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn)

from autopar.core.plan import CHECKPOINTING, SELECTIVE_MODES
from autopar.ir.layers import attention_cores, is_fused_attention, kept_under_selective, layer_of, widens

from .rematerialize import recomputed_op
from .run_locally import run_local_op

def selective_contexts(saves: Sequence[bool]) -> Any:
    """``checkpoint``'s ``context_fn`` for one call of a selectively recomputed layer: the ``i``-th op of
    the kept list it dispatches is ``MUST_SAVE`` when ``saves[i]``, every other op ``PREFER_RECOMPUTE``."""
    seen = {False: 0, True: 0}  # kept-list ops dispatched so far, in the forward and in the recomputation

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if not kept_under_selective(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        i = seen[ctx.is_recompute]
        seen[ctx.is_recompute] += 1
        return CheckpointPolicy.MUST_SAVE if i < len(saves) and saves[i] else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def recompute_contexts(checkpointing: str, saves: Sequence[bool] = ()) -> Callable[[], Any]:
    """``checkpoint``'s ``context_fn``: selective's policy (``saves``: per kept-list op of the layer, in
    order, whether to keep its output), or torch's default (recompute everything)."""
    if checkpointing in SELECTIVE_MODES:
        return functools.partial(selective_contexts, tuple(saves))
    return noop_context_fn


class CheckpointedLayer(nn.Module):
    """One repeated layer's subgraph, run under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, layer: fx.GraphModule, name: str, checkpointing: str, saves: Sequence[bool] = ()):
        super().__init__()
        self.layer = layer
        self.layer_name = name
        self.checkpointing = checkpointing
        self._context_fn = recompute_contexts(checkpointing, saves)

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.layer, *args, use_reentrant=False, context_fn=self._context_fn)

    def extra_repr(self) -> str:
        return f"{self.layer_name}, checkpointing={self.checkpointing}"


def checkpoint_layers(gm: fx.GraphModule, mode_of: Callable[[str], str],
                      keeps_output: Callable[[fx.Node], bool] = lambda node: True) -> fx.GraphModule:
    """``gm`` with each repeated layer run in its activation checkpointing mode ``mode_of(layer)``
    (``gm`` itself when every layer's is "none", rewritten in place when some are "core_attention");
    under selective, ``keeps_output(node)`` says whether a kept-list op's output is saved."""
    layers = program_layers(gm.graph)
    modes = {layer: mode_of(layer) for layer in set(layers.values()) if layer is not None}
    unknown = {layer: mode for layer, mode in modes.items() if mode not in CHECKPOINTING}
    if unknown:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {unknown}")
    if all(mode == "none" for mode in modes.values()):
        return gm
    cored = {layer for layer, mode in modes.items() if mode == "core_attention"}
    if cored:
        gm = checkpoint_attention_cores(gm, cored)
        layers = program_layers(gm.graph)
    if not any(mode in WHOLE_LAYER_MODES for mode in modes.values()):
        return gm
    runs = _contiguous_runs(gm.graph, layers)
    widening = {node.name for node in gm.graph.nodes if widens(node)}  # before the split hides their inputs
    split = split_module(gm, None, lambda node: runs[node], keep_original_order=True,
                         keep_original_node_name=True)
    for run, layer in _layer_of_run(gm.graph, runs, layers).items():
        if layer is not None and modes[layer] in WHOLE_LAYER_MODES:
            name = f"submod_{run}"
            submodule = getattr(split, name)
            saves = [keeps_output(node) and _saved_in(modes[layer], node, widening)
                     for node in submodule.graph.nodes
                     if node.op == "call_function" and kept_under_selective(dispatched_op(node))]
            setattr(split, name, CheckpointedLayer(submodule, layer, modes[layer], saves))
    return split


def recomputed_with_layer(gm: fx.GraphModule, mode_of: Callable[[str], str]) -> set[str]:
    """The names of ``gm``'s nodes in layers whose checkpointing mode (``mode_of``) runs the whole layer
    again in backward: what that recomputation makes again, whatever autograd saved of it."""
    return {node.name for node, layer in program_layers(gm.graph).items()
            if layer is not None and mode_of(layer) in WHOLE_LAYER_MODES}


def _saved_in(mode: str, node: fx.Node, widening: set[str]) -> bool:
    """Whether selective mode ``mode`` saves the output of kept-list op ``node``: selective saves every
    one, save_dot_except_mlpwi the linear layers but an MLP's input projections (``widening``)."""
    if mode == "save_dot_except_mlpwi":
        return node.name not in widening and not is_fused_attention(dispatched_op(node))
    return True


WHOLE_LAYER_MODES = (*SELECTIVE_MODES, "full")
"""Modes that run a whole layer under one checkpoint (``core_attention`` checkpoints its cores alone)."""


def checkpoint_attention_cores(program: fx.GraphModule, layers: set[str]) -> fx.GraphModule:
    """``program``, rewritten in place: the attention cores of ``layers`` each cut out into a submodule
    (``attention_core_<i>``) that runs under ``checkpoint``, whose inputs are what it keeps."""
    cores = [_with_inserted_inputs(core) for core in attention_cores(program.graph.nodes, dispatched_op)
             if layer_of(core[0]) in layers]
    if not cores:
        return program
    fuse_by_partitions(program, [dict.fromkeys(core) for core in cores], prefix=_CORE, always_return_tuple=True)
    for i, core in enumerate(cores):
        name = f"{_CORE}{i}"
        setattr(program, name, CheckpointedLayer(getattr(program, name), layer_of(core[0]), "core_attention"))
        call = next(node for node in program.graph.nodes if node.op == "call_module" and node.target == name)
        call.meta["nn_module_stack"] = core[0].meta["nn_module_stack"]  # the core's layer (``program_layers``)
    program.recompile()
    return program


_CORE = "attention_core_"


def _with_inserted_inputs(core: list[fx.Node]) -> list[fx.Node]:
    """``core`` with the inserted nodes (redistributes: no module path) that only it reads, as a
    recomputed layer takes them (``_inserted_node_layer``): pricing re-runs the moves into a recomputed
    op (``stages.stage_problem``'s ``recomputed_under``)."""
    members, grew = set(core), True
    while grew:
        feeding = {arg for node in members for arg in node.all_input_nodes
                   if arg not in members and arg.op == "call_function" and not _has_module_path(arg)
                   and all(user in members for user in arg.users)}
        members |= feeding
        grew = bool(feeding)
    order = {node: i for i, node in enumerate(core[0].graph.nodes)}
    return sorted(members, key=order.__getitem__)


def dispatched_op(node: fx.Node) -> Any:
    """The aten op a program node dispatches: its target, or the op ``run_locally`` runs on local shards (or
    ``rematerialize.Remembered`` runs)."""
    target = recomputed_op(node)
    return node.args[0] if target is run_local_op else target


def program_layers(graph: fx.Graph) -> dict[fx.Node, str | None]:
    """The repeated layer of every computing node, inserted nodes following the ops they serve."""
    layers: dict[fx.Node, str | None] = {}
    for node in reversed(graph.nodes):  # readers first, so an inserted node's readers are known
        if node.op in ("call_function", "call_method", "call_module"):
            layers[node] = layer_of(node) if _has_module_path(node) else _inserted_node_layer(node, layers)
    return layers


def _has_module_path(node: fx.Node) -> bool:
    return bool(node.meta.get("nn_module_stack"))


def _inserted_node_layer(node: fx.Node, layers: dict[fx.Node, str | None]) -> str | None:
    """A node without a module path belongs with its readers when they agree, else with its input."""
    readers = {layers[user] for user in node.users if user in layers}
    if len(readers) == 1:
        return readers.pop()
    inputs = [arg for arg in node.all_input_nodes if _has_module_path(arg)]
    return layer_of(inputs[0]) if inputs else None


def _contiguous_runs(graph: fx.Graph, layers: dict[fx.Node, str | None]) -> dict[fx.Node, int]:
    """Partition id of every computing node: a new id each time the layer changes along the graph."""
    runs: dict[fx.Node, int] = {}
    run, previous = -1, object()
    for node in graph.nodes:
        if node not in layers:
            continue
        if layers[node] != previous:
            run, previous = run + 1, layers[node]
        runs[node] = run
    return runs


def _layer_of_run(graph: fx.Graph, runs: dict[fx.Node, int], layers: dict[fx.Node, str | None]
                  ) -> dict[int, str | None]:
    return {runs[node]: layers[node] for node in graph.nodes if node in runs}
