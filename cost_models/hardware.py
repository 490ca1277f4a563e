"""Hardware catalog: what one accelerator can do, as numbers the cost model prices with.

This module is for per-device facts (peak FLOP/s by dtype, HBM capacity and bandwidth, the
bandwidth a collective ring achieves over NVLink and over the network, latencies) and for
turning a dtype into the key those facts are stored under. It is not for topology (how many
devices, how they are grouped: see ``cluster.py``) nor for formulas (see ``comm.py``,
``compute.py``, ``memory.py``).

Sources for the presets:

* Peak dense FLOP/s, HBM capacity and bandwidth: NVIDIA A100 datasheet (SXM4 40GB/80GB), H100
  SXM5 datasheet, H200 SXM datasheet, as tabulated in ``shared/reference/published-runs.md``
  ("Hardware"). Datasheets print tensor-core TF32/FP16/BF16 "with sparsity"; the presets hold
  the dense halves. B200: NVIDIA HGX B200 (1,000 W) figures as tabulated at
  glennklockwood.com/garden/processors/B200 (dense BF16/FP16 2.25 PFLOP/s, TF32 1.1 PFLOP/s,
  FP32 80 TFLOP/s) and the DGX B200 datasheet (1,440 GB and 64 TB/s of HBM3e over 8 GPUs:
  180 GB and 8 TB/s per GPU).
* Achieved ring bus bandwidth (nccl-tests all_reduce busbw, published-runs.md): DGX A100 inside a
  node ~230 GB/s, H100 NVLink ring ~370 GB/s, one HDR NIC ~24 GB/s, one NDR NIC 46-48 GB/s.
* Latencies: NCCL ``src/graph/tuning.cc`` (ranges quoted in published-runs.md). NCCL switches to
  its low-latency LL protocol exactly where per-step latency matters (small messages), so the
  per-step latencies are the Ring/LL ones: 0.6 us per NVLink step, 2.7 us per network step;
  the fixed per-collective latency is the Ring/LL base latency, 6.6 us.

Capacities are what the driver reports a device has (``nvidia-smi``'s ``memory.total``, in MiB): H100 SXM
81,559, H200 143,771, B200 183,359, as printed on those machines in public logs (for example NVIDIA driver
570 on an HGX B200: "0MiB / 183359MiB"); A100 SXM4 81,920 (80GB) and 40,960 (40GB). The datasheets' "80 GB",
"141 GB" and "180 GB" are these figures in binary units: read as decimal (``80 * 10**9``), as this catalog
did before 2026-12-08, they left a device 7% less than it has, on top of ``memory.RESERVE_FRACTION``, and
refused a published configuration that ran (NeMo's Llama 3.1 405B in FP8 on 128 B200s, whose float8 weight
copies Transformer Engine holds through the step). A cluster string's ``mem=80GB`` stays decimal.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Iterator, Mapping

MATMUL_MAX_EFFICIENCY = 0.8
"""Fraction of dense tensor-core peak that a large GEMM achieves, where a device states no figure of its own
(``DeviceSpec.matmul_efficiency``): large cuBLAS GEMMs reach about 75-85% of dense peak on A100/H100."""

# --------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------

#: Canonical dtype keys and their size in bytes ("tf32" is fp32 storage on tensor cores).
DTYPE_BYTES: Mapping[str, int] = {
    "fp64": 8,
    "fp32": 4,
    "tf32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
}

#: Spellings accepted for each canonical key (torch dtype names without the ``torch.`` prefix).
_DTYPE_SPELLINGS: Mapping[str, str] = {
    "fp64": "fp64", "float64": "fp64", "double": "fp64",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "fp8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8",
}


def dtype_key(dtype: Any) -> str:
    """Canonical key ("fp32", "bf16", ...) of a ``torch.dtype`` or a string such as "bfloat16".

    Works without importing torch: a torch dtype prints as ``torch.<name>``.
    Raises ValueError for anything that is not a known floating-point dtype.
    """
    text = dtype if isinstance(dtype, str) else str(dtype)
    name = text.strip().lower().removeprefix("torch.")
    try:
        return _DTYPE_SPELLINGS[name]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unknown dtype {dtype!r}: expected a floating-point dtype, one of {known} "
                         "(or a torch.dtype / torch name such as 'bfloat16')") from None


# --------------------------------------------------------------------------------------------
# DeviceSpec
# --------------------------------------------------------------------------------------------


class _FrozenFlops(Mapping[str, float]):
    """Read-only, hashable dtype-key -> FLOP/s table, so that DeviceSpec stays truly frozen."""

    __slots__ = ("_items",)

    def __init__(self, table: Mapping[str, float]) -> None:
        self._items = dict(table)

    def __getitem__(self, key: str) -> float:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)

    def __getstate__(self) -> dict[str, float]:
        return self._items

    def __setstate__(self, state: dict[str, float]) -> None:
        self._items = dict(state)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator type. Bandwidths in bytes/s, times in seconds, FLOP/s dense."""

    name: str
    """Canonical name, e.g. "H100"."""
    peak_flops: Mapping[str, float] = field(repr=False)
    """Dense FLOP/s by dtype key: "fp32", "tf32", "bf16", "fp16", and "fp8" on parts with FP8 tensor cores
    (Hopper, Blackwell), the rate float8 linears run at (``autopar/ir/float8.py``)."""
    hbm_bytes: int
    """Memory capacity of one device."""
    hbm_bw: float
    """Memory bandwidth of one device, bytes/s."""
    nvlink_bw: float
    """Bus bandwidth an NCCL ring achieves inside a node, per device, one direction."""
    net_bw: float
    """Bus bandwidth per device across nodes (one NIC per device)."""
    intra_latency_s: float
    """Latency of one ring step inside a node."""
    inter_latency_s: float
    """Latency of one ring step across nodes."""
    base_latency_s: float
    """Fixed launch latency, paid once per collective."""
    kernel_launch_s: float
    """Floor paid by every kernel."""
    host_op_s: float = 0.0
    """Host seconds to dispatch one op through autopar's runtime (DTensor sharding propagation,
    autograd, Python), views and collectives included; ``compute.dispatched_time`` applies it."""
    host_update_op_s: float = 0.0
    """Host seconds to dispatch one op of the optimizer update, which runs outside autograd."""
    lowered_host_op_s: float | None = None
    """``host_op_s`` of the lowered runtime (``passes/lower.py``: the rank's program run as graphs of
    local tensor ops, no DTensor on the way), counted per op as ``host_op_s`` is; plans priced for that
    runtime charge it instead (``planning/pricing.Pricer``). None: as ``host_op_s`` (the presets, and
    profiles calibrated before it was measured)."""
    redistribute_s: float = 0.0
    """Seconds a collective run inside a training step (a DTensor redistribute) costs beyond the
    link's formula: DTensor's and autograd's wrapping of it and, where ranks share cores, the wait
    for the last rank to reach it. Charged once per critical-path collective (``autopar/planning/pricing.py``);
    measured by ``autopar calibrate`` on CPU, 0 on the presets (a GPU host enqueues it ahead)."""
    gemm_alignment_bytes: int = 0
    """A GEMM runs at full tensor-core speed only when each of its matrix dimensions spans a multiple
    of this many bytes (16 on NVIDIA GPUs: 8 bf16/fp16 elements, 4 tf32; 0: no such rule, as on CPU);
    ``compute.matmul_kind`` prices the others as ``misaligned_matmul``."""
    host_runs_kernels: bool = False
    """Whether the host's cores run the kernels too (CPU): then an op's dispatch and its kernel add up;
    otherwise (CUDA) the host enqueues kernels ahead of the device and an op takes the longer of the two."""
    matmul_efficiency: float = MATMUL_MAX_EFFICIENCY
    """Fraction of ``peak_flops`` a large GEMM reaches on this device (``compute.py``'s plateau of the
    GEMM efficiency curve)."""
    attention_efficiency: tuple[float, float] | None = None
    """(forward, backward) fraction of ``peak_flops`` fused attention kernels (flash attention) reach on
    this device at long sequences: the plateaus of ``compute.py``'s ``attention`` kind. None: priced as a
    GEMM (``matmul_efficiency`` both ways), where the catalog has no measured figure."""
    overlap_slowdown: float = 0.0
    """How much longer compute takes while a collective runs beside it (0.189: 18.9% longer), its kernels
    sharing the device's SMs and memory with the collective's (on a CPU, its cores): what overlapping
    communication with compute costs (``planning/pricing.OverlapSlack``). 0: compute loses nothing (the
    default of a device a file states whole; a calibrated profile keeps its base preset's, not measured)."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"device name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "peak_flops", _validated_flops(self.name, self.peak_flops))
        if not isinstance(self.hbm_bytes, int) or isinstance(self.hbm_bytes, bool) \
                or not 0 < self.hbm_bytes <= LARGEST_AMOUNT:
            raise ValueError(f"device {self.name}: hbm_bytes must be a positive int, at most {LARGEST_AMOUNT:.3g}, "
                             f"got {self.hbm_bytes!r}")
        for attr in ("hbm_bw", "nvlink_bw", "net_bw"):
            _require_positive(self.name, attr, getattr(self, attr), LARGEST_AMOUNT)
        for attr in ("intra_latency_s", "inter_latency_s", "base_latency_s", "kernel_launch_s", "host_op_s",
                     "host_update_op_s", "redistribute_s"):
            _require_non_negative(self.name, attr, getattr(self, attr))
        if self.lowered_host_op_s is not None:
            _require_non_negative(self.name, "lowered_host_op_s", self.lowered_host_op_s)
        if not isinstance(self.gemm_alignment_bytes, int) or isinstance(self.gemm_alignment_bytes, bool) \
                or self.gemm_alignment_bytes < 0:
            raise ValueError(f"device {self.name}: gemm_alignment_bytes must be a non-negative int, "
                             f"got {self.gemm_alignment_bytes!r}")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"device {self.name}: matmul_efficiency must be in (0, 1], got {self.matmul_efficiency!r}")
        if self.attention_efficiency is not None:
            object.__setattr__(self, "attention_efficiency", _efficiency_pair(self.name, self.attention_efficiency))
        if not _is_number(self.overlap_slowdown) or not 0 <= self.overlap_slowdown <= 1:
            raise ValueError(f"device {self.name}: overlap_slowdown must be in [0, 1], got {self.overlap_slowdown!r}")
        if not isinstance(self.host_runs_kernels, bool):
            raise ValueError(f"device {self.name}: host_runs_kernels must be true or false, "
                             f"got {self.host_runs_kernels!r}")

    def peak(self, dtype: Any) -> float:
        """Dense peak FLOP/s for ``dtype`` (torch.dtype or string); ValueError if not catalogued."""
        key = dtype_key(dtype)
        try:
            return self.peak_flops[key]
        except KeyError:
            known = ", ".join(self.peak_flops)
            raise ValueError(f"device {self.name} has no peak FLOP/s for dtype {key!r}; "
                             f"catalogued: {known}") from None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; ``DeviceSpec.from_dict`` reads it back."""
        out = asdict(self)
        out["peak_flops"] = dict(self.peak_flops)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DeviceSpec":
        """Build from a dict with every field of DeviceSpec (those with defaults may be left out, as in files
        written before they existed); unknown or missing keys raise ValueError."""
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        unknown = sorted(set(data) - names)
        missing = sorted(required - set(data))
        if unknown or missing:
            raise ValueError(f"bad device dict: unknown keys {unknown}, missing keys {missing}; "
                             f"expected exactly {sorted(names)}")
        values = dict(data)
        if isinstance(values["hbm_bytes"], float) and values["hbm_bytes"].is_integer():  # 8e10 in a file
            values["hbm_bytes"] = int(values["hbm_bytes"])
        return cls(**values)


