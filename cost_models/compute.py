"""Compute cost: the time of one kernel on one device (roofline with achievable efficiencies).

This module is for pricing a single op's kernel from its FLOPs and HBM traffic. It is not for
counting FLOPs or bytes of an op (the strategies do that) nor for communication (``comm.py``).

Model::

    kernel = max(flops / (flop_peak * op_efficiency(kind, flops)),
                 bytes_moved / (hbm_bw * MEMORY_EFFICIENCY)) + kernel_launch_s
    time   = kernel + host_op_s        where the host runs the kernels (CPU: host_runs_kernels)
           = max(kernel, host_op_s)    where it enqueues them ahead of the device (CUDA)

* ``matmul`` runs on tensor cores at ``device.peak(dtype)``. Its efficiency rises smoothly with
  size: ``eff = plateau * f / (f + f_half)``, so its compute time is
  ``(f + f_half) / (plateau * peak)``: the asymptotic rate plus a fixed ramp (tile
  and wave fill) of ``f_half / (plateau * peak)``. ``f_half = peak * MATMUL_RAMP_S``
  scales with the device, so a GEMM is "large" when it keeps the device busy for several
  microseconds: with 5 us, f_half is 1.6e9 FLOPs on A100 BF16 and 4.9e9 on H100. Large cuBLAS
  GEMMs reach about 75-85% of dense peak on A100/H100 (hence a plateau of 0.8,
  ``hardware.MATMUL_MAX_EFFICIENCY``); 4096^3 BF16 on A100 gets 0.79 here and 1024^3 gets 0.46. A device
  whose GEMMs plateau elsewhere states its own (``DeviceSpec.matmul_efficiency``: B200 0.64, measured).
* ``attention`` and ``attention_backward``: a fused attention kernel (flash attention) on tensor cores,
  forward and backward: the GEMM's ramp, ``f_half / (plateau * peak)`` seconds of tile and wave fill,
  then the kernel's own rate (``DeviceSpec.attention_efficiency``: Hopper 0.61 and 0.53 of peak,
  FlashAttention-3's and cuDNN's figures; ``backward_kind`` names the kind a kernel's backward is
  priced as). A device without the figures prices both as GEMMs.
* ``misaligned_matmul``: a GEMM with a dimension that breaks the device's tensor-core alignment
  (``DeviceSpec.gemm_alignment_bytes``: GPT-2's 50,257-token vocabulary in bf16) falls back to
  slower kernels: ``MISALIGNED_MATMUL_FACTOR`` of the aligned efficiency (``matmul_kind`` decides).
* ``elementwise`` and ``other`` ops are bandwidth-bound: they reach about 70% of HBM bandwidth
  (typical of fused elementwise kernels measured against STREAM-like peaks) and run their few
  FLOPs on the vector units at the fp32 (non-tensor) peak, with the same 0.7.
* An op with no FLOPs and no bytes (a view) launches no kernel; it still costs its dispatch.
* Dispatch (``dispatched_time``): every op a step runs goes through autopar's runtime on the host
  (DTensor's sharding propagation, autograd, Python: ``host_op_s``). On CPU the same cores then run
  the kernel, so the two add up; on CUDA the host enqueues kernels asynchronously and runs ahead, so
  an op costs the longer of the two (the host is hidden while the device is the slower).
* The optimizer update (``adamw_step_time``): AdamW as ``torch.optim.AdamW`` runs it by default
  off CUDA (``torch/optim/adam.py``, ``_single_tensor_adam``): per parameter tensor
  ``ADAMW_KERNELS_PER_TENSOR`` elementwise kernels (weight decay ``mul_``, ``exp_avg.lerp_``,
  ``exp_avg_sq.mul_`` and ``addcmul_``, ``sqrt``, ``div``, ``add_`` of eps, ``param.addcdiv_``),
  each paying its floor and its dispatch outside autograd (``host_update_op_s``), which together
  move ``adamw_bytes_per_element`` bytes per element of the tensor's local shard: the fewest any
  AdamW implementation moves, read and written once (the fp32 value, master copy or parameter, and
  both moments), plus the gradient read and, with a master copy, the low-precision parameter
  written. CUDA's foreach/fused variants launch fewer kernels, so there the per-tensor floors are
  an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from .hardware import DTYPE_BYTES, MATMUL_MAX_EFFICIENCY, DeviceSpec, dtype_key
from .memory import adamw_state_bytes, master_dtype_of

MATMUL_RAMP_S = 5e-6
"""Seconds at peak that a GEMM must fill to reach half of its device's plateau efficiency."""
MISALIGNED_MATMUL_FACTOR = 0.2
"""Share of an aligned GEMM's rate that a misaligned one reaches. Measured on an H200 in bf16
(``benchmarks/device_step.py``, results in ``benchmarks/README.md``): [16384, 4096] @ [4096, n] runs at
137 TFLOP/s for n = 50,257 and 696 for n = 50,304 (142 and 693 for 32,001 and 32,000); its two backward
products at 144-146 against 698-729. 0.20-0.21 throughout, so one factor for the forward and backward."""
TENSOR_CORE_DTYPES = frozenset({"tf32", "bf16", "fp16", "fp8"})
"""Dtypes whose GEMMs run on tensor cores (and so have the alignment rule); plain fp32 does not."""
REFERENCE_PEAK_FLOPS = 312e12
"""Peak used by op_efficiency when none is given (A100 BF16): f_half = 1.56e9 FLOPs."""
MEMORY_EFFICIENCY = 0.7
"""Fraction of HBM bandwidth (and of vector FLOP/s) a bandwidth-bound kernel achieves."""
ADAMW_KERNELS_PER_TENSOR = 8
"""Elementwise kernels ``torch.optim.AdamW`` (single-tensor path, weight decay on) runs per parameter."""

