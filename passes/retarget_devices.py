"""The program's factory ops make their tensors on the mesh's device.

An op that makes a tensor from nothing (``scalar_tensor``, ``full``, ``arange``, ``empty``...) records, as its
``device`` argument, the device the step was captured on. A model built on the meta device is captured there
(``runtime/deferred_init.py``), and a CPU model for a GPU job on the CPU; run as captured, such an op would make
a tensor with no values, or on a device the rest of the program is not on. Every ``device`` argument is
rewritten to the device type of the mesh the program runs on.
"""

from __future__ import annotations

import torch
from torch import fx


def retarget_devices(program: fx.GraphModule, device_type: str) -> None:
    """Rewrite ``program``'s ``device`` arguments to ``device_type``."""
    target = torch.device(device_type)
    moved = [n for n in program.graph.nodes
             if isinstance(n.kwargs.get("device"), torch.device) and n.kwargs["device"].type != target.type]
    for node in moved:
        node.kwargs = {**node.kwargs, "device": target}
    if moved:
        program.recompile()