def _efficiency_pair(name: str, value: Any) -> tuple[float, float]:
    """``attention_efficiency`` as a (forward, backward) tuple of fractions in (0, 1] (a file gives a list)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2 \
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1 for v in value):
        raise ValueError(f"device {name}: attention_efficiency must be [forward, backward], each in (0, 1], "
                         f"got {value!r}")
    return float(value[0]), float(value[1])


def _validated_flops(name: str, table: Mapping[str, float]) -> _FrozenFlops:
    if not isinstance(table, Mapping) or not table:
        raise ValueError(f"device {name}: peak_flops must be a non-empty mapping dtype -> FLOP/s, "
                         f"got {table!r}")
    for key, value in table.items():
        if key not in DTYPE_BYTES:
            raise ValueError(f"device {name}: peak_flops key {key!r} is not a canonical dtype key "
                             f"({', '.join(DTYPE_BYTES)})")
        _require_positive(name, f"peak_flops[{key!r}]", value)
    return _FrozenFlops(table)


SMALLEST_RATE = 1.0
"""The least bytes per second or FLOP/s (and bytes) a device or cluster may state: below it a figure is a
typo, and the seconds priced from it (1e160 s for a bandwidth of 1e-167 B/s) overflow what the ILP
solver can hold."""


LARGEST_AMOUNT = 2.0**53
"""The largest byte count or bytes per second a device or cluster may state (9 PB, 9 PB/s): beyond it a
figure is a typo, and a plan, which records the cluster, keeps numbers below 2**63."""
LONGEST_FIXED_S = 3600.0
"""The longest fixed time (a latency, a launch, a dispatch) a device may state: an hour is a typo, and the
step times priced from it stay far below what a plan holds."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_positive(name: str, attr: str, value: Any, largest: float = float("inf")) -> None:
    if not _is_number(value) or not SMALLEST_RATE <= value <= largest or value == float("inf"):
        raise ValueError(f"device {name}: {attr} must be a finite number of at least {SMALLEST_RATE:g}"
                         + (f" and at most {largest:.3g}" if largest < float("inf") else "") + f", got {value!r}")


