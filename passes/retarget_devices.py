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


def retarget_devices(program: fx.GraphModule, device_type: str) -> int:
    """Rewrite ``program``'s ``device`` arguments to ``device_type``; the number of ops rewritten."""
    target = torch.device(device_type)
    rewritten = 0
    for node in program.graph.nodes:
        device = node.kwargs.get("device")
        if isinstance(device, torch.device) and device.type != target.type:
            node.kwargs = {**node.kwargs, "device": target}
            rewritten += 1
    if rewritten:
        program.recompile()
    return rewritten
