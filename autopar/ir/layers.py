"""Facts of the captured graph that planning and running share: which repeated layer a node belongs
to, which ops selective checkpointing keeps (and which of them ``save_dot_except_mlpwi`` recomputes),
which ops are an attention core (what ``core_attention`` checkpointing recomputes), and a node's tensor
inputs and output values.

One place for each: ``planning/stages.py`` prices by these rules and ``passes/checkpoint.py`` and
``passes/split_stages.py`` run by them, so what is priced is what runs.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Callable, Iterable

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from autopar.ir.capture import CapturedGraph, layer_of, layer_of_path, repetition_period, tie_keys_by_layer

_aten = torch.ops.aten
KEPT_UNDER_SELECTIVE = frozenset(getattr(_aten, name) for name in (
    "mm", "addmm", "_scaled_mm", "convolution", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu") if hasattr(_aten, name))
"""Op packets whose outputs selective checkpointing keeps: the pricer's and the runtime's one list
(``passes/checkpoint.py``'s policy sees the ops as dispatched, the pricer as captured; both are aten; a
float8 linear, captured as ``mm``, dispatches ``_scaled_mm``, ``passes/float8.py``)."""


def kept_under_selective(target: object) -> bool:
    """Whether selective checkpointing keeps the output of an op with this aten ``target``."""
    return getattr(target, "overloadpacket", target) in KEPT_UNDER_SELECTIVE


def widens(node: fx.Node) -> bool:
    """Whether ``node`` is a linear layer that widens its rows, an MLP's input projection (MaxText's
    ``mlpwi``: the up and gate projections): an ``mm``/``addmm`` of activations ``[tokens, in]`` whose
    output ``[tokens, out]`` has ``out > in``. Shapes are the captured (global) ones; in a program, the
    nodes passes inserted before the matmul (redistributes, casts) are looked through to the value."""
    packet = getattr(node.target, "overloadpacket", None)
    if node.op != "call_function" or packet not in (_aten.mm, _aten.addmm):
        return False
    rows, out = captured_value(node.args[1 if packet is _aten.addmm else 0]), node.meta.get("val")
    return isinstance(rows, torch.Tensor) and isinstance(out, torch.Tensor) and out.shape[-1] > rows.shape[-1]


def captured_value(arg: Any) -> Any:
    """The traced value ``arg`` computes: its own, or for a node a pass inserted without one (a redistribute,
    a cast, a layout guard), its first input's, which it holds in another placement or layout."""
    while isinstance(arg, fx.Node) and "val" not in arg.meta and arg.all_input_nodes:
        arg = arg.all_input_nodes[0]
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