def _require_non_negative(name: str, attr: str, value: Any) -> None:
    if not _is_number(value) or not 0 <= value <= LONGEST_FIXED_S:
        raise ValueError(f"device {name}: {attr} must be a non-negative number of seconds, at most "
                         f"{LONGEST_FIXED_S:g}, got {value!r}")


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------

GB = 10**9
GIB = 2**30
MIB = 2**20

# NCCL src/graph/tuning.cc, Ring/LL protocol (see module docstring).
NCCL_BASE_LATENCY_S = 6.6e-6
NVLINK_STEP_LATENCY_S = 0.6e-6
NET_STEP_LATENCY_S = 2.7e-6
# Per-kernel floor on a GPU: CUDA launch and tail, typically 2-5 us. The host's per-op dispatch
# (host_op_s) is left at 0: it runs ahead of the device and hides behind kernels longer than it.
GPU_KERNEL_LAUNCH_S = 4e-6

# Achieved bus bandwidth per device (nccl-tests, published-runs.md).
HDR_NIC_BW = 24e9   # 200 Gb/s HDR InfiniBand, one NIC per GPU (DGX A100)
NDR_NIC_BW = 46e9   # 400 Gb/s NDR InfiniBand / ConnectX-7, one NIC per GPU


# Compute beside a collective: Lee et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated
# Distributed Deep Learning: Performance and Power Implications", arXiv 2507.03114 (2025), measure GPT and
# Llama training's kernels on 4 A100s, H100s, MI250s and MI210s running beside their NCCL/RCCL
# collectives 18.9% slower on average (40.0% at most) than alone. The average stands for every NVIDIA
# preset (H200 and B200 unmeasured there).
GPU_OVERLAP_SLOWDOWN = 0.189