def matmul_half_flops(peak_flops: float) -> float:
    """FLOPs at which a GEMM reaches half its maximum efficiency on a device of ``peak_flops``."""
    return peak_flops * MATMUL_RAMP_S


def _matmul_efficiency(flops: float, peak_flops: float, plateau: float, matmul_plateau: float) -> float:
    return plateau * flops / (flops + matmul_half_flops(peak_flops))


def _attention_seconds(flops: float, peak_flops: float, plateau: float, matmul_plateau: float) -> float:
    """A fused attention kernel's seconds: a GEMM's ramp, ``f_half / (matmul_plateau * peak)``, then its
    FLOPs at the kernel's own ``plateau`` (the GEMM's seconds where ``plateau`` is the GEMM's)."""
    return flops / (plateau * peak_flops) + matmul_half_flops(peak_flops) / (matmul_plateau * peak_flops)


def _attention_efficiency(flops: float, peak_flops: float, plateau: float, matmul_plateau: float) -> float:
    if flops == 0:
        return 0.0
    return flops / (peak_flops * _attention_seconds(flops, peak_flops, plateau, matmul_plateau))


def _bandwidth_bound_efficiency(flops: float, peak_flops: float, plateau: float, matmul_plateau: float) -> float:
    return MEMORY_EFFICIENCY


@dataclass(frozen=True)
class _OpModel:
    """How one kind of op is priced: its efficiency curve and which FLOP peak it runs at."""

    efficiency: Callable[[float, float, float, float], float]  # (flops, peak FLOP/s, its plateau, the GEMMs')
    tensor_cores: bool


def _misaligned_matmul_efficiency(flops: float, peak_flops: float, plateau: float, matmul_plateau: float
                                  ) -> float:
    return MISALIGNED_MATMUL_FACTOR * _matmul_efficiency(flops, peak_flops, plateau, matmul_plateau)


_OPS: Mapping[str, _OpModel] = {
    "matmul": _OpModel(_matmul_efficiency, tensor_cores=True),
    "misaligned_matmul": _OpModel(_misaligned_matmul_efficiency, tensor_cores=True),
    "attention": _OpModel(_attention_efficiency, tensor_cores=True),
    "attention_backward": _OpModel(_attention_efficiency, tensor_cores=True),
    "elementwise": _OpModel(_bandwidth_bound_efficiency, tensor_cores=False),
    "other": _OpModel(_bandwidth_bound_efficiency, tensor_cores=False),
}
KINDS = tuple(_OPS)
ATTENTION_KINDS = ("attention", "attention_backward")


def op_efficiency(kind: str, flops: float, peak_flops: float = REFERENCE_PEAK_FLOPS,
                  matmul_plateau: float = MATMUL_MAX_EFFICIENCY,
                  attention_plateaus: tuple[float, float] | None = None) -> float:
    """Achievable fraction of peak for an op of ``kind`` doing ``flops`` on a device of ``peak_flops`` whose
    large GEMMs reach ``matmul_plateau`` of it (``DeviceSpec.matmul_efficiency``) and whose fused attention
    kernels reach ``attention_plateaus`` (forward, backward; ``DeviceSpec.attention_efficiency``, None:
    the GEMMs')."""
    _check_kind(kind)
    plateau = _plateau(kind, matmul_plateau, attention_plateaus)
    return _OPS[kind].efficiency(_non_negative("flops", flops), peak_flops, plateau, matmul_plateau)


