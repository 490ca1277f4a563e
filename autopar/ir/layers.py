"""Facts of the captured graph that planning and running share: which repeated layer a node belongs
to, which ops selective checkpointing keeps, and a node's tensor inputs and output values.

One place for each: ``planning/stages.py`` prices by these rules and ``passes/checkpoint.py`` and
``passes/split_stages.py`` run by them, so what is priced is what runs.
"""

from __future__ import annotations

import re
import weakref
from collections import Counter
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from autopar.ir.capture import CapturedGraph, module_path

_LAYER = re.compile(r"^(.*?\.\d+)(?=\.|$)")  # "layers.3.attn.q" -> "layers.3"

_aten = torch.ops.aten
KEPT_UNDER_SELECTIVE = frozenset(getattr(_aten, name) for name in (
    "mm", "addmm", "convolution", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu") if hasattr(_aten, name))
"""Op packets whose outputs selective checkpointing keeps: the pricer's and the runtime's one list
(``passes/checkpoint.py``'s policy sees the ops as dispatched, the pricer as captured; both are aten)."""


def kept_under_selective(target: object) -> bool:
    """Whether selective checkpointing keeps the output of an op with this aten ``target``."""
    return getattr(target, "overloadpacket", target) in KEPT_UNDER_SELECTIVE


def layer_of(node: fx.Node) -> str | None:
    """The repeated-layer instance a node belongs to (``layers.3``), or None outside layers."""
    if node.op == "placeholder":
        return None
    match = _LAYER.match(module_path(node))
    return match.group(1) if match else None


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


def layer_count(captured: CapturedGraph) -> int:
    """How many repeated layers pipeline stages may be cut between: every layer of ``layer_names`` when
    the layers are alike (each one's ops share their tie keys with every other's: same ops, shapes and
    arguments), else 1, the model taken as one layer. Stage prices scale one layer's cost by the layers
    a stage holds (``planning/stages.py``), which holds only for alike layers; the runtime cuts the
    program at the same ``layer_names``."""
    names = layer_names(captured)
    if captured.stack is not None:
        return len(names)
    keys_by_layer: dict[str, Counter] = {name: Counter() for name in names}
    for node in captured.graph.nodes:
        layer = layer_of(node)
        if layer in keys_by_layer and node.op == "call_function":
            keys_by_layer[layer][captured.tie_keys[node.name]] += 1
    alike = len({frozenset(keys.items()) for keys in keys_by_layer.values()}) == 1
    return len(names) if alike else 1


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