#: cuBLAS's tensor-core kernels need every matrix dimension to span a multiple of 16 bytes
#: (NVIDIA, "Matrix Multiplication Background User's Guide", Tensor Core Requirements).
TENSOR_CORE_ALIGNMENT_BYTES = 16


def _nvidia(name: str, *, fp32: float, tf32: float, bf16: float, hbm_bytes: int, hbm_bw: float,
            nvlink_bw: float, net_bw: float, matmul_efficiency: float = MATMUL_MAX_EFFICIENCY,
            attention_efficiency: tuple[float, float] | None = None, fp8: float | None = None) -> DeviceSpec:
    """An NVIDIA GPU preset: fp16 peak equals bf16 peak on every catalogued part; ``fp8`` where the part has
    FP8 tensor cores; NCCL latencies; compute slowed by overlapped collectives as measured on A100 and H100."""
    return DeviceSpec(
        name=name,
        peak_flops={"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": bf16, **({"fp8": fp8} if fp8 else {})},
        hbm_bytes=hbm_bytes, hbm_bw=hbm_bw, nvlink_bw=nvlink_bw, net_bw=net_bw,
        intra_latency_s=NVLINK_STEP_LATENCY_S, inter_latency_s=NET_STEP_LATENCY_S,
        base_latency_s=NCCL_BASE_LATENCY_S, kernel_launch_s=GPU_KERNEL_LAUNCH_S,
        gemm_alignment_bytes=TENSOR_CORE_ALIGNMENT_BYTES, matmul_efficiency=matmul_efficiency,
        attention_efficiency=attention_efficiency, overlap_slowdown=GPU_OVERLAP_SLOWDOWN,
    )


