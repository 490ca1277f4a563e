"""Calibration: measure the machine this process runs on and write a cluster profile for ``--cluster``.

This module is for turning timings taken on real hardware into the numbers the cost model prices
with (a ``DeviceSpec`` and a cluster file). It is not for pricing (``compute.py``, ``comm.py``) nor
for launching processes (``autopar calibrate`` in ``autopar/cli.py`` spawns or joins the ranks and
calls ``measure_rank`` on each).

What is measured, on every rank at once (ranks share the host or the node, as in training):

* **matmul**: seconds of ``a @ b`` for a few square and rectangular shapes, per dtype available on
  the device (fp32 and bf16 on CPU; fp32, tf32, bf16, fp16 on CUDA), and of ``torch._scaled_mm`` on e4m3
  operands into bf16 (``fp8``: what a float8 plan's linears run, ``passes/float8.py``) where the device runs
  it (CUDA from compute capability 8.9, Ada and Hopper on; the CPU, which emulates it);
* **memory**: seconds of ``torch.add(a, b, out=c)`` on tensors larger than the caches (3 tensors
  moved per call);
* **op floor**: the time one small op holds the device: a tiny kernel's launch-to-launch time on a
  plain tensor (many queued, one synchronize on CUDA);
* **host dispatch**: the host time one op spends in autopar's runtime (DTensor's sharding
  propagation, autograd, Python). It comes from a small GPT-2 block (layer_norms, linears with
  biases, attention with its head views, GELU MLP, residuals) run as DTensors on the job's mesh,
  forward and backward, on tensors too small for FLOPs to matter; and, outside autograd, from
  ``torch.optim.AdamW``'s update of that block's weights. On CPU the host *is* the device, so this
  adds to every op, views included; on CUDA the host enqueues ahead of the device and an op costs the
  longer of its kernel and its dispatch, which is what makes a small model's step host-bound
  (``benchmarks/device_step.py``: GPT-2 small under autopar's runtime, 3x the eager step on an H200);
* **redistribute** (CPU only): what one collective run by DTensor inside a step adds to it: the same
  block's forward and backward with its output all-gathered (``Shard(0) -> Replicate``), less the
  block alone (the median difference of alternating repeats of the two). Besides the gloo
  collective this holds DTensor's and autograd's wrapping of it and, when ranks outnumber cores,
  the wait for the last rank to be scheduled and reach it, which a collective timed in a tight
  loop (all ranks already waiting in it) does not show;
* **collectives** (world > 1): seconds of all_reduce, all_gather and reduce_scatter by message
  size, on the ranks of one node and, across nodes, on one rank per node.

Every sample is the fastest of several timed repeats (slower ones measure other processes, not the
machine), except the redistribute's marginal time (a median of paired differences, see
``_fastest_and_marginal``); across ranks the slowest rank's figure is kept, since a synchronous
step runs at the slowest rank's pace.

How the numbers become profile fields (``build_profile``):

* ``peak_flops[dtype] = rate / matmul_efficiency`` (the base preset's ``DeviceSpec.matmul_efficiency``,
  which the profile inherits), where ``rate`` is the slope of the least squares line
  ``seconds = a + flops / rate`` over that dtype's matmuls: ``compute.py`` runs a large GEMM at
  ``matmul_efficiency * peak``, so large GEMMs are priced at the measured rate.
* ``hbm_bw = rate / MEMORY_EFFICIENCY`` from ``seconds = a + bytes / rate`` over the adds, for
  the same reason (``compute.py`` runs bandwidth-bound kernels at ``MEMORY_EFFICIENCY * hbm_bw``).
* ``kernel_launch_s``: the op floor.
* ``host_op_s``: the block's forward+backward time, less (on CPU) its kernel floors (3 per non-view
  op, 1 per gradient accumulation; on CUDA they overlap the host), divided by the dispatches the
  pricer counts for it: 3 per op it ran forward, views included (one forward and two backward,
  ``autopar/planning/pricing.py``: backward = 2x forward), and 1 per leaf whose gradient autograd accumulates
  (``Pricer.gradient_accumulation``). ``compute.dispatched_time`` adds it to each op's kernel (CPU)
  or takes the longer of the two (CUDA).
* ``lowered_host_op_s``: ``host_op_s`` of the same block run as the lowered runtime runs a plan (its
  forward and backward traced once by AOT autograd into graphs of local tensor ops), counted the same
  way; plans priced for that runtime charge it (``planning/pricing.dispatched_by``).
* ``host_update_op_s``: AdamW's update time divided by its kernels (``ADAMW_KERNELS_PER_TENSOR``
  per weight), less the op floor on CPU: what ``compute.adamw_step_time`` charges per kernel
  besides bytes.
* ``nvlink_bw``, ``intra_latency_s``, ``base_latency_s`` (and ``net_bw``, ``inter_latency_s``
  across nodes): one non-negative least-squares fit per link, in relative error, of
  ``seconds = base + ring_steps(kind, p) * step_latency + collective_bytes_per_rank(kind, n, p) / bw``
  over all kinds and sizes, i.e. ``comm.py``'s flat-ring formula with its own helpers; fields the
  run could not measure (the network on one node) keep the base preset's values.
* ``redistribute_s`` (CPU): the redistribute's marginal time less what that formula gives its
  all_gather on the fitted link (the intra-node one, or across nodes when there is one rank per
  node); ``autopar/planning/pricing.py`` adds it to every collective on a step's critical path.
* ``hbm_bytes``: the device's memory (on CPU, the host's RAM divided among the node's ranks).

The profile is a cluster file (``cluster.py``): ``nodes``, ``devices_per_node``, a ``device`` with
``"base": preset`` and the measured fields, plus ``source`` (``autopar calibrate <date> on
<host>``) and ``measured`` (every raw sample and fit), which the loader keeps as metadata.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from itertools import combinations
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch._functorch.aot_autograd import aot_function
from torch._functorch.compilers import nop
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from .comm import collective_bytes_per_rank, ring_steps
from .compute import ADAMW_KERNELS_PER_TENSOR, MEMORY_EFFICIENCY
from .hardware import DTYPE_BYTES, get_device, preset_for_cuda_name

MEASURED_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
PRICED_OPS_PER_FORWARD_OP = 3
"""Forward + backward priced as 3 forwards, views included (autopar/planning/pricing.py: backward = 2x forward)."""


# --------------------------------------------------------------------------------------------
# Plans of what to measure
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Shapes and sizes one calibration run measures."""
    matmuls: tuple[tuple[int, int, int], ...]
    """(m, n, k) of ``[m, k] @ [k, n]``."""
    add_elements: tuple[int, ...]
    """Elements of each fp32 tensor of ``c = a + b``."""
    message_bytes: tuple[int, ...]
    """Full-tensor bytes of each collective (comm.py's convention)."""
    min_repeat_s: float
    """Each timed repeat runs the op enough times to last at least this long."""
    repeats: int


