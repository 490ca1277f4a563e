"""``bind_ops``: a plan's per-op strategies, named by the nodes of another capture of its model.

The planner may have traced a stack of identical layers only a few layers deep
(``autopar.ir.capture.LayerStack``), so ``plan.ops`` names the nodes of that shorter graph; the
runtime (``passes.build_program``) and re-pricing (``planning/whatif.py``) may hold the whole model's
graph. Both graphs give each op the same structural tie key (module path
with layer indices as ``*``, op, ordinal; ``capture._tie_repeated_layers``), which the plan records as
each op's ``decision``: every op of the runtime's graph takes the entry of its key. An op whose key
the plan lacks, or whose entry is another op, keeps no entry and follows its inputs
(``insert_redistributes``), as before. Parameter and buffer placements need no binding: the plan lists
them for every real parameter (``CapturedGraph.real_fqns``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.core.plan import Plan
from autopar.ir.capture import CapturedGraph


def bind_ops(plan: Plan, captured: CapturedGraph) -> Plan:
    """``plan`` with ``ops`` keyed by the node names of ``captured``."""
    by_key = {op["decision"]: op for op in plan.ops.values() if "decision" in op}
    if not by_key:  # a plan written before ops carried their keys: names are all there is
        return plan
    ops: dict[str, dict[str, Any]] = {}
    for node in captured.graph.nodes:
        entry = by_key.get(captured.tie_keys.get(node.name, ""))
        if node.op == "call_function" and entry is not None and entry.get("op") == str(node.target):
            ops[node.name] = entry
    return replace(plan, ops=ops)
