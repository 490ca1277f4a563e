"""A program's buffer writes as outputs, for the lowered runtime (``passes/lower.py``).

A ``write_buffer`` op (``ir/buffer_writes.py``) has no output: traced by AOT autograd, an op kept only for its
effect must be registered as one (a token threaded through the graphs, which moves the loss from the forward
graph's first output), and AOT's partitioner refuses an impure op beside the recompute tags parameter
regathering sets. So the lowered runtime traces the program with each write replaced by one more output,
the written value, after the program's own; ``LoweredProgram`` writes those values into the buffers as its
forward returns (``buffer_writes.write_values``), on every path its graphs run (AOT's wrapper, the direct
graphs, the eager forward). The DTensor program keeps its write ops.
"""

from __future__ import annotations

from torch import fx

from autopar.ir.buffer_writes import WRITE_BUFFER

from .run_locally import local_call


def writes_as_outputs(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """``gm``, or where it writes buffers a copy whose writes are outputs after its own, and the buffers' names
    in that order. ``gm`` itself is not changed (it stays the DTensor program)."""
    if not any(written_value(node) for node in gm.graph.nodes):
        return gm, []
    graph = fx.Graph()
    copied: dict[fx.Node, fx.Node] = {}
    returned = graph.graph_copy(gm.graph, copied)
    names, values = [], []
    for original in gm.graph.nodes:
        write = written_value(original)
        if write is not None:
            value, name = write
            names.append(name)
            values.append(copied[value])
            graph.erase_node(copied[original])
    graph.output((*returned, *values) if isinstance(returned, (tuple, list)) else (returned, *values))
    return fx.GraphModule(gm, graph), names


def written_value(node: fx.Node) -> tuple[fx.Node, str] | None:
    """(value, buffer name) of a ``write_buffer`` node, as captured or as ``run_locally`` rewrote it; else None."""
    if node.op != "call_function":
        return None
    op, args = local_call(node) or (node.target, node.args)
    return (args[0], args[1]) if op is WRITE_BUFFER else None
