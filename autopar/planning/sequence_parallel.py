"""Sequence parallelism: the ops it splits, their sequence dim, and the planner rule that pins it.

Under tensor parallelism the norms and the elementwise ops around them (residual adds, dropout) run on
the whole activation on every tp rank. Sequence parallelism (Megatron-LM; Korthikanti et al., MLSys
2023) splits those activations on their sequence dim over the tp mesh dim instead: the row-parallel
matmul's partial output is reduce_scattered onto the sequence (where plain tensor parallelism
all_reduces it) and all_gathered again before the next column-parallel matmul, so the norms' work and
saved activations shrink by the tp degree at the same communication volume.

The ops it concerns, found from the captured graph alone (no model names):

* norms: the ops recorded under a LayerNorm or RMSNorm module (any class whose name ends so:
  ``nn.LayerNorm``, ``nn.RMSNorm``, ``RMSNorm``, Hugging Face's ``LlamaRMSNorm``...), however it was
  captured (one ``native_layer_norm``, or ``pow``/``mean``/``rsqrt``/``mul`` for a hand-written
  RMSNorm), and layer/RMS norm ops called outside such a module;
* the residual stream: pointwise ops of a norm's input shape reached backwards from a norm's input
  through pointwise ops only (residual adds, dropout's masking, the embeddings' sum), stopping at
  views, matmuls and other ops that produce the stream.

The sequence dim: activations are batch-first (the planner splits example inputs on dim 0); a norm
normalizes its trailing dims (``normalized_shape`` of a layer norm op, the reduced dims of a
decomposed norm, else the last dim); the sequence dim is the dim just before the normalized ones
(``[batch, seq, hidden]`` -> 1). A norm over ``[batch, hidden]`` has none and is left alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.ir.capture import CapturedGraph
from autopar.ir.layers import is_getitem
from autopar.planning.problem import ALLOW_ANY, Rule
from autopar.planning.strategies import Strategy

_NORM_MODULE = re.compile(r"(layernorm|rmsnorm)$", re.IGNORECASE)
_NORM_OPS = {getattr(torch.ops.aten, name).default
             for name in ("native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm")
             if hasattr(torch.ops.aten, name)}  # older torch lacks the rms_norm ops
BATCH_DIM = 0


@dataclass(frozen=True)
class NormSite:
    """One application of a norm: its ops, the op whose first output is the norm's result, and the
    sequence dim of its ``ndim``-dimensional activations (of size ``seq_len``)."""

    nodes: tuple[str, ...]
    output: str
    ndim: int
    seq_dim: int
    seq_len: int


def norm_sites(captured: CapturedGraph) -> list[NormSite]:
    """Every norm of the graph whose activations have a sequence dim, in graph order."""
    sites = []
    for run in _norm_runs(captured.graph):
        site = _site(run)
        if site is not None:
            sites.append(site)
    return sites


def sequence_region(captured: CapturedGraph, sites: list[NormSite]) -> dict[str, int]:
    """Per node that sequence parallelism splits (norm ops and the residual stream into them), the
    sequence dim of its output."""
    region: dict[str, int] = {}
    for site in sites:
        for name in site.nodes:
            if _output_ndim(captured.node(name)) == site.ndim:
                region[name] = site.seq_dim
        for name in _residual_stream(captured, site):
            region[name] = site.seq_dim
    return region


def sequence_parallel_rule(captured: CapturedGraph, tp_dims: list[int], sp: int | None) -> Rule:
    """The planner's ``allow`` rule for constraint ``sp``: with 1, the norms and the residual stream
    keep their output split on the sequence dim over every tp mesh dim; with 0, none of them is split
    over a tp dim at all (on the sequence, or on the batch where a microbatch's samples divide by tp:
    Megatron-LM without sequence parallelism runs the norms, dropouts and residual adds whole on each
    tp rank); unpinned (None), or without a tp dim, the solver chooses."""
    if sp is None or not tp_dims:
        return ALLOW_ANY
    constrained = sequence_region(captured, norm_sites(captured))

    def allow(node: fx.Node, strategy: Strategy) -> bool:
        dim = constrained.get(node.name)
        out = strategy.outputs[0] if strategy.outputs else None
        if dim is None or out is None:
            return True
        if not sp:
            return not any(out[d].is_shard() for d in tp_dims)
        return all(out[d] == Shard(dim) for d in tp_dims)

    return Rule(allow, lambda node: constrained.get(node.name))


def sequence_sharded(sites: Iterable[NormSite], output_placements: Callable[[str], Any], tp_dim: int) -> bool:
    """Whether any norm's result is split on its sequence dim over mesh dim ``tp_dim`` (``output_placements``
    gives a node's planned first-output placements)."""
    for site in sites:
        out = output_placements(site.output)
        if out is not None and out[tp_dim] == Shard(site.seq_dim):
            return True
    return False


