"""Fewer host ops in the lowered graphs (``lower.py``): what AOT autograd leaves of DTensor's bookkeeping.

An uncompiled lowered graph runs op by op from Python, each op a dispatch of a few microseconds, so an
op that computes nothing still costs its dispatch. Traced through DTensor, the rank's graphs hold many:
each parameter's local tensor is viewed to its own shape (``to_local``/``from_local``), values saved for
backward are detached, a linear layer's weight gradient is transposed twice (``t`` of ``t``, or
``permute(t(x), [1, 0])``), and views follow views. ``simplify_local_ops`` removes them in place:

* **identity views**: ``view``/``reshape``/``_unsafe_view`` to the input's own shape, ``alias`` and
  ``detach`` (the graphs are functional and run without autograd inside AOT autograd's function; a graph
  run under autograd, ``lower_eager.py``'s, keeps its detaches, which cut gradients), read as their input;
* **view chains**: a view of a view reads the first view's input, when its fake value says the shape is
  reachable from there directly;
* **transpose pairs**: a 2-d transpose (``t`` or ``permute [1, 0]``) of a 2-d transpose is its input;
* **unread ops** without effect are erased, and so is an attention forward without dropout that no op
  reads (AOT's backward graph keeps each layer's: the kernel is tagged random for its dropout).

Last, ``call_through_bindings`` calls the common aten overloads that remain through torch's Python bindings
(``torch.mm``, ``Tensor.view``), whose C++ argument parser reaches the same overload for less host time than
the ``OpOverload`` object's Python call.

Also, from DTensor's backward of a replicated factory read as a shard (``new_zeros`` of the global shape,
split, this rank's piece cloned: a whole global buffer filled to keep one rank's rows), **sliced fills**
become a ``new_zeros`` of the piece's shape.

Where we diverge from torch: inductor (``compile=True``) removes the same ops in its own lowering
(``torch._inductor.fx_passes.post_grad``' noop removal), so these passes matter for the uncompiled
program; they run for both so that one graph is counted and bucketed either way. ``torch.fx``'s
``eliminate_dead_code`` would keep the unread attention (random ops are impure to it).
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from .lower_buckets import recompiled

_aten = torch.ops.aten

_SHAPE_VIEWS = frozenset({_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default})
_IDENTITIES = frozenset({_aten.alias.default, _aten.detach.default})
_TRANSPOSES = frozenset({_aten.t.default, _aten.permute.default, _aten.transpose.int})


def simplify_local_ops(gm: fx.GraphModule, under_autograd: bool = False) -> int:
    """``lower_simplify``'s rewrites on ``gm``, in place (recompiled when any applied); returns how many
    ops they removed. ``under_autograd``: ``gm`` runs under autograd, its detaches kept."""
    graph = gm.graph
    before = len(graph.nodes)
    for node in list(graph.nodes):
        if node.op != "call_function" or under_autograd and node.target is _aten.detach.default:
            continue
        replacement = _simpler(node)
        if replacement is not None and replacement is not node:
            node.replace_all_uses_with(replacement)
    erase_unused(graph)
    removed = before - len(graph.nodes)
    return recompiled(gm, removed)


def _simpler(node: fx.Node) -> fx.Node | None:
    """What ``node`` may read as instead (a node it reads, or a new, cheaper node), or None."""
    if node.target in _IDENTITIES:
        return node.args[0]
    if node.target in _SHAPE_VIEWS:
        return _simpler_view(node)
    if _is_2d_transpose(node) and _is_2d_transpose(node.args[0]):
        return node.args[0].args[0]
    if node.target is _aten.clone.default and not node.kwargs:
        return _sliced_fill(node)
    return None


def _simpler_view(node: fx.Node) -> fx.Node | None:
    """The input of a view to its own shape, or the first view's input for a view of a view that can
    view that input directly (``node`` then reads it: the first view may become unused)."""
    source = node.args[0]
    if (isinstance(source, fx.Node) and source.target in _SHAPE_VIEWS and node.target in _SHAPE_VIEWS
            and list(source.args[1]) == list(node.args[1])):
        return source  # a view to the shape its input was just viewed as (a pass's node, without a fake value)
    if not isinstance(source, fx.Node) or "val" not in source.meta or "val" not in node.meta:
        return None
    value = node.meta["val"]
    if _same_layout(source.meta["val"], value):
        return source
    origin = source.args[0] if source.target in _SHAPE_VIEWS else None
    if isinstance(origin, fx.Node) and "val" in origin.meta:
        if _same_layout(origin.meta["val"], value):
            return origin
        if _viewable(origin.meta["val"], list(value.shape)):
            node.args = (origin, *node.args[1:])
    return None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` may stand for ``a`` as it is (same shape, strides and dtype)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()


def _viewable(value: torch.Tensor, shape: list[int]) -> bool:
    """Whether ``value`` (a fake tensor) can be viewed as ``shape`` without a copy."""
    probe = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    try:
        probe.view(shape)
    except RuntimeError:
        return False
    return True


def _is_2d_transpose(node: object) -> bool:
    """Whether ``node`` swaps the two dims of a 2-d value."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _TRANSPOSES:
        return False
    value = node.meta.get("val")
    if value is None or value.ndim != 2:
        return False
    if node.target is _aten.permute.default:
        return list(node.args[1]) == [1, 0]
    if node.target is _aten.transpose.int:
        return sorted(d % 2 for d in node.args[1:3]) == [0, 1]
    return True


