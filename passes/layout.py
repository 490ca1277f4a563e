"""Memory layouts of DTensor values: keep the layout the captured graph was traced with.

Kernels pick output layouts by device and size, and collectives return contiguous tensors, but the
captured graph may rely on a layout (a ``view`` after a ``transpose`` is only valid on the layout the
trace saw). These helpers restore a captured memory order on a DTensor's local shard.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.core.placement import placements_to_strs, strs_to_placements
from autopar.ir.layers import captured_value


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """Dims from outermost to innermost in memory."""
    return order_of(t.stride(), t.shape)


def order_of(stride: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """``memory_order`` of a tensor of ``stride`` and ``shape`` (a DTensor spec's, say)."""
    return tuple(sorted(range(len(shape)), key=lambda d: (stride[d], shape[d]), reverse=True))


def wrap_with_layout(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[str], order: tuple[int, ...] | None) -> DTensor:
    """A DTensor over ``local`` laid out in memory as the captured graph expects.

    Kernels pick output layouts by device and size (CPU flash attention returns a permuted one, its meta
    kernel may not), and the graph relies on the captured layout (a ``view`` after a transpose). So the
    output is rearranged to the captured memory order when it differs, and its global strides keep it.
    """
    order = order or memory_order(local)
    if memory_order(local) != order:
        local = local.permute(order).contiguous().permute(_inverse(order))
    shape = list(local.shape)
    for p, size in zip(placements, mesh.shape):
        if p.startswith("S("):
            shape[int(p[2:-1])] *= size
    stride = [0] * local.ndim
    step = 1
    for d in reversed(order):
        stride[d] = step
        step *= shape[d]
    return DTensor.from_local(local, mesh, strs_to_placements(placements), run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


def in_memory_order(x: DTensor, order: tuple[int, ...]) -> DTensor:
    """``x`` with its local shard rearranged to memory order ``order`` (``wrap_with_layout``), and a
    backward that hands the gradient back as it comes: ``DTensor.from_local`` alone would turn a
    partial gradient into a replicated one (an all_reduce) before the op that made ``x`` (a gather,
    whose own backward would reduce-scatter it onto the shard instead)."""
    return _Relayout.apply(x, order)


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, order: tuple[int, ...]) -> DTensor:  # type: ignore[override]
        return wrap_with_layout(x.to_local(), x.device_mesh, placements_to_strs(x.placements), order)

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple[DTensor, None]:  # type: ignore[override]
        return grad, None


def _inverse(order: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return tuple(inv)


def gradient_in_spec_layout(x: Any) -> Any:
    """``x`` as it is, with a backward that lays its gradient's local shard out as the gradient's spec says
    (``_GradientInSpecLayout``); anything but a DTensor passes through."""
    return _GradientInSpecLayout.apply(x) if isinstance(x, DTensor) else x


class _GradientInSpecLayout(torch.autograd.Function):
    """Where DTensor's spec and its local shard disagree on a gradient's memory order (torch 2.13: the
    backward of ``unsqueeze``, ``aten.squeeze.dim``, returns a local ``[8, 16, 16]`` of strides
    ``(256, 1, 16)`` under a spec of strides ``(512, 32, 1)``), a reshaping view's backward, which reshapes
    by the spec's strides, views a local shard that cannot be viewed so. Placed on the outputs of the
    program's reshaping views (``guard_view_gradients``), this rearranges such a gradient into its spec's
    layout first; a consistent one passes untouched."""

    @staticmethod
    def forward(ctx, x: DTensor) -> DTensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:  # type: ignore[override]
        meta = grad._spec.tensor_meta if isinstance(grad, DTensor) else None
        if meta is None:
            return grad
        want = order_of(meta.stride, meta.shape)
        if memory_order(grad._local_tensor) == want:
            return grad
        return wrap_with_layout(grad._local_tensor, grad.device_mesh, placements_to_strs(grad.placements), want)


def in_captured_layout(x: Any, order: tuple[int, ...]) -> Any:
    """``x`` laid out in memory as the captured graph saw it (``order``, outermost dim first), for a reshaping
    view the trace saw valid: where DTensor's spec or local shard lays it out otherwise (XLNet's relative
    attention under tp: a replicated ``[8, 2, 8, 8, 1]`` of strides ``(8, 512, 64, 1, 1)`` that ``view`` cannot
    take), it is rearranged (``in_memory_order``); a value laid out as captured passes untouched, as does
    anything but a DTensor."""
    if not isinstance(x, DTensor):
        return x
    meta = x._spec.tensor_meta
    if order == tuple(range(x.ndim)):  # captured contiguous: the common case, checked as torch checks it
        if x._local_tensor.is_contiguous() and (meta is None or _contiguous(meta.shape, meta.stride)):
            return x
    elif memory_order(x._local_tensor) == order and (meta is None or order_of(meta.stride, meta.shape) == order):
        return x
    return in_memory_order(x, order)


def _contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` is the row-major layout of ``shape`` (dims of size 1 may have any stride)."""
    step = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != step:
            return False
        step *= size
    return True


def guard_view_gradients(gm: fx.GraphModule, views: Sequence[Any]) -> None:
    """Put ``gradient_in_spec_layout`` on the output of every reshaping view of ``gm`` (``views``: their
    targets), and ``in_captured_layout`` on its input."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in views:
            source = node.args[0]
            val = captured_value(source)
            if isinstance(val, torch.Tensor):
                with gm.graph.inserting_before(node):
                    order = tuple(range(val.ndim)) if val.is_contiguous() else memory_order(val)
                    laid = gm.graph.call_function(in_captured_layout, (source, order))
                laid.meta = {**node.meta, "val": val}  # the view's layer (checkpointing, stages), its input's value
                node.args = (laid, *node.args[1:])
            with gm.graph.inserting_after(node):
                guard = gm.graph.call_function(gradient_in_spec_layout, (node,))
            guard.meta = dict(node.meta)  # the view's layer and value: checkpointing and stages read them
            node.replace_all_uses_with(guard, delete_user_cb=lambda user: user is not guard)
    gm.graph.lint()
    gm.recompile()
