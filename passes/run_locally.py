"""Run the ops DTensor cannot dispatch on local shards, outside DTensor.

Two kinds of nodes get this treatment, both marked ``"local": true`` in the plan's ops:

* ops with no DTensor strategy, planned all-``R`` (the planner warned): every rank runs the whole op;
* ops planned with one of autopar's own *local rules* (``autopar.strategies.LOCAL_RULES``), e.g.
  fused attention split on batch or heads: each rank runs the op on its shards, which is exact
  because the split dims are independent.

The node's DTensor inputs become local tensors, the op runs, and its outputs are wrapped back with the
planned placements. ``to_local``/``from_local`` are differentiable, so autograd reaches every input.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from autopar.placement import strs_to_placements

from .insert_redistributes import mesh_attr


def run_local_op(op: Callable[..., Any], mesh: DeviceMesh, out_placements: Sequence[Sequence[str] | None],
                 layouts: Sequence[tuple[int, ...] | None], *args: Any, **kwargs: Any) -> Any:
    to_local = lambda a: a.to_local() if isinstance(a, DTensor) else a  # noqa: E731
    out = op(*tree_map(to_local, args), **tree_map(to_local, kwargs))
    if isinstance(out, torch.Tensor):
        return _wrap(out, mesh, out_placements[0], layouts[0])
    return type(out)(
        _wrap(t, mesh, p, order) if isinstance(t, torch.Tensor) and p is not None else t
        for t, p, order in zip(out, out_placements, layouts)
    )


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """Dims from outermost to innermost in memory."""
    return tuple(sorted(range(t.ndim), key=lambda d: (t.stride(d), t.shape[d]), reverse=True))


def _wrap(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[str], order: tuple[int, ...] | None) -> DTensor:
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


def _inverse(order: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return tuple(inv)


def _layouts(node: fx.Node) -> tuple[tuple[int, ...] | None, ...]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return tuple(memory_order(v) if isinstance(v, torch.Tensor) else None for v in vals)


def run_locally(gm: fx.GraphModule, ops: Mapping[str, Mapping[str, Any]], mesh: DeviceMesh) -> int:
    """Rewrite every node marked local; returns how many."""
    local = {name for name, op in ops.items() if op.get("local")}
    if not local:
        return 0
    mesh_node = mesh_attr(gm, mesh)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.name in local:
            outs = tuple(tuple(p) if p is not None else None for p in ops[node.name]["outputs"])
            node.args = (node.target, mesh_node, outs, _layouts(node), *node.args)
            node.target = run_local_op
    gm.recompile()
    return len(local)
