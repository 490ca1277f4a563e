"""Memory cost: bytes of optimizer state and how much of a device's HBM a plan may fill.

This module is for per-device memory facts that do not depend on the model graph: AdamW state
per parameter element, and the usable share of HBM after a reserve. It is not for activation
accounting (that belongs to the strategies, which know the graph).

AdamW's state follows the dtype of the parameters the optimizer steps (the masters): torch.optim.AdamW
creates its moments (exp_avg, exp_avg_sq) like the parameter (``torch.zeros_like``), so each moment
takes the masters' bytes. With fp32 masters under 16-bit compute this is the convention of Megatron-LM
and ZeRO (Rajbhandari et al., SC20): two fp32 moments, 8 bytes per element, plus the fp32 master copy,
4 more: 12 bytes on top of the parameter and gradient themselves. With bf16 masters (Apex
``DistributedFusedAdam(dtype=torch.bfloat16)``, NeMo's ``optim.dtype: bf16``: "dtype: datatype for
optimizer state", its parameter shard and both moments; Megatron-FSDP's
``--megatron-fsdp-main-params-dtype bf16``; Megatron-Core's precision-aware optimizer keeps only the
moments in bf16, ``--exp-avg-dtype bf16``, its ``--main-params-dtype`` being fp32 or fp16) the moments
take 4 bytes, and the masters are the program's own parameters, so no copy is kept, except where
ZeRO-1/2 cuts the state into dp-shards: a shard is a tensor of its own. Masters are never narrower
than the parameter (fp64 stays fp64).
"""

from __future__ import annotations

from typing import Any

from .hardware import DTYPE_BYTES, DeviceSpec, dtype_key

FP32_BYTES = DTYPE_BYTES["fp32"]
ADAM_MOMENTS = 2

RESERVE_FRACTION = 0.08
"""Share of HBM a plan must leave free: CUDA context and NCCL buffers (roughly 0.5-1.5 GB),
allocator fragmentation and rounding (the caching allocator's blocks rarely pack above ~92-95%)."""


def master_dtype_of(param_dtype: Any, master_dtype: str = "fp32") -> str:
    """The dtype the optimizer keeps a ``param_dtype`` parameter's masters in: ``master_dtype``, or the
    parameter's own where that is wider (fp64)."""
    param = dtype_key(param_dtype)
    return param if DTYPE_BYTES[param] > DTYPE_BYTES[dtype_key(master_dtype)] else dtype_key(master_dtype)


def adamw_state_bytes(numel: int, param_dtype: Any, master_dtype: str = "fp32", sharded: bool = False) -> int:
    """Bytes of AdamW state for ``numel`` elements of a parameter the program computes with in
    ``param_dtype``, its optimizer stepping masters in ``master_dtype`` (see the module doc).

    Moments: 2 x the masters' bytes per element. Master copy: the masters' bytes per element where
    they are not the program's parameter: another dtype (mixed precision), or ``sharded`` (ZeRO-1/2's
    dp-shard of a parameter the program holds whole). The caller divides a sharded state by its shards.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    master = master_dtype_of(param_dtype, master_dtype)
    master_bytes = DTYPE_BYTES[master]
    copy = master_bytes if sharded or master != dtype_key(param_dtype) else 0
    return numel * (ADAM_MOMENTS * master_bytes + copy)


def reserve_fraction() -> float:
    """Share of HBM kept free of plan-owned tensors (see RESERVE_FRACTION)."""
    return RESERVE_FRACTION


def usable_bytes(device: DeviceSpec) -> float:
    """HBM a plan may fill on ``device``: capacity less the reserve."""
    return device.hbm_bytes * (1 - reserve_fraction())