A100_40GB = _nvidia("A100-40GB", fp32=19.5e12, tf32=156e12, bf16=312e12,
                    hbm_bytes=40960 * MIB, hbm_bw=1555e9, nvlink_bw=230e9, net_bw=HDR_NIC_BW)
A100_80GB = _nvidia("A100-80GB", fp32=19.5e12, tf32=156e12, bf16=312e12,
                    hbm_bytes=81920 * MIB, hbm_bw=2039e9, nvlink_bw=230e9, net_bw=HDR_NIC_BW)
# Hopper's fused attention runs below its GEMMs: FlashAttention-3 (Shah et al., "FlashAttention-3", arXiv
# 2407.08608, 2024; H100 SXM5, bf16, head dim 128) reaches 590-621 TFLOP/s forward at 4k-16k tokens
# (pytorch/benchmark PR #2391's run of it: 590, 614, 621) and 542-561 backward, cuDNN's kernels 499-518
# backward (the paper's Figure 6 at 4k-16k), against 989 dense: 0.61 forward, 0.53 backward (FA3 and
# cuDNN, which NeMo and Megatron-Core run through Transformer Engine). FlashAttention-2 reaches only
# 0.35 there (the same paper).
HOPPER_ATTENTION_EFFICIENCY = (0.61, 0.53)
# FP8 tensor cores run twice the 16-bit rate on Hopper and Blackwell: H100 SXM5 and H200 1,979 dense TFLOP/s
# FP8 against 989 BF16 (NVIDIA H100 and H200 datasheets, "FP8 Tensor Core 3,958 teraFLOPS" with sparsity),
# B200 4.5 dense PFLOP/s (NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training for 8 GPUs, with sparsity).
# A100 has none: a float8 plan for it is refused.
H100 = _nvidia("H100", fp32=67e12, tf32=494.5e12, bf16=989e12, fp8=1979e12,
               hbm_bytes=81559 * MIB, hbm_bw=3350e9, nvlink_bw=370e9, net_bw=NDR_NIC_BW,
               attention_efficiency=HOPPER_ATTENTION_EFFICIENCY)
# H200: H100 silicon with more and faster HBM3e; same NVLink 4, so the H100 ring figure is assumed.
H200 = _nvidia("H200", fp32=67e12, tf32=494.5e12, bf16=989e12, fp8=1979e12,
               hbm_bytes=143771 * MIB, hbm_bw=4800e9, nvlink_bw=370e9, net_bw=NDR_NIC_BW,
               attention_efficiency=HOPPER_ATTENTION_EFFICIENCY)