def sizes_for(device_type: str, quick: bool) -> Sizes:
    """What to measure on ``device_type`` ("cpu" or "cuda"); ``quick`` for tests (seconds, not minutes)."""
    if device_type == "cuda":
        if quick:
            return Sizes(((1024, 1024, 1024), (4096, 4096, 4096)), (1 << 24, 1 << 26), (1 << 16, 1 << 22),
                         min_repeat_s=0.005, repeats=3)
        return Sizes(((512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
                      (8192, 8192, 8192), (16384, 1024, 4096)),
                     (1 << 24, 1 << 26, 1 << 28), tuple(1 << s for s in range(12, 29, 2)),
                     min_repeat_s=0.02, repeats=5)
    if quick:
        return Sizes(((128, 128, 128), (256, 256, 256)), (1 << 20, 1 << 22), (1 << 12, 1 << 16, 1 << 20),
                     min_repeat_s=0.005, repeats=3)
    return Sizes(((64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024),
                  (2048, 256, 512)),
                 (1 << 20, 1 << 22, 1 << 24), tuple(1 << s for s in range(10, 25, 2)),
                 min_repeat_s=0.05, repeats=5)


def dtypes_for(device: Any) -> tuple[str, ...]:
    """Canonical dtype keys whose matmul rate is measured on ``device``: ``fp8`` where it runs float8 matmuls
    (``runs_float8_matmuls``)."""
    keys = ("fp32", "tf32", "bf16", "fp16") if device.type == "cuda" else ("fp32", "bf16")
    return keys + (("fp8",) if runs_float8_matmuls(device) else ())


FP8_CAPABILITY = (8, 9)
"""The CUDA compute capability from which ``torch._scaled_mm`` runs float8 (Ada, Hopper and later)."""


def runs_float8_matmuls(device: Any) -> bool:
    """Whether ``torch._scaled_mm`` multiplies float8 on ``device``: the CPU (emulated), or a CUDA GPU of
    ``FP8_CAPABILITY`` or later."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------


def nonnegative_least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """``x >= 0`` minimizing ``|rows @ x - targets|``, exactly, by trying every set of free columns.

    For the two or three unknowns of a calibration fit that is at most 7 small solves.
    """
    width = len(rows[0])
    best: tuple[float, list[float]] | None = None
    for count in range(width, 0, -1):
        for free in combinations(range(width), count):
            solution = _least_squares([[row[i] for i in free] for row in rows], targets)
            if solution is None or min(solution) < 0:
                continue
            x = [0.0] * width
            for i, value in zip(free, solution):
                x[i] = value
            residual = sum((sum(r * v for r, v in zip(row, x)) - t) ** 2 for row, t in zip(rows, targets))
            if best is None or residual < best[0]:
                best = (residual, x)
    return best[1] if best is not None else [0.0] * width


def _least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float] | None:
    """Ordinary least squares through the normal equations, columns scaled to unit norm first."""
    width = len(rows[0])
    scale = [max(sum(row[i] ** 2 for row in rows) ** 0.5, 1e-300) for i in range(width)]
    scaled = [[row[i] / scale[i] for i in range(width)] for row in rows]
    gram = [[sum(r[i] * r[j] for r in scaled) for j in range(width)] for i in range(width)]
    moment = [sum(r[i] * t for r, t in zip(scaled, targets)) for i in range(width)]
    solution = _solve(gram, moment)
    return None if solution is None else [s / c for s, c in zip(solution, scale)]


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when the matrix is (nearly) singular."""
    n = len(vector)
    a = [row[:] + [v] for row, v in zip(matrix, vector)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


@dataclass(frozen=True)
class RateFit:
    """``seconds = intercept_s + work / rate``: a fixed cost plus work at a steady rate."""
    intercept_s: float
    rate: float


def fit_rate(work: Sequence[float], seconds: Sequence[float]) -> RateFit:
    """Least-squares (non-negative) intercept and rate of ``seconds`` against ``work`` (FLOPs or bytes).
    Timings of one size alone cannot tell a fixed cost from a rate: they give the rate through the
    origin (no intercept) rather than a fit that puts all the time in the intercept. Timings that do not
    grow with the work (a small size on another kernel path, or a disturbed repeat) give the largest size's
    rate through the origin, with a warning: a rate the device reached, where the fit has none."""
    if len(work) != len(seconds) or not work:
        raise ValueError(f"fit_rate needs as many timings as work sizes (at least one), got "
                         f"{len(work)} and {len(seconds)}")
    if len(set(work)) == 1 and sum(seconds) > 0:
        return RateFit(intercept_s=0.0, rate=work[0] * len(seconds) / sum(seconds))
    intercept, inverse_rate = nonnegative_least_squares([[1.0, float(w)] for w in work], seconds)
    if inverse_rate <= 0:
        largest = max(range(len(work)), key=lambda i: work[i])
        warnings.warn(f"autopar calibrate: timings {list(seconds)} do not grow with work {list(work)}; the largest "
                      "size's rate is used (measure larger sizes for a fit)", stacklevel=2)
        return RateFit(intercept_s=0.0, rate=work[largest] / seconds[largest])
    return RateFit(intercept_s=intercept, rate=1.0 / inverse_rate)


@dataclass(frozen=True)
class CollectiveSample:
    """One measured collective: ``kind`` of ``nbytes`` (full-tensor size) on ``ranks`` ranks."""
    kind: str
    nbytes: int
    ranks: int
    seconds: float


@dataclass(frozen=True)
class LinkFit:
    """A link's parameters in ``comm.py``'s terms: fixed latency, per-ring-step latency, bandwidth."""
    base_latency_s: float
    step_latency_s: float
    bw: float

    def seconds(self, kind: str, nbytes: float, ranks: int) -> float:
        """The fitted formula's time for one collective."""
        one, steps, ring_bytes = _link_terms(kind, nbytes, ranks)
        return one * self.base_latency_s + steps * self.step_latency_s + ring_bytes / self.bw


def _link_terms(kind: str, nbytes: float, ranks: int) -> list[float]:
    """The formula's terms, multiplying (base latency, per-step latency, 1 / bandwidth)."""
    return [1.0, float(ring_steps(kind, ranks)), collective_bytes_per_rank(kind, nbytes, ranks)]


def fit_link(samples: Sequence[CollectiveSample]) -> LinkFit:
    """Fit ``base + ring_steps * step_latency + ring_bytes / bw`` to collective timings.

    ``ring_steps`` and the ring bytes (``collective_bytes_per_rank``) are comm.py's, so a link
    priced with the fit reproduces the timings as closely as the flat-ring model allows. Base and
    per-step latency are told apart by kinds (or group sizes) with different step counts.

    The fit minimizes *relative* error (each sample's row and target divided by its seconds): the
    timings span four orders of magnitude, and an absolute fit, ruled by the largest messages, can
    leave a small collective (what a step's redistributes send) priced at several times its time.
    """
    if not samples:
        raise ValueError("fit_link needs at least one collective timing")
    if min(s.seconds for s in samples) <= 0:
        raise ValueError("fit_link needs positive collective timings")
    rows = [_link_terms(s.kind, s.nbytes, s.ranks) for s in samples]
    relative = [[value / s.seconds for value in row] for row, s in zip(rows, samples)]
    base, step, inverse_bw = nonnegative_least_squares(relative, [1.0] * len(samples))
    if inverse_bw > 0:
        return LinkFit(base_latency_s=base, step_latency_s=step, bw=1.0 / inverse_bw)
    # Latency-bound at every measured size (small messages, noisy timings): the link moved each
    # sample's bytes at least this fast, so take the fastest observed rate and fit latencies to the rest.
    bw = max(row[2] / s.seconds for row, s in zip(rows, samples) if s.seconds > 0)
    rest = [max(0.0, s.seconds - row[2] / bw) for row, s in zip(rows, samples)]
    base, step = nonnegative_least_squares([row[:2] for row in rows], rest)
    return LinkFit(base_latency_s=base, step_latency_s=step, bw=bw)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def _seconds_per_call(fn: Callable[[], Any], sync: Callable[[], None], sizes: Sizes,
                      agree: Callable[[int], int] = lambda calls: calls) -> float:
    """Fastest of ``sizes.repeats`` repeats of the mean time of ``fn``, each repeat >= min_repeat_s.

    The fastest, as Python's ``timeit`` documentation advises: slower repeats are other processes
    interfering, not the machine's speed (https://docs.python.org/3/library/timeit.html, ``repeat``).

    ``agree`` turns this rank's call count into the one every rank of a collective uses (they must
    all issue the same number of collectives).
    """
    calls = _calls_per_repeat(fn, sync, sizes, agree)
    return min(_timed_repeat(fn, sync, calls) for _ in range(sizes.repeats))


def _fastest_and_marginal(base: Callable[[], Any], extended: Callable[[], Any], sizes: Sizes,
                          agree: Callable[[int], int], align: Callable[[], None]) -> tuple[float, float]:
    """(``base``'s fastest repeat, the median over paired repeats of ``extended``'s time less ``base``'s).

    The two run in alternating repeats, so each difference is taken under the same load; its median
    keeps one repeat disturbed by another process from moving the marginal time (a difference of
    two separately taken fastest repeats can be off by the whole disturbance). ``align`` (a barrier)
    starts every repeat on all ranks together: otherwise a rank that ran ahead in ``base``, which has
    no collective, would charge its wait for the others to ``extended``'s first collective."""
    no_sync = lambda: None  # noqa: E731 (host-bound: nothing queued to wait for)
    calls = {fn: _calls_per_repeat(fn, no_sync, sizes, agree) for fn in (base, extended)}

    def repeat(fn: Callable[[], Any]) -> float:
        align()
        return _timed_repeat(fn, no_sync, calls[fn])

    pairs = [(repeat(base), repeat(extended)) for _ in range(sizes.repeats)]
    return min(a for a, _ in pairs), statistics.median(b - a for a, b in pairs)


def _calls_per_repeat(fn: Callable[[], Any], sync: Callable[[], None], sizes: Sizes,
                      agree: Callable[[int], int]) -> int:
    """Calls of ``fn`` that last at least ``sizes.min_repeat_s`` (after one warm-up call), agreed by ``agree``."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    single = max(time.perf_counter() - start, 1e-7)
    return agree(max(1, int(sizes.min_repeat_s / single)))


def _timed_repeat(fn: Callable[[], Any], sync: Callable[[], None], calls: int) -> float:
    """Mean seconds per call of ``calls`` back-to-back calls of ``fn``."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls


def _most_calls_in(group: Any) -> Callable[[int], int]:
    """``agree`` for ``_seconds_per_call``: the largest call count of any rank of ``group``."""

    def agree(calls: int) -> int:
        count = torch.tensor([calls], dtype=torch.float64, device=_rank_device(dist.get_backend(group)))
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        return int(count.item())

    return agree


def _synchronizer(device: Any) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _torch_dtype(key: str) -> Any:
    return {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[key]


def measure_matmuls(device: Any, sizes: Sizes) -> list[dict[str, Any]]:
    """Seconds of each (m, n, k) matmul for each dtype of the device."""
    sync = _synchronizer(device)
    samples = []
    for key in dtypes_for(device):
        previous_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
        try:
            for m, n, k in sizes.matmuls:
                seconds = _seconds_per_call(_matmul(key, m, n, k, device), sync, sizes)
                samples.append({"dtype": key, "m": m, "n": n, "k": k, "flops": 2 * m * n * k, "seconds": seconds})
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    return samples


def _matmul(key: str, m: int, n: int, k: int, device: Any) -> Callable[[], Any]:
    """One ``[m, k] @ [k, n]`` in dtype ``key``; ``fp8``: ``torch._scaled_mm`` of e4m3 operands (the second
    column-major, as CUDA's kernel needs it) into bf16, with unit scales."""
    if key != "fp8":
        a = torch.randn(m, k, device=device, dtype=_torch_dtype(key))
        b = torch.randn(k, n, device=device, dtype=_torch_dtype(key))
        return lambda: a @ b
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def measure_memory(device: Any, sizes: Sizes) -> list[dict[str, Any]]:
    """Seconds of ``c = a + b`` (fp32), which reads two tensors and writes one."""
    sync = _synchronizer(device)
    samples = []
    for elements in sizes.add_elements:
        a, b, c = (torch.randn(elements, device=device) for _ in range(3))
        seconds = _seconds_per_call(lambda: torch.add(a, b, out=c), sync, sizes)
        samples.append({"elements": elements, "bytes": 3 * elements * DTYPE_BYTES["fp32"], "seconds": seconds})
    return samples


def measure_op_floor(device: Any, sizes: Sizes) -> dict[str, Any]:
    """Seconds one small op holds the device and, on CPU, the host's dispatch of one op (module doc)."""
    x = torch.zeros(1, device=device)
    floor = _seconds_per_call(lambda: x.add_(1), _synchronizer(device), sizes)
    kernel = {"method": f"tiny {device.type.upper()} kernels on a plain tensor, back to back",
              "seconds_per_op": floor, "kernel_launch_s": floor}
    return {**kernel, **_dtensor_dispatch(device, sizes, floor)}


def _dtensor_dispatch(device: Any, sizes: Sizes, kernel_launch_s: float) -> dict[str, Any]:
    """Host seconds per op dispatched through DTensor: a small transformer block, forward and backward;
    and per op of the same block as the lowered runtime runs it (``_lowered_block``).

    The pricer charges every op of a graph, views included, one dispatch forward and two backward, and
    a non-view op also its kernel floor (3 times); so the block's time less those floors, divided by
    3 per op it dispatches forward (counted by dispatch), is the dispatch the pricer must charge.
    AdamW's update of the block's weights, per kernel less its floor, is the dispatch of an op run
    outside autograd (``compute.adamw_step_time``). The block with its output all-gathered by DTensor,
    less the block, is what one redistribute adds to a step (``redistribute_overhead_s``).

    On CUDA the block's kernels are queued behind the host, which is the bound at this size: its time
    per dispatch is the host's, with no floors to take out (they overlap it), and ``dispatched_time``
    prices an op as the longer of its kernel and its dispatch. The redistribute is not measured there:
    NCCL runs asynchronously to the host, so the bare link formula stands (``redistribute_s`` 0).
    """
    world = dist.get_world_size()
    cuda = device.type == "cuda"
    mesh = init_device_mesh(device.type, (world,))
    with torch.device(device):
        x = distribute_tensor(torch.randn(2 * world, _BLOCK_SEQ, _BLOCK_WIDTH), mesh, [Shard(0)]).requires_grad_()
        weights = {name: distribute_tensor(torch.randn(_BLOCK_WIDTH, _BLOCK_WIDTH) / _BLOCK_WIDTH, mesh,
                                           [Replicate()]).requires_grad_()
                   for name in ("q", "k", "v", "o", "up", "down")}
        weights.update({name: distribute_tensor(torch.zeros(_BLOCK_WIDTH), mesh, [Replicate()]).requires_grad_()
                        for name in ("bias", "norm_bias")})
        weights["norm_weight"] = distribute_tensor(torch.ones(_BLOCK_WIDTH), mesh, [Replicate()]).requires_grad_()
    sync = _synchronizer(device)

    def forward() -> Any:
        return _transformer_block(x, weights)

    def forward_backward() -> None:
        forward().sum().backward()

    def forward_backward_gathered() -> None:  # the same step with one redistribute: all_gather of the output
        forward().redistribute(mesh, [Replicate()]).sum().backward()

    counter = _DispatchCounter()
    with counter:
        forward()
    agree = _most_calls_in(None)
    forward_s = _seconds_per_call(forward, sync, sizes, agree)
    lowered_s = _seconds_per_call(_lowered_block(x, weights), sync, sizes, agree)
    if cuda:
        forward_backward_s = _seconds_per_call(forward_backward, sync, sizes, agree)
    else:
        forward_backward_s, redistribute_s = _fastest_and_marginal(forward_backward, forward_backward_gathered,
                                                                   sizes, agree, align=dist.barrier)
    for w in weights.values():  # replicated gradients, as the runtime's sync leaves them (not Partial)
        w.grad = torch.ones_like(w)
    optimizer = torch.optim.AdamW(list(weights.values()), foreach=False)  # the per-tensor kernels priced
    update_s = _seconds_per_call(optimizer.step, sync, sizes, agree)
    update_ops = ADAMW_KERNELS_PER_TENSOR * len(weights)
    dispatched = counter.ops + counter.views
    leaves = 1 + len(weights)  # x and the weights: autograd accumulates each one's gradient
    floor = 0.0 if cuda else kernel_launch_s  # on CUDA the kernels overlap the host's dispatch
    measured = {"dispatch_method": "a GPT-2 block (width 16) as DTensors on the world mesh, forward and backward, "
                                   "per op dispatched forward (views included)",
                "priced_ops": counter.ops, "views": counter.views, "leaves": leaves,
                "forward_s": forward_s / dispatched,
                "forward_backward_s": forward_backward_s / dispatched,
                "host_op_s": host_dispatch_s(forward_backward_s, counter.ops, counter.views, leaves, floor),
                "lowered_method": "the same block traced once by AOT autograd into forward and backward graphs "
                                  "over the rank's local tensors (as passes/lower.py runs a plan), "
                                  "per op dispatched",
                "lowered_forward_backward_s": lowered_s / dispatched,
                "lowered_host_op_s": host_dispatch_s(lowered_s, counter.ops, counter.views, leaves, floor),
                "update_method": "torch.optim.AdamW.step over the block's weights, per elementwise kernel",
                "update_s": update_s / update_ops,
                "host_update_op_s": max(0.0, update_s / update_ops - floor)}
    if cuda:
        return measured
    return {**measured,
            "redistribute_method": "the same forward and backward with the block's output all-gathered "
                                   "(Shard(0) -> Replicate) by DTensor, less the block alone",
            "redistribute": {"kind": "all_gather", "nbytes": x.numel() * DTYPE_BYTES["fp32"], "ranks": world,
                             "seconds": max(0.0, redistribute_s)}}


def _lowered_block(x: Any, weights: Mapping[str, Any]) -> Callable[[], None]:
    """The block's forward and backward as the lowered runtime runs a rank's program: graphs of local
    tensor ops traced once by AOT autograd (``aot_function``, graphs run as traced: no compiler), over
    each DTensor's local shard."""
    local = {name: w.to_local().detach().requires_grad_() for name, w in weights.items()}
    h = x.to_local().detach().requires_grad_()
    program = aot_function(_transformer_block, fw_compiler=nop, bw_compiler=nop)

    def forward_backward() -> None:
        program(h, local).sum().backward()

    return forward_backward


def host_dispatch_s(forward_backward_s: float, ops: int, views: int, leaves: int, kernel_launch_s: float) -> float:
    """``host_op_s`` from a graph's forward+backward seconds, the non-view ops and views it dispatches
    forward and the leaves whose gradients it accumulates (each an add, a kernel: the graph runs
    again and again without clearing them): its time less the kernel floors, per dispatch as the
    pricer counts them (3 per op, 1 per accumulation)."""
    floors = (PRICED_OPS_PER_FORWARD_OP * ops + leaves) * kernel_launch_s
    return max(0.0, forward_backward_s - floors) / ((ops + views) * PRICED_OPS_PER_FORWARD_OP + leaves)


_BLOCK_WIDTH, _BLOCK_HEADS, _BLOCK_SEQ = 16, 2, 4
"""A transformer block small enough that its FLOPs are negligible next to the per-op dispatch."""


def _transformer_block(h: Any, w: Mapping[str, Any]) -> Any:
    """GPT-2 block: pre-LN attention (heads split by views, softmax(q k^T) v) and GELU MLP, with biases."""
    batch, seq, width = h.shape

    def norm(t: Any) -> Any:
        return F.layer_norm(t, (width,), w["norm_weight"], w["norm_bias"])

    def linear(t: Any, name: str) -> Any:
        return F.linear(t, w[name], w["bias"])

    a = norm(h)
    q, k, v = (linear(a, n).view(batch, seq, _BLOCK_HEADS, width // _BLOCK_HEADS).transpose(1, 2) for n in "qkv")
    scores = torch.softmax(q @ k.transpose(-2, -1) / (width // _BLOCK_HEADS) ** 0.5, dim=-1)
    h = h + linear((scores @ v).transpose(1, 2).reshape(batch, seq, width), "o")
    return h + linear(F.gelu(linear(norm(h), "up")), "down")


class _DispatchCounter(TorchDispatchMode):
    """Counts the aten ops dispatched under it: views apart from the rest."""
    def __init__(self) -> None:
        super().__init__()
        self.ops = self.views = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.is_view:
            self.views += 1
        else:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def measure_collectives(group: Any, device: Any, sizes: Sizes) -> list[dict[str, Any]]:
    """Seconds of each collective kind and message size on ``group`` (every member must call this)."""
    p = dist.get_world_size(group)
    sync = _synchronizer(device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    samples = []
    for nbytes in sizes.message_bytes:
        elements = max(p, nbytes // DTYPE_BYTES["fp32"] // p * p)
        full = torch.zeros(elements, device=device)
        shard = torch.zeros(elements // p, device=device)
        calls = {
            "all_reduce": lambda: dist.all_reduce(full, group=group),
            "all_gather": lambda: all_gather(full, shard, group=group),
            "reduce_scatter": lambda: reduce_scatter(shard, full, group=group),
        }
        for kind in MEASURED_COLLECTIVES:
            seconds = _seconds_per_call(calls[kind], sync, sizes, _most_calls_in(group))
            samples.append({"kind": kind, "nbytes": elements * DTYPE_BYTES["fp32"], "ranks": p, "seconds": seconds})
    return samples


# --------------------------------------------------------------------------------------------
# One rank's run
# --------------------------------------------------------------------------------------------


def measure_rank(quick: bool = False, ranks_per_node: int | None = None) -> dict[str, Any] | None:
    """Measure on every rank of the initialized process group; rank 0 returns the combined results.

    ``ranks_per_node`` defaults to torchrun's ``LOCAL_WORLD_SIZE`` (or the whole world). Every
    rank must call this; ranks other than 0 return None.
    """
    if not dist.is_initialized():
        raise ValueError("measure_rank needs an initialized process group (torchrun, or autopar "
                         "calibrate --ranks N)")
    world = dist.get_world_size()
    per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        raise ValueError(f"{world} ranks cannot be split into nodes of {per_node}: expected "
                         "LOCAL_WORLD_SIZE to divide WORLD_SIZE")
    device = _rank_device(dist.get_backend())
    sizes = sizes_for(device.type, quick)
    local = {
        "matmul": measure_matmuls(device, sizes),
        "memory": measure_memory(device, sizes),
        "op_floor": measure_op_floor(device, sizes),
        "links": _measure_links(device, sizes, world, per_node),
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local)
    if dist.get_rank() != 0:
        return None
    return {"device_type": device.type, "device_name": _device_name(device), "world": world,
            "ranks_per_node": per_node, "threads_per_rank": torch.get_num_threads(),
            "hbm_bytes": _memory_per_rank(device, per_node), **_slowest_rank(gathered)}


def measure_spawned_rank(rank: int, world: int, quick: bool) -> dict[str, Any] | None:
    """``measure_rank`` for ranks spawned on one host (``autopar.testing.launch.run_on_ranks(fn, world, quick)``)."""
    return measure_rank(quick, ranks_per_node=world)


def measure_in_job(quick: bool) -> dict[str, Any] | None:
    """``measure_rank`` in a job launched by torchrun: joins (or reuses) its process group.

    NCCL when CUDA is available (each rank on its ``LOCAL_RANK`` GPU), gloo otherwise.
    """
    created = not dist.is_initialized()
    if created:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    try:
        return measure_rank(quick)
    finally:
        if created:
            dist.destroy_process_group()


def _rank_device(backend: str) -> Any:
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _device_name(device: Any) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or
                                                                            platform.machine())


def _memory_per_rank(device: Any, ranks_per_node: int) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // ranks_per_node


def _measure_links(device: Any, sizes: Sizes, world: int, per_node: int) -> dict[str, list[dict[str, Any]]]:
    """Collectives on this rank's node group ("intra") and its one-rank-per-node group ("inter").

    ``new_group`` is collective: every rank creates every group, in the same order, and keeps its own.
    """
    rank, nodes = dist.get_rank(), world // per_node
    links: dict[str, list[dict[str, Any]]] = {}
    if per_node > 1:
        groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]
        links["intra"] = measure_collectives(groups[rank // per_node], device, sizes)
    if nodes > 1:
        groups = [dist.new_group(list(range(local, world, per_node))) for local in range(per_node)]
        links["inter"] = measure_collectives(groups[rank % per_node], device, sizes)
    return links


def _slowest_rank(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each sample's seconds (and the op floor) as the maximum over ranks: the pace of a synchronous step."""
    first = per_rank[0]
    combined: dict[str, Any] = {
        "matmul": _max_seconds([r["matmul"] for r in per_rank]),
        "memory": _max_seconds([r["memory"] for r in per_rank]),
        "links": {name: _max_seconds([r["links"][name] for r in per_rank]) for name in first["links"]},
    }
    floor = dict(first["op_floor"])
    for key in ("forward_s", "forward_backward_s", "seconds_per_op", "kernel_launch_s", "host_op_s", "update_s",
                "host_update_op_s", "lowered_forward_backward_s", "lowered_host_op_s"):
        if key in floor:
            floor[key] = max(r["op_floor"][key] for r in per_rank)
    if "redistribute" in floor:
        floor["redistribute"] = _max_seconds([[r["op_floor"]["redistribute"]] for r in per_rank])[0]
    combined["op_floor"] = floor
    return combined


def _max_seconds(per_rank: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    return [{**samples[0], "seconds": max(s["seconds"] for s in samples)} for samples in zip(*per_rank)]


# --------------------------------------------------------------------------------------------
# Profile
# --------------------------------------------------------------------------------------------


def base_preset(measured: Mapping[str, Any]) -> str:
    """The catalogue preset a measured device modifies: "cpu", or the NVIDIA part CUDA names."""
    if measured["device_type"] != "cuda":
        return "cpu"
    return preset_for_cuda_name(str(measured["device_name"]))


def build_profile(measured: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The cluster file for ``measured`` (``measure_rank``'s result); see the module doc for the mapping."""
    base = get_device(base_preset(measured))
    fits = {"matmul": _matmul_fits(measured["matmul"]), "memory": _memory_fit(measured["memory"]),
            "links": {name: asdict(fit_link([CollectiveSample(**s) for s in samples]))
                      for name, samples in measured["links"].items()}}
    device: dict[str, Any] = {
        "base": base.name,
        "peak_flops": {key: fit["rate"] / base.matmul_efficiency for key, fit in fits["matmul"].items()},
        "hbm_bytes": int(measured["hbm_bytes"]),
        "hbm_bw": fits["memory"]["rate"] / MEMORY_EFFICIENCY,
        "kernel_launch_s": measured["op_floor"]["kernel_launch_s"],
    }
    device.update({key: measured["op_floor"][key] for key in ("host_op_s", "host_update_op_s", "lowered_host_op_s")
                   if key in measured["op_floor"]})
    device.update(_link_fields(fits["links"]))
    if "redistribute" in measured["op_floor"] and fits["links"]:  # one rank runs no collective to charge
        link = fits["links"]["intra" if "intra" in fits["links"] else "inter"]
        device["redistribute_s"] = redistribute_overhead_s(measured["op_floor"]["redistribute"], LinkFit(**link))
    nodes = measured["world"] // measured["ranks_per_node"]
    return {"source": source, "nodes": nodes, "devices_per_node": measured["ranks_per_node"], "device": device,
            "measured": {**measured, "fits": fits}}


def redistribute_overhead_s(sample: Mapping[str, Any], link: LinkFit) -> float:
    """``redistribute_s``: what one DTensor redistribute added to a step (``sample``: its kind, full bytes,
    ranks and marginal seconds) beyond the time ``comm.py``'s formula gives it on the fitted ``link``."""
    return max(0.0, sample["seconds"] - link.seconds(sample["kind"], sample["nbytes"], sample["ranks"]))


def _matmul_fits(samples: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    fits = {}
    for key in dict.fromkeys(s["dtype"] for s in samples):
        chosen = [s for s in samples if s["dtype"] == key]
        fits[key] = asdict(fit_rate([s["flops"] for s in chosen], [s["seconds"] for s in chosen]))
    return fits


def _memory_fit(samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    return asdict(fit_rate([s["bytes"] for s in samples], [s["seconds"] for s in samples]))


def _link_fields(links: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """DeviceSpec fields of the fitted links; the base latency from inside a node when measured there."""
    fields: dict[str, float] = {}
    if "inter" in links:
        fields.update(net_bw=links["inter"]["bw"], inter_latency_s=links["inter"]["step_latency_s"],
                      base_latency_s=links["inter"]["base_latency_s"])
    if "intra" in links:
        fields.update(nvlink_bw=links["intra"]["bw"], intra_latency_s=links["intra"]["step_latency_s"],
                      base_latency_s=links["intra"]["base_latency_s"])
    return fields


def profile_summary(profile: Mapping[str, Any]) -> str:
    """A few lines a person reads after calibrating: the fitted figures, in the units people use."""
    device, measured = profile["device"], profile["measured"]
    fits = measured["fits"]
    lines = [f"{profile['source']}: {profile['nodes']}x{profile['devices_per_node']}x{device['base']} "
             f"({measured['device_name']}, {measured['threads_per_rank']} thread(s) per rank)"]
    for key, fit in fits["matmul"].items():
        lines.append(f"  matmul {key:<5} {fit['rate'] / 1e9:10.1f} GFLOP/s achieved "
                     f"(peak_flops {device['peak_flops'][key] / 1e9:.1f} G)")
    lines.append(f"  memory       {fits['memory']['rate'] / 1e9:10.2f} GB/s achieved (hbm_bw {device['hbm_bw'] / 1e9:.2f} GB/s)")
    lines.append(f"  op floor     {device['kernel_launch_s'] * 1e6:10.1f} us per kernel")
    if "host_op_s" in device:
        lines.append(f"  dispatch     {device['host_op_s'] * 1e6:10.1f} us per op (views included) on the host, "
                     f"{device['host_update_op_s'] * 1e6:.1f} us per optimizer kernel")
    if "lowered_host_op_s" in device:
        lines.append(f"  lowered      {device['lowered_host_op_s'] * 1e6:10.1f} us per op in the lowered "
                     "runtime's graphs")
    if "redistribute_s" in device:
        lines.append(f"  redistribute {device['redistribute_s'] * 1e6:10.1f} us per collective in a step, "
                     "beyond the link's formula")
    for name, fit in fits["links"].items():
        lines.append(f"  {name}-node    {fit['bw'] / 1e9:10.2f} GB/s, {fit['step_latency_s'] * 1e6:.1f} us per ring step, "
                     f"{fit['base_latency_s'] * 1e6:.1f} us per collective")
    return "\n".join(lines)


def profile_source() -> str:
    """``autopar calibrate <UTC date and time> on <hostname>``."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"autopar calibrate {now} on {socket.gethostname()}"


def profile_text(profile: Mapping[str, Any]) -> str:
    """The profile as the JSON text of a cluster file (the CLI writes it atomically: ``core/files.py``)."""
    return json.dumps(profile, indent=2) + "\n"