def _plateau(kind: str, matmul_plateau: float, attention_plateaus: tuple[float, float] | None) -> float:
    """The efficiency a ``kind`` kernel tends to: fused attention's own (forward, backward) where given."""
    if kind in ATTENTION_KINDS and attention_plateaus is not None:
        return attention_plateaus[kind == "attention_backward"]
    return matmul_plateau


def matmul_kind(dims: Iterable[int], device: DeviceSpec, dtype: Any) -> str:
    """``"matmul"``, or ``"misaligned_matmul"`` for a GEMM whose matrix dimensions ``dims`` (of the
    local operands: m, k, n) are not all multiples of the device's tensor-core alignment in ``dtype``."""
    key = dtype_key(dtype)
    if not device.gemm_alignment_bytes or key not in TENSOR_CORE_DTYPES:
        return "matmul"
    elements = max(1, device.gemm_alignment_bytes // DTYPE_BYTES[key])
    return "matmul" if all(int(d) % elements == 0 for d in dims) else "misaligned_matmul"


def compute_time(flops: float, bytes_moved: float, device: DeviceSpec, dtype: Any,
                 kind: str = "matmul") -> float:
    """Seconds one op adds to a step: its kernel (roofline of FLOPs and HBM bytes, plus the launch
    floor; none for an op with neither) and its dispatch on the host."""
    _check_kind(kind)
    flops, bytes_moved = _non_negative("flops", flops), _non_negative("bytes_moved", bytes_moved)
    return dispatched_time(kernel_time(flops, bytes_moved, device, dtype, kind), device.host_op_s, device)


def kernel_time(flops: float, bytes_moved: float, device: DeviceSpec, dtype: Any, kind: str) -> float:
    """Seconds one kernel holds the device: roofline plus launch floor; 0 when there is no work to launch."""
    if flops == 0 and bytes_moved == 0:
        return 0.0
    memory_s = bytes_moved / (device.hbm_bw * MEMORY_EFFICIENCY)
    return max(_flop_time(flops, device, dtype, kind), memory_s) + device.kernel_launch_s


def dispatched_time(kernel_s: float, host_s: float, device: DeviceSpec) -> float:
    """Seconds an op adds to a step given its kernel's and its host dispatch's: their sum where the host
    runs the kernels itself (CPU), the longer of the two where it enqueues them ahead (CUDA)."""
    if device.host_runs_kernels:
        return kernel_s + host_s
    return max(kernel_s, host_s)


def adamw_bytes_per_element(param_dtype: Any, master_dtype: str = "fp32") -> int:
    """HBM bytes one AdamW update moves per parameter element (see the module doc): 28 in fp32 and in
    mixed precision (bf16 parameter and gradient, fp32 master copy and moments), 14 with bf16 masters
    (the bf16 parameter is its own master: it and both moments read and written, the gradient read)."""
    itemsize = DTYPE_BYTES[dtype_key(param_dtype)]
    copy = master_dtype_of(param_dtype, master_dtype) != dtype_key(param_dtype)
    parameter_passes = 1 if copy else 2  # the parameter is written (and, as its own master, read)
    return 2 * adamw_state_bytes(1, param_dtype, master_dtype) + itemsize + parameter_passes * itemsize


def adamw_step_time(shard_numels: Iterable[float], device: DeviceSpec, param_dtype: Any,
                    master_dtype: str = "fp32") -> float:
    """Seconds of one AdamW update of parameter shards of ``shard_numels`` elements each (one per tensor),
    its masters in ``master_dtype``."""
    per_element = adamw_bytes_per_element(param_dtype, master_dtype)
    total = 0.0
    for numel in shard_numels:
        kernel_bytes = _non_negative("numel", numel) * per_element / ADAMW_KERNELS_PER_TENSOR
        kernel = kernel_time(0.0, kernel_bytes, device, param_dtype, "elementwise")
        total += ADAMW_KERNELS_PER_TENSOR * dispatched_time(kernel, device.host_update_op_s, device)
    return total


def backward_kind(kind: str) -> str:
    """The kind a ``kind`` kernel's backward work is priced as: fused attention's backward kernel has a
    plateau of its own; a GEMM's backward products are GEMMs, an elementwise op's elementwise."""
    return "attention_backward" if kind == "attention" else kind


def _flop_time(flops: float, device: DeviceSpec, dtype: Any, kind: str) -> float:
    if flops == 0:
        return 0.0
    peak = device.peak(dtype) if _OPS[kind].tensor_cores else device.peak("fp32")
    if kind in ATTENTION_KINDS:  # its seconds as written, not through their quotient (the same to 1e-16)
        return _attention_seconds(flops, peak, _plateau(kind, device.matmul_efficiency, device.attention_efficiency),
                                  device.matmul_efficiency)
    return flops / (peak * op_efficiency(kind, flops, peak, device.matmul_efficiency))


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
