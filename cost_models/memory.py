"""Memory cost: bytes of optimizer state and how much of a device's HBM a plan may fill.

This module is for per-device memory facts that do not depend on the model graph: AdamW state
per parameter element, and the usable share of HBM after a reserve. It is not for activation
accounting (that belongs to the strategies, which know the graph).

Mixed-precision AdamW follows the convention of Megatron-LM and ZeRO (Rajbhandari et al., SC20):
both moments (exp_avg, exp_avg_sq) in fp32, 8 bytes per element, plus an fp32 master copy of a
parameter kept in 16-bit (or 8-bit) precision, 4 bytes more: 12 bytes per element in all, on
top of the parameter and gradient themselves. Moments of a parameter wider than fp32 (fp64) are
kept in its own precision, as torch.optim.AdamW does.
"""

from __future__ import annotations

from typing import Any

from .hardware import DTYPE_BYTES, DeviceSpec, dtype_key

FP32_BYTES = DTYPE_BYTES["fp32"]
ADAM_MOMENTS = 2

RESERVE_FRACTION = 0.08
"""Share of HBM a plan must leave free: CUDA context and NCCL buffers (roughly 0.5-1.5 GB),
allocator fragmentation and rounding (the caching allocator's blocks rarely pack above ~92-95%)."""


def adamw_state_bytes(numel: int, param_dtype: Any, master_fp32: bool = True) -> int:
    """Bytes of AdamW state for ``numel`` parameter elements stored in ``param_dtype``.

    Moments: 2 x max(4, itemsize) bytes per element. Master copy: 4 bytes per element when the
    parameter is narrower than fp32 and ``master_fp32``.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    itemsize = DTYPE_BYTES[dtype_key(param_dtype)]
    moments = ADAM_MOMENTS * max(FP32_BYTES, itemsize)
    master = FP32_BYTES if master_fp32 and itemsize < FP32_BYTES else 0
    return numel * (moments + master)


def reserve_fraction() -> float:
    """Share of HBM kept free of plan-owned tensors (see RESERVE_FRACTION)."""
    return RESERVE_FRACTION


def usable_bytes(device: DeviceSpec) -> float:
    """HBM a plan may fill on ``device``: capacity less the reserve."""
    return device.hbm_bytes * (1 - reserve_fraction())
