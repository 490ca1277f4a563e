"""Derivatives the rank's program cannot run as captured, replaced by autograd functions that can.

The program runs the captured, functionalized step under eager autograd (DTensor's dispatch, or local shards
for the ops ``run_locally`` rewrote), so every op in it needs a derivative that runs there. Two do not, in
torch 2.13:

* ``aten.copy`` (the functional form of ``dst.copy_(src)``) has no derivative at all: "derivative for
  aten::copy is not implemented". ``copy_with_derivative``: the gradient goes to ``src``, summed over the dims
  the copy broadcast it to in its dtype; ``dst``'s values are overwritten, so it gets zeros (as a
  tensor like the gradient: autograd would make an undefined one a plain tensor, which DTensor's backward of
  a redistribute cannot take).
* ``aten.slice_scatter``'s derivative with respect to the tensor it writes into (``self``) makes its zeros with
  a factory op, a plain tensor, and meets a DTensor gradient with it: "got mixed torch.Tensor and DTensor".
  ``slice_scatter_keeping_dtensors`` makes them like the gradient's slice.

Both come from a buffer written slice by slice (``q = k.new_empty(...); q[..., :n].copy_(a); q[..., n:] = b``:
DeepSeek-V3's multi-head latent attention), captured as ``copy`` and ``slice_scatter`` chains.

One more runs, but on every rank at the global size: ``aten.gather``'s derivative makes its zeros with
``grad.new_zeros(self.shape)``, and DTensor places them as the gradient, which for a loss's per-token
gradient is the mean's replicated scalar expanded. Each rank then fills a buffer of the whole batch's
logits (data parallelism's degree times its own, and tensor parallelism's too where the vocabulary is split)
to keep its rows of it: on tiny-llama at dp=2 x tp=2, 256 KiB for 128 KiB of local logits; on a Llama vocabulary
tens of GB under a pipeline, which runs on DTensor. ``gather_with_placed_gradient`` makes them in ``self``'s
own placement (the lowered runtime's trace gets the same: ``lower_simplify``'s sliced fills no longer arise).

``keep_derivatives`` swaps them in where the program calls them; ``run_local_op`` runs the ops it is handed
through the same table (``DIFFERENTIABLE``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx
from torch.distributed.tensor import DTensor

_SLICE_SCATTER = torch.ops.aten.slice_scatter.default
_COPY = torch.ops.aten.copy.default
_GATHER = torch.ops.aten.gather.default


def slice_scatter_keeping_dtensors(self: torch.Tensor, src: torch.Tensor, dim: int = 0, start: int | None = None,
                                   end: int | None = None, step: int = 1) -> torch.Tensor:
    """``aten.slice_scatter`` (same arguments) whose backward runs on DTensor gradients."""
    return _SliceScatter.apply(self, src, dim, start, end, step)


def copy_with_derivative(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy`` (same arguments) with its derivative."""
    return _Copy.apply(self, src, non_blocking)


class _SliceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base: torch.Tensor, src: torch.Tensor, dim: int, start: int | None,  # type: ignore[override]
                end: int | None, step: int) -> torch.Tensor:
        ctx.where = (dim, start, end, step)
        return _SLICE_SCATTER(base, src, dim, start, end, step)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        dim, start, end, step = ctx.where
        written = torch.ops.aten.slice.Tensor(grad, dim, start, end, step)
        to_base = _SLICE_SCATTER(grad, torch.zeros_like(written), dim, start, end, step)
        return (to_base if ctx.needs_input_grad[0] else None, written if ctx.needs_input_grad[1] else None,
                None, None, None, None)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dst: torch.Tensor, src: torch.Tensor,  # type: ignore[override]
                non_blocking: bool) -> torch.Tensor:
        ctx.src_shape, ctx.src_dtype = src.shape, src.dtype
        return _COPY(dst, src, non_blocking)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        overwritten = torch.zeros_like(grad) if ctx.needs_input_grad[0] else None  # zeros, not None: a None
        return overwritten, _summed_to(grad.to(ctx.src_dtype), ctx.src_shape), None  # reaches DTensor as a Tensor


def gather_with_placed_gradient(self: torch.Tensor, dim: int, index: torch.Tensor, *,
                                sparse_grad: bool = False) -> torch.Tensor:
    """``aten.gather`` (same arguments) whose gradient is made in ``self``'s placement (the module doc)."""
    return _Gather.apply(self, dim, index, sparse_grad)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base: torch.Tensor, dim: int, index: torch.Tensor,  # type: ignore[override]
                sparse_grad: bool) -> torch.Tensor:
        ctx.dim, ctx.zeros = dim, _zeros_placed_like(base)
        ctx.save_for_backward(index)
        return _GATHER(base, dim, index, sparse_grad=sparse_grad)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (index,) = ctx.saved_tensors
        return torch.ops.aten.scatter_add.default(ctx.zeros(), ctx.dim, index, grad), None, None, None


def _zeros_placed_like(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A maker of zeros of ``t``'s shape, dtype and (for a DTensor) placement, holding none of ``t``'s memory."""
    if not isinstance(t, DTensor):
        shape, dtype, device = t.shape, t.dtype, t.device
        return lambda: torch.zeros(shape, dtype=dtype, device=device)
    from .lower_eager import from_local  # imported here: lower_eager imports this module

    spec, local = t._spec, t._local_tensor
    shape, dtype, device = local.shape, local.dtype, local.device
    return lambda: from_local(torch.zeros(shape, dtype=dtype, device=device), spec.mesh, spec)


def _summed_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` summed over the dims a broadcast to its shape from ``shape`` added or stretched."""
    added = grad.ndim - len(shape)
    if added:
        grad = grad.sum(dim=tuple(range(added)))
    stretched = tuple(d for d, size in enumerate(shape) if size == 1 and grad.shape[d] != 1)
    return grad.sum(dim=stretched, keepdim=True) if stretched else grad


DIFFERENTIABLE: dict[Any, Callable[..., torch.Tensor]] = {
    _SLICE_SCATTER: slice_scatter_keeping_dtensors,
    _COPY: copy_with_derivative,
    _GATHER: gather_with_placed_gradient,
}
"""Captured op -> the same op with a derivative the program can run (and, for ``gather``, run at its size)."""


def keep_derivatives(gm: fx.GraphModule) -> int:
    """Swap ``DIFFERENTIABLE``'s ops that ``gm`` calls for their replacements; returns how many."""
    swapped = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in DIFFERENTIABLE:
            node.target = DIFFERENTIABLE[node.target]
            swapped += 1
    if swapped:
        gm.recompile()
    return swapped
