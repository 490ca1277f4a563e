"""Which values of a captured step are recomputed in backward rather than kept: cheap pointwise outputs.

Autograd keeps what each op's backward reads. Some of that is a pointwise function of tensors it keeps
anyway: SwiGLU's ``silu(gate)``, which the ``* up`` keeps for ``up``'s gradient, is ``silu`` of ``gate``,
which ``silu`` keeps for its own gradient; RMSNorm's normalized ``x * rsqrt(...)``, which the ``* weight``
keeps for the weight's gradient, is the product of the ``x`` and ``rsqrt`` its ``mul`` keeps; the MLP's
product ``silu(gate) * up``, which the down projection keeps, is made of ``gate`` and ``up``. Keeping such
a value costs its bytes from forward to backward; making it again in backward costs one elementwise
kernel over it. Fused kernels make the same trade by construction (Megatron-LM's fused SwiGLU keeps its
input, not its output; Transformer Engine's fused norms keep the input and the inverse deviation), and
inductor's min-cut partitioner makes it when it compiles a training step (``torch.compile``). autopar's
program runs aten ops one at a time, so it makes the trade itself, on a rule read off the graph:

a value is **recomputable** when its op is one of ``POINTWISE`` (deterministic, elementwise) or a view of a
recomputable value (free: a matmul keeps its input's view), at most ``MAX_CHAIN`` pointwise ops from the
values it is made of, and each of its tensor inputs is a placeholder (a parameter, buffer or user input:
held by the step anyway), a value its own op keeps for backward (``silu`` keeps ``gate``, ``mul`` keeps both
factors), or itself recomputable.

What is recomputed is a recomputable value some op keeps for backward: the runtime keeps, in its place,
the values it is made of (``passes/rematerialize.py``; its own op still keeps them, so they cost nothing
more) and makes it again when backward reads it. ``ir/saved_tensors.py`` records the step that way: such a
value's bytes are not saved, and its op's backward counts the forward kernels it reruns
(``SavedTensors.recomputed``), which the pricer charges (``planning/pricing.py``).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import fx

from autopar.ir.capture import is_view, view_root

_aten = torch.ops.aten
POINTWISE = frozenset({
    _aten.silu.default, _aten.gelu.default, _aten.relu.default, _aten.sigmoid.default, _aten.tanh.default,
    _aten.mul.Tensor, _aten.div.Tensor, _aten.add.Tensor, _aten.sub.Tensor, _aten.neg.default,
    _aten.rsqrt.default, _aten.exp.default, _aten.pow.Tensor_Scalar, _aten._to_copy.default,
})
"""Elementwise aten ops with no randomness: rerun on the same inputs, they give the same values."""
MAX_CHAIN = 3
"""The most pointwise ops a recomputed value is made again through (an HF RMSNorm's ``x * rsqrt``, its cast
back to the compute dtype, then ``* weight``), which bounds what one backward read reruns."""


def recomputable_values(graph: fx.Graph, savers: Mapping[str, frozenset[str]]) -> frozenset[str]:
    """The names of ``graph``'s recomputable values (the module doc's rule); ``savers``: value name ->
    the ops whose backward keeps (a view of) it (``SavedTensors.savers``, by the value a view is of)."""
    depth: dict[str, int] = {}
    for node in graph.nodes:
        step = _step(node)
        if step is None:
            continue
        inputs = node.all_input_nodes
        chain = step
        for value in inputs:
            if value.name in depth:
                chain = max(chain, depth[value.name] + step)
            elif step == 0 or not (value.op == "placeholder" or node.name in savers.get(view_root(value).name, ())):
                break  # a view is recomputable only of a recomputable value (of another, it holds nothing)
        else:
            if inputs and chain <= MAX_CHAIN:
                depth[node.name] = chain
    return frozenset(depth)


def _step(node: fx.Node) -> int | None:
    """Pointwise ops a node adds to a chain (1, a view 0), None where it cannot be recomputed: another op,
    or one whose output is not a single floating-point tensor."""
    if node.op != "call_function" or not _one_float_output(node):
        return None
    if node.target in POINTWISE:
        return 1
    return 0 if is_view(node) else None


def _one_float_output(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point
