"""Which ops of a captured step a float8 plan runs as float8 matmuls (``precision.fp8``).

One rule for the pricer (``planning/pricing.py``, which prices them at the device's FP8 rate with their
scaling kernels) and the runtime (``passes/float8.py``, which runs them so), read off the captured graph:
a **float8 linear** is an ``mm`` or ``addmm`` (its bias added as is) inside a layer of the model's
layer stack (``capture.layer_of``) that multiplies activations by a weight, a parameter or a view of one
(its transpose, a cast), whose two dims are multiples of 16.

Where this follows torchao's float8 training (``torchao.float8.convert_to_float8_training``) and
Transformer Engine: only linear layers, never attention's products or a mixture-of-experts layer's
batched expert matmuls (``bmm``); dims of 16 (FP8 tensor cores read 16-byte rows, and
``torch._scaled_mm`` refuses others on CUDA). Where it diverges: torchao converts every ``nn.Linear`` a
filter passes, torchtitan's default filter leaves the output head out, NeMo runs FP8 in its transformer
layers; autopar takes the layers of the stack only, so embeddings, the head and a pooler keep the compute
dtype, where a large vocabulary's logits lose most to float8's three mantissa bits.
"""

from __future__ import annotations

import weakref

import torch
from torch import fx

from autopar.ir.capture import WEIGHT_KINDS, CapturedGraph, is_view, layer_of, view_root

_aten = torch.ops.aten
LINEAR_OPS = {_aten.mm.default: (0, 1), _aten.addmm.default: (1, 2)}
"""The ops a linear layer is captured as, and the slots of their two matrix operands."""
FP8_ALIGNMENT = 16
"""What each dim of a float8 linear's weight must be a multiple of."""
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def float8_linears(captured: CapturedGraph) -> frozenset[str]:
    """The names of ``captured``'s nodes a float8 plan runs as float8 matmuls (the module doc's rule)."""
    found = _FOUND.get(captured.graph)
    if found is None:
        kinds = captured.gradient_kinds()
        found = frozenset(node.name for node in captured.graph.nodes if _is_float8_linear(node, kinds))
        _FOUND[captured.graph] = found
    return found


def float8_weights(captured: CapturedGraph) -> frozenset[str]:
    """The model's parameters (fully qualified, every layer of a traced stack's) that float8 linears read."""
    return frozenset(real for root in float8_weight_placeholders(captured)
                     for real in captured.real_fqns(captured.params[root]))


def float8_weight_placeholders(captured: CapturedGraph) -> frozenset[str]:
    """The placeholders of the parameters that float8 linears read (through views): each has an e4m3 copy, cast
    once a step where the program reads it as stored (``passes/float8.StepCasts``)."""
    kinds = captured.gradient_kinds()
    return frozenset(view_root(captured.node(name).args[weight_slot(captured.node(name), kinds)]).name
                     for name in float8_linears(captured))


def weight_slot(node: fx.Node, kinds: dict[str, str]) -> int | None:
    """The ``node.args`` index of a linear op's one weight operand (``CapturedGraph.gradient_kinds``'
    ``WEIGHT_KINDS``), None where it is not one of ``LINEAR_OPS`` reading exactly one weight."""
    slots = LINEAR_OPS.get(node.target) if node.op == "call_function" else None
    weights = [i for i in slots or () if isinstance(node.args[i], fx.Node) and kinds.get(node.args[i].name)
               in WEIGHT_KINDS]
    return weights[0] if len(weights) == 1 else None


def weight_first(node: fx.Node, kinds: dict[str, str]) -> bool:
    """Whether a float8 linear's weight is its first matrix operand (``mm(w, x)``), not its second."""
    return weight_slot(node, kinds) == LINEAR_OPS[node.target][0]


def activation_slot(node: fx.Node, weight_first: bool) -> int:
    """The ``node.args`` index of a float8 linear's activation operand (the one that is not its weight)."""
    return LINEAR_OPS[node.target][1 if weight_first else 0]


def activation_key(node: fx.Node, weight_first: bool) -> tuple[object, ...]:
    """The tensor a float8 linear's activation operand is (its weight first or not): a view as its op, the
    value it views and its arguments, anything else by name. Linears with one key read one tensor (q, k and
    v one normed input, each through its own ``view``), which the runtime casts to e4m3 once for all of them
    (``passes/float8.py``), as Transformer Engine's fused QKV projection does."""
    arg = node.args[activation_slot(node, weight_first)]
    if isinstance(arg, fx.Node) and is_view(arg):
        return (arg.target, repr(arg.args), repr(arg.kwargs))
    return (arg.name if isinstance(arg, fx.Node) else repr(arg),)


def reused_casts(captured: CapturedGraph) -> dict[str, int]:
    """The float8 linears whose activation an earlier one (in graph order) reads too (``activation_key``),
    each with the ``args`` slot of that operand: the earlier linear casts it, its amax and its e4m3 copy, and
    these read that copy, so they are priced neither (``planning/pricing.py``) nor keep one of their own
    (``ir/saved_tensors.py``)."""
    kinds, linears = captured.gradient_kinds(), float8_linears(captured)
    seen: set[tuple[object, ...]] = set()
    reused: dict[str, int] = {}
    for node in captured.graph.nodes:
        if node.name in linears:
            first = weight_first(node, kinds)
            key = activation_key(node, first)
            if key in seen:
                reused[node.name] = activation_slot(node, first)
            seen.add(key)
    return reused


def _is_float8_linear(node: fx.Node, kinds: dict[str, str]) -> bool:
    slot = weight_slot(node, kinds)
    if slot is None or layer_of(node) is None or not _plain_addmm(node):
        return False
    shape = node.args[slot].meta["val"].shape
    return len(shape) == 2 and all(size % FP8_ALIGNMENT == 0 for size in shape)


def _plain_addmm(node: fx.Node) -> bool:
    """An ``addmm`` adding its bias once to the whole product (``beta = alpha = 1``, a linear layer's)."""
    return node.target is not _aten.addmm.default or (node.kwargs.get("beta", 1) == 1
                                                      and node.kwargs.get("alpha", 1) == 1)