_FILLS = frozenset({_aten.new_zeros.default})


def _is_fused_attention(target: object) -> bool:
    """Whether ``target`` is one of aten's fused attention forwards (``_scaled_dot_product_*``: flash,
    efficient, cuDNN, the CPU flash kernel, the math fallback), which torch tags random for their
    ``dropout_p``. Asked of the schema, not a list, so a kernel a newer torch adds is covered too."""
    schema = getattr(target, "_schema", None)
    if schema is None or getattr(target, "namespace", None) != "aten":
        return False
    name = schema.name.split("::")[-1]
    return (name.startswith("_scaled_dot_product_") and not name.endswith("_backward")
            and any(argument.name == "dropout_p" for argument in schema.arguments))


def _sliced_fill(clone: fx.Node) -> fx.Node | None:
    """``clone(split(new_zeros(x, shape), n)[i])`` as ``new_zeros(x, piece's shape)``: one rank's piece of
    a filled buffer, filled alone."""
    piece = clone.args[0]
    if not (isinstance(piece, fx.Node) and piece.target is operator.getitem):
        return None
    split = piece.args[0]
    if not (isinstance(split, fx.Node) and split.target is _aten.split.Tensor):
        return None
    fill = split.args[0]
    if not (isinstance(fill, fx.Node) and fill.target in _FILLS):
        return None
    shape = list(clone.meta["val"].shape)
    graph = clone.graph
    with graph.inserting_before(clone):
        smaller = graph.call_function(fill.target, (fill.args[0], shape), dict(fill.kwargs))
    smaller.meta.update(clone.meta)
    return smaller


def erase_unused(graph: fx.Graph) -> None:
    """Erase the ops no node reads that have no effect (their inputs then too, when unused in turn)."""
    for node in reversed(list(graph.nodes)):
        if not node.users and node.op == "call_function" and _effect_free(node):
            graph.erase_node(node)


def _effect_free(node: fx.Node) -> bool:
    """Whether dropping ``node`` changes nothing but its own result: not a collective or its wait, not
    impure by ``torch.fx`` (mutations; random ops, which advance the generator), except an attention
    without dropout (AOT's backward graph keeps each layer's attention forward, unread: its kernel is
    tagged random for its dropout)."""
    if getattr(node.target, "namespace", None) == "_c10d_functional":
        return False
    if _is_fused_attention(node.target):
        return _argument(node, "dropout_p") == 0.0
    return not node.is_impure()


def _argument(node: fx.Node, name: str) -> object:
    """The value ``node`` passes its op's argument ``name`` (positional, keyword or the default)."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, arg.default_value)
    raise KeyError(name)


def call_through_bindings(gm: fx.GraphModule) -> int:
    """Each call of ``gm`` to an aten overload that torch's own Python bindings call the same way (``aten.mm.default``
    as ``torch.mm``, ``aten.view.default`` as ``Tensor.view``) made through the binding, in place; returns how many.

    A graph run from Python calls ``torch.ops.aten.<op>.<overload>``, an ``OpOverload`` object whose Python
    ``__call__`` reaches the dispatcher (2.1 us for a ``view`` of an 8x8 tensor, ``timeit``), where the binding's
    C++ argument parser picks the same overload from the same arguments (0.9 us). Measured on the lowered data-
    parallel GPT and Llama (2 gloo ranks, 540 and 648 calls a step retargeted, the same gradients): 34-39 ms a
    step against 38-47 alternated. Run last, on a graph no pass reads again (the passes match aten overloads),
    and not where inductor compiles (it lowers aten overloads)."""
    changed = 0
    for node in gm.graph.nodes:
        binding = _BINDINGS.get(node.target) if node.op == "call_function" else None
        if binding is not None:
            node.target = binding
            changed += 1
    return recompiled(gm, changed)


_BINDINGS = {
    _aten.view.default: torch.Tensor.view, _aten.expand.default: torch.Tensor.expand,
    _aten.copy_.default: torch.Tensor.copy_, _aten.detach.default: torch.Tensor.detach,
    _aten.t.default: torch.t, _aten.permute.default: torch.permute, _aten.transpose.int: torch.transpose,
    _aten.unsqueeze.default: torch.unsqueeze, _aten.clone.default: torch.clone,
    _aten.mm.default: torch.mm, _aten.bmm.default: torch.bmm, _aten.addmm.default: torch.addmm,
    _aten.add.Tensor: torch.add, _aten.sub.Tensor: torch.sub, _aten.mul.Tensor: torch.mul, _aten.div.Tensor: torch.div,
    _aten.neg.default: torch.neg, _aten.sum.dim_IntList: torch.sum,
    _aten.split_with_sizes.default: torch.split_with_sizes, _aten.native_layer_norm.default: torch.native_layer_norm,
    _aten.embedding.default: torch.embedding, _aten.linear.default: torch._C._nn.linear,
    _aten.gelu.default: torch._C._nn.gelu,
}
"""aten overload -> the binding that calls it with the same arguments (positional and keyword names alike)."""