FUSED_ATTENTION = frozenset(getattr(_aten, name) for name in (
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(_aten, name))
"""Fused attention kernels: each one is a whole attention core (``attention_cores``)."""


def is_fused_attention(target: object) -> bool:
    """Whether an op with this aten ``target`` is a fused attention kernel."""
    return getattr(target, "overloadpacket", target) in FUSED_ATTENTION


ATTENTION_MASK_ARG, ATTENTION_DROPOUT_ARG = 3, 4
"""Where the captured fused attention (``aten.scaled_dot_product_attention(query, key, value, attn_mask,
dropout_p, ...)``) takes its mask and its dropout, positionally or by those names."""


def attention_argument(node: fx.Node, name: str, position: int, default: Any = None) -> Any:
    """Fused attention ``node``'s argument ``name`` (``attn_mask``, ``dropout_p``), given by keyword or at
    ``position``; ``default`` where it is given neither way."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if len(node.args) > position else default


_SOFTMAX = frozenset(getattr(_aten, name) for name in ("_softmax", "softmax", "_safe_softmax") if hasattr(_aten, name))
_BATCHED_MATMUL = frozenset(getattr(_aten, name) for name in ("bmm", "baddbmm", "matmul") if hasattr(_aten, name))


def attention_cores(nodes: Iterable[fx.Node], op_of: Callable[[fx.Node], Any] = lambda node: node.target
                    ) -> list[list[fx.Node]]:
    """The attention cores among ``nodes`` (in graph order), each a list of nodes in graph order: what
    Megatron-LM's selective recomputation recomputes (Korthikanti et al. 2022, §5: ``QK^T``, softmax,
    dropout, ``AV``), between the q, k, v projections and the output projection.

    A fused attention kernel is a core by itself, with the ``getitem`` nodes selecting its outputs. An
    unfused one is found from its softmax: the nearest batched matmul above it (the scores, ``QK^T``) and
    the nearest below it (``AV``); the core is every node on a path from the first to the second, both
    included (the scaling, the mask applied to the scores, the softmax, dropout, their views). The
    scores' and values' inputs and the mask are computed outside it. Every path between two nodes of a
    core stays inside it, so a core runs as one call without cycles. ``op_of`` gives the aten op a node
    runs (a program's ``run_locally`` nodes wrap theirs)."""
    nodes = list(nodes)
    order = {node: i for i, node in enumerate(nodes)}
    cores: list[set[fx.Node]] = []
    for node in nodes:
        op = getattr(op_of(node), "overloadpacket", op_of(node)) if node.op == "call_function" else None
        if is_fused_attention(op):
            cores.append({node, *(user for user in node.users if is_getitem(user))})
        elif op in _SOFTMAX:
            scores = _nearest(node, lambda n: n.all_input_nodes, op_of)
            context = _nearest(node, lambda n: list(n.users), op_of)
            if _scores_and_context(node, scores, context) and {scores, context} <= order.keys():
                cores.append(_between(scores, context, order))
    return [sorted(core, key=order.__getitem__) for core in cores if core <= order.keys()]


def _scores_and_context(softmax: fx.Node, scores: fx.Node | None, context: fx.Node | None) -> bool:
    """Whether ``scores`` and ``context`` bound an attention around ``softmax``: all three in one repeated
    layer, and the softmax over as many elements as the scores (not a router's softmax over experts)."""
    if scores is None or context is None or layer_of(softmax) is None:
        return False
    if not layer_of(scores) == layer_of(context) == layer_of(softmax):
        return False
    return _numel(scores) == _numel(softmax)


def _numel(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else None


def _nearest(start: fx.Node, step: Callable[[fx.Node], list[fx.Node]], op_of: Callable[[fx.Node], Any]
             ) -> fx.Node | None:
    """The first batched matmul reached from ``start`` breadth first along ``step`` (inputs or users)."""
    seen, frontier = {start}, [start]
    while frontier:
        found = [n for n in frontier if n is not start and n.op == "call_function"
                 and getattr(op_of(n), "overloadpacket", op_of(n)) in _BATCHED_MATMUL]
        if found:
            return found[0]
        frontier = [m for n in frontier for m in step(n) if m not in seen and not seen.add(m)]
    return None


def _between(first: fx.Node, last: fx.Node, order: dict[fx.Node, int]) -> set[fx.Node]:
    """Every node on a path from ``first`` to ``last`` (both included): the descendants of ``first``
    that are ancestors of ``last``, looked for only between the two in graph order."""
    window = range(order[first], order[last] + 1)
    below = _reached(first, lambda n: n.users, lambda n: order.get(n, -1) in window)
    return _reached(last, lambda n: n.all_input_nodes, lambda n: n in below)


def _reached(start: fx.Node, step: Callable[[fx.Node], Iterable[fx.Node]], keep: Callable[[fx.Node], bool]
             ) -> set[fx.Node]:
    found, stack = {start}, [start]
    while stack:
        for node in step(stack.pop()):
            if node not in found and keep(node):
                found.add(node)
                stack.append(node)
    return found


def gather_unit(path: str) -> str:
    """The unit a parameter at ``path`` is gathered and its gradient reduce-scattered with, when sharded
    over data parallelism: its repeated layer, outside layers its module (the path less its last name),
    as ``fully_shard`` wraps each block and the root. The lowered runtime buckets by it
    (``passes/lower_buckets.py``) and the planner prices its working set by it (``planning/problem.py``)."""
    return layer_of_path(path) or path.rpartition(".")[0] or path


def reader_regions(graph: fx.Graph) -> dict[fx.Node, str]:
    """Per computing node, the region whose readers of one value share one redistribute (the runtime's
    ``passes/insert_redistributes.py``, priced once by ``planning/problem.py``): its repeated layer, or,
    outside layers, the code before the first layer or after it. Embedding and head (a tied weight's two
    readers) stay apart, as they may run in different pipeline stages."""
    regions: dict[fx.Node, str] = {}
    seen_layer = False
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        layer = layer_of(node)
        seen_layer = seen_layer or layer is not None
        regions[node] = layer if layer is not None else "<after layers>" if seen_layer else "<before layers>"
    return regions


def layer_names(captured: CapturedGraph) -> list[str]:
    """The repeated-layer instances of the model, in graph order (``blocks.0``, ``blocks.1``, ...): a
    traced stack's every real layer."""
    if captured.stack is not None:
        return [f"{captured.stack.path}.{i}" for i in range(captured.stack.layers)]
    return list(dict.fromkeys(layer for node in captured.graph.nodes if (layer := layer_of(node)) is not None))


def repeating_layers(captured: CapturedGraph) -> list[str]:
    """The layers pipeline stages are cut between and checkpointing recomputes: ``layer_names`` but the
    leading ones that do not repeat (``CapturedGraph.leading_layers``: DeepSeek-V3's dense first layers),
    which run with what comes before the layers (``planning/stages.py``)."""
    return layer_names(captured)[len(captured.leading_layers):]


def repeating_layer_of(captured: CapturedGraph) -> Callable[[fx.Node], str | None]:
    """``layer_of`` for ``captured``'s nodes but None for those of its leading layers (``repeating_layers``)."""
    leading = frozenset(captured.leading_layers)
    return lambda node: None if (layer := layer_of(node)) in leading else layer


def layer_count(captured: CapturedGraph) -> int:
    """How many units of repeated layers pipeline stages may be cut between: the ``repeating_layers`` in
    groups of ``layer_period``, each group alike every other (every layer, where the layers are alike; one
    group, the model taken as one layer, where they do not repeat). Stage prices scale one group's cost by
    the groups a stage holds (``planning/stages.py``), which holds only for alike groups; the runtime cuts
    the program between the same groups (plan ranges count layers, multiples of the period after the
    leading layers, which the first range holds too)."""
    names = repeating_layers(captured)
    return len(names) // layer_period(captured) if names else 0


def layer_period(captured: CapturedGraph) -> int:
    """The fewest consecutive layers that repeat alike through the ``repeating_layers``: 1 where every layer
    is alike the next (a traced stack is, by construction); 2 where two kinds alternate (Jamba's experts
    every other layer); 4 for Llama 4's (experts every other layer, no rotary embedding every fourth); their
    number where none repeats. A layer is alike another when their ops' tie keys are
    (``capture._tie_repeated_layers``: same ops, shapes and arguments)."""
    return repetition_period(_tie_keys_by_layer(captured))


def unalike_layers(captured: CapturedGraph) -> tuple[str, str] | None:
    """The first of the model's layers and the first that is not alike it, where no tail of the layers
    repeats (``layer_period`` is their number, and no leading layers were set apart), else None."""
    keys = _tie_keys_by_layer(captured)
    if repetition_period(keys) < max(len(keys), 2):
        return None
    names = repeating_layers(captured)
    return next(((names[0], names[i]) for i in range(1, len(keys)) if keys[i] != keys[0]), None)


def _tie_keys_by_layer(captured: CapturedGraph) -> list[Counter]:
    """Per layer of ``repeating_layers`` (one for a traced stack, whose layers are alike), its ops' tie keys."""
    if captured.stack is not None:
        return [Counter()]
    by_layer = tie_keys_by_layer(captured.graph, captured.tie_keys)
    return [by_layer[name] for name in repeating_layers(captured)]


def is_getitem(node: fx.Node) -> bool:
    """Whether ``node`` selects one output of a multi-output op (``operator.getitem``)."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem"


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued arguments in the order DTensor flattens them (args, then kwargs).

    Planning asks this of every node many times per mesh; the answer is kept per node for as long as
    the node keeps the same argument objects (a pass that rewrites its arguments replaces them)."""
    kept = _TENSOR_INPUTS.get(node)
    if kept is not None and kept[0] is node.args and kept[1] is node.kwargs:
        return kept[2]
    leaves = tree_leaves((node.args, node.kwargs))
    found = [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    _TENSOR_INPUTS[node] = (node.args, node.kwargs, found)
    return found


_TENSOR_INPUTS: "weakref.WeakKeyDictionary[fx.Node, tuple[Any, Any, list[fx.Node]]]" = weakref.WeakKeyDictionary()


def output_vals(node: fx.Node) -> list[Any]:
    """The node's output values (one per output; multi-output ops give several)."""
    val = node.meta.get("val")
    return list(val) if isinstance(val, (list, tuple)) else [val]