# B200: NVLink 5 doubles H100's per-GPU NVLink (1.8 vs 0.9 TB/s both directions); with no published
# nccl-tests figure at hand the ring bandwidth is assumed to double too (2 x 370 GB/s). DGX B200
# has one 400 Gb/s ConnectX-7 per GPU. Its large bf16 GEMMs reach 0.63-0.65 of the 2.25 PFLOP/s peak, not
# the 0.8 of A100/H100: torch.matmul on a B200 (pytorch/ao PR #2427, benchmarks/float8/bench_matmul.py
# output, 2025-06-23) ran 4096^3 at 1.41 PFLOP/s (0.627 of peak), 6144^3 at 1.45 (0.646), 8192^3 at
# 1.42 (0.631); 8192^3 (1.1e12 FLOPs, 99% up the ramp of compute.py) gives the plateau, 0.631 / 0.99.
B200_MATMUL_EFFICIENCY = 0.64
B200 = _nvidia("B200", fp32=80e12, tf32=1100e12, bf16=2250e12, fp8=4500e12,
               hbm_bytes=183359 * MIB, hbm_bw=8000e9, nvlink_bw=740e9, net_bw=NDR_NIC_BW,
               matmul_efficiency=B200_MATMUL_EFFICIENCY)

# Placeholder CPU "device" for gloo runs; `autopar calibrate` measures the real figures of a machine.
# Roughly: a few cores of fp32 GEMM (~100 GFLOP/s), DRAM ~20 GB/s, gloo over shared memory
# ~5 GB/s with ~50 us per step, 10 GbE (1.25 GB/s) between hosts. The host runs the kernels; its
# per-op dispatch cost is left unpriced here (host_op_s 0) and measured by calibration. Its float8 matmuls
# (``torch._scaled_mm`` on the CPU, for gloo tests) are emulated in wider arithmetic: the bf16 figure. A
# collective beside compute runs on the same cores (gloo's threads copy and add): on two cores, compute
# beside it runs at half speed (overlap_slowdown 1.0).
CPU = DeviceSpec(
    name="cpu",
    peak_flops={"fp32": 100e9, "tf32": 100e9, "bf16": 50e9, "fp16": 50e9, "fp8": 50e9},
    hbm_bytes=16 * GIB, hbm_bw=20e9, nvlink_bw=5e9, net_bw=1.25e9,
    intra_latency_s=50e-6, inter_latency_s=100e-6, base_latency_s=20e-6, kernel_launch_s=10e-6,
    host_runs_kernels=True, overlap_slowdown=1.0,
)

#: Presets by canonical name.
DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (A100_40GB, A100_80GB, H100, H200, B200, CPU)}

#: Other accepted names -> canonical name.
ALIASES: dict[str, str] = {
    "A100": "A100-80GB",
    "A100-SXM": "A100-80GB",
    "H100-SXM": "H100",
    "H100-80GB": "H100",
    "H200-SXM": "H200",
    "H200-141GB": "H200",
}

#: Substring of ``torch.cuda.get_device_name()`` -> preset, first match wins (as autopar/api.py's table).
CUDA_NAME_PRESETS: tuple[tuple[str, str], ...] = (
    ("H200", "H200"), ("H100", "H100"), ("A100-SXM4-40GB", "A100-40GB"), ("A100", "A100-80GB"), ("B200", "B200"),
)


def preset_for_cuda_name(cuda_name: str, default: str = "H100") -> str:
    """The preset a CUDA device called ``cuda_name`` (e.g. "NVIDIA H100 80GB HBM3") is closest to."""
    return next((preset for key, preset in CUDA_NAME_PRESETS if key in cuda_name), default)


def get_device(name: str) -> DeviceSpec:
    """The preset called ``name`` (case-insensitive, aliases resolved); ValueError if unknown.

    Looks DEVICES and ALIASES up on every call, so presets registered later (calibration) count.
    """
    by_lower = {key.lower(): key for key in DEVICES}
    by_lower.update({alias.lower(): target for alias, target in ALIASES.items()})
    try:
        return DEVICES[by_lower[name.strip().lower()]]
    except (KeyError, AttributeError):
        known = ", ".join(sorted(DEVICES) + sorted(ALIASES))
        raise ValueError(f"unknown device type {name!r}: expected one of {known}") from None
