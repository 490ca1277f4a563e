"""Run the ops DTensor cannot dispatch on local shards, outside DTensor.

Two kinds of nodes get this treatment, both marked ``"local": true`` in the plan's ops:

* ops with no DTensor strategy, planned all-``R`` (the planner warned): every rank runs the whole op;
* ops planned with one of autopar's own *local rules* (``autopar.planning.strategies.LOCAL_RULES``), e.g.
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

from .insert_redistributes import mesh_attr
from .layout import memory_order, wrap_with_layout


def run_local_op(op: Callable[..., Any], mesh: DeviceMesh, out_placements: Sequence[Sequence[str] | None],
                 layouts: Sequence[tuple[int, ...] | None], *args: Any, **kwargs: Any) -> Any:
    to_local = lambda a: a.to_local() if isinstance(a, DTensor) else a  # noqa: E731
    out = op(*tree_map(to_local, args), **tree_map(to_local, kwargs))
    if isinstance(out, torch.Tensor):
        return wrap_with_layout(out, mesh, out_placements[0], layouts[0])
    return type(out)(
        wrap_with_layout(t, mesh, p, order) if isinstance(t, torch.Tensor) and p is not None else t
        for t, p, order in zip(out, out_placements, layouts)
    )


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