def _norm_runs(graph: fx.Graph) -> list[list[fx.Node]]:
    """Consecutive ops recorded under one norm module instance, and each norm op outside one."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    current_path: str | None = None
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        path = _norm_module_path(node)
        if path is not None and path == current_path:
            current.append(node)
            continue
        if current:
            runs.append(current)
        current, current_path = ([node], path) if path is not None else ([], None)
        if path is None and node.target in _NORM_OPS:
            runs.append([node])
    if current:
        runs.append(current)
    return runs


def _norm_module_path(node: fx.Node) -> str | None:
    """The path of the innermost module that recorded ``node`` when that module is a norm."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, kind = list(stack.values())[-1]
    name = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
    return path if _NORM_MODULE.search(name.rsplit(".", 1)[-1]) else None


def _site(run: list[fx.Node]) -> NormSite | None:
    ops = [n for n in run if not is_getitem(n)]
    if not ops:
        return None
    output = ops[-1]
    val = _first_output(output)
    if not isinstance(val, torch.Tensor):
        return None
    seq_dim = val.ndim - _normalized_dims(ops, val.ndim) - 1
    if seq_dim <= BATCH_DIM:
        return None
    return NormSite(tuple(n.name for n in run), output.name, val.ndim, seq_dim, int(val.shape[seq_dim]))


def _normalized_dims(ops: list[fx.Node], ndim: int) -> int:
    """How many trailing dims the norm normalizes: a layer norm op's ``normalized_shape``, else the
    widest reduction among its ops (``mean(x^2, dim=-1)``), else 1."""
    for node in ops:
        if node.target in _NORM_OPS and len(node.args) > 1 and isinstance(node.args[1], (list, tuple)):
            return len(node.args[1])
    widest = 1
    for node in ops:
        if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.reduction in node.target.tags:
            dims = node.args[1] if len(node.args) > 1 else None
            if isinstance(dims, (list, tuple)) and dims:
                widest = max(widest, len({d % ndim for d in dims}))
    return widest


def _residual_stream(captured: CapturedGraph, site: NormSite) -> list[str]:
    """Pointwise ops of the norm's activation shape that feed it through pointwise ops only."""
    inside = set(site.nodes)
    shape = _first_output(captured.node(site.output)).shape
    frontier = [a for name in site.nodes for a in captured.node(name).all_input_nodes if a.name not in inside]
    found: list[str] = []
    seen: set[str] = set()
    while frontier:
        node = frontier.pop()
        if node.name in seen:
            continue
        seen.add(node.name)
        val = node.meta.get("val")
        if not (_is_pointwise(node) and isinstance(val, torch.Tensor) and val.shape == shape):
            continue
        found.append(node.name)
        frontier.extend(node.all_input_nodes)
    return found


def _is_pointwise(node: fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and torch.Tag.pointwise in node.target.tags)


def _first_output(node: fx.Node) -> Any:
    val = node.meta.get("val")
    return val[0] if isinstance(val, (list, tuple)) else val


def _output_ndim(node: fx.Node) -> int | None:
    val = _first_output(node)
    return val.ndim if isinstance(val, torch.Tensor) else None
