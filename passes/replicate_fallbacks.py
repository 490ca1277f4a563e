"""Run ops that DTensor cannot shard on replicated local tensors.

The planner gives such ops all-``R`` strategies (and warns); here each one is replaced by a call that
takes its (replicated) DTensor inputs to local tensors, runs the op, and wraps the outputs back as
replicated DTensors. Both conversions are differentiable, so autograd still reaches every input.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_map


def run_replicated(op: Callable[..., Any], mesh: DeviceMesh, *args: Any, **kwargs: Any) -> Any:
    to_local = lambda a: a.to_local() if isinstance(a, DTensor) else a  # noqa: E731
    out = op(*tree_map(to_local, args), **tree_map(to_local, kwargs))
    wrap = lambda t: DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False) \
        if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tree_map(wrap, out)


def replicate_fallbacks(gm: fx.GraphModule, fallback_nodes: set[str], mesh: DeviceMesh) -> int:
    from .insert_redistributes import mesh_attr

    count = 0
    mesh_node = mesh_attr(gm, mesh) if fallback_nodes else None
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.name in fallback_nodes:
            node.args = (node.target, mesh_node, *node.args)
            node.target = run_replicated
            count += 1
    gm.recompile()
    return count
