"""Compute cost: the time of one kernel on one device (roofline with achievable efficiencies).

This module is for pricing a single op's kernel from its FLOPs and HBM traffic. It is not for
counting FLOPs or bytes of an op (the strategies do that) nor for communication (``comm.py``).

Model::

    time = max(flops / (flop_peak * op_efficiency(kind, flops)),
               bytes_moved / (hbm_bw * MEMORY_EFFICIENCY)) + kernel_launch_s

* ``matmul`` runs on tensor cores at ``device.peak(dtype)``. Its efficiency rises smoothly with
  size: ``eff = MATMUL_MAX_EFFICIENCY * f / (f + f_half)``, so its compute time is
  ``(f + f_half) / (MATMUL_MAX_EFFICIENCY * peak)``: the asymptotic rate plus a fixed ramp (tile
  and wave fill) of ``f_half / (MATMUL_MAX_EFFICIENCY * peak)``. ``f_half = peak * MATMUL_RAMP_S``
  scales with the device, so a GEMM is "large" when it keeps the device busy for several
  microseconds: with 5 us, f_half is 1.6e9 FLOPs on A100 BF16 and 4.9e9 on H100. Large cuBLAS
  GEMMs reach about 75-85% of dense peak on A100/H100 (hence 0.8); 4096^3 BF16 on A100 gets 0.79
  here and 1024^3 gets 0.46.
* ``elementwise`` and ``other`` ops are bandwidth-bound: they reach about 70% of HBM bandwidth
  (typical of fused elementwise kernels measured against STREAM-like peaks) and run their few
  FLOPs on the vector units at the fp32 (non-tensor) peak, with the same 0.7.
* A kernel with no FLOPs and no bytes costs nothing (it is not launched).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .hardware import DeviceSpec

MATMUL_MAX_EFFICIENCY = 0.8
"""Fraction of dense tensor-core peak that a large GEMM achieves."""
MATMUL_RAMP_S = 5e-6
"""Seconds at peak that a GEMM must fill to reach half of MATMUL_MAX_EFFICIENCY."""
REFERENCE_PEAK_FLOPS = 312e12
"""Peak used by op_efficiency when none is given (A100 BF16): f_half = 1.56e9 FLOPs."""
MEMORY_EFFICIENCY = 0.7
"""Fraction of HBM bandwidth (and of vector FLOP/s) a bandwidth-bound kernel achieves."""

def matmul_half_flops(peak_flops: float) -> float:
    """FLOPs at which a GEMM reaches half its maximum efficiency on a device of ``peak_flops``."""
    return peak_flops * MATMUL_RAMP_S


def _matmul_efficiency(flops: float, peak_flops: float) -> float:
    return MATMUL_MAX_EFFICIENCY * flops / (flops + matmul_half_flops(peak_flops))


def _bandwidth_bound_efficiency(flops: float, peak_flops: float) -> float:
    return MEMORY_EFFICIENCY


@dataclass(frozen=True)
class _OpModel:
    """How one kind of op is priced: its efficiency curve and which FLOP peak it runs at."""

    efficiency: Callable[[float, float], float]
    tensor_cores: bool


_OPS: Mapping[str, _OpModel] = {
    "matmul": _OpModel(_matmul_efficiency, tensor_cores=True),
    "elementwise": _OpModel(_bandwidth_bound_efficiency, tensor_cores=False),
    "other": _OpModel(_bandwidth_bound_efficiency, tensor_cores=False),
}
KINDS = tuple(_OPS)


def op_efficiency(kind: str, flops: float, peak_flops: float = REFERENCE_PEAK_FLOPS) -> float:
    """Achievable fraction of peak for an op of ``kind`` doing ``flops`` on a device of ``peak_flops``."""
    _check_kind(kind)
    return _OPS[kind].efficiency(_non_negative("flops", flops), peak_flops)


def compute_time(flops: float, bytes_moved: float, device: DeviceSpec, dtype: Any,
                 kind: str = "matmul") -> float:
    """Seconds for one kernel: roofline of FLOPs and HBM bytes, plus the launch floor."""
    _check_kind(kind)
    flops, bytes_moved = _non_negative("flops", flops), _non_negative("bytes_moved", bytes_moved)
    if flops == 0 and bytes_moved == 0:
        return 0.0
    memory_s = bytes_moved / (device.hbm_bw * MEMORY_EFFICIENCY)
    return max(_flop_time(flops, device, dtype, kind), memory_s) + device.kernel_launch_s


def _flop_time(flops: float, device: DeviceSpec, dtype: Any, kind: str) -> float:
    if flops == 0:
        return 0.0
    peak = device.peak(dtype) if _OPS[kind].tensor_cores else device.peak("fp32")
    return flops / (peak * op_efficiency(kind, flops, peak))


def _check_kind(kind: str) -> None:
    if kind not in _OPS:
        raise ValueError(f"unknown op kind {kind!r}: expected one of {', '.join(KINDS)}")


def _non_negative(name: str, value: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not 0 <= number < math.inf:
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
    return number
