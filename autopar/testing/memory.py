"""Exact live tensor memory of one process, for comparing a plan's predicted peak with what a step holds.

CPU tensors have no allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU twin), so
``LiveTensorBytes`` counts storages instead: a ``TorchDispatchMode`` that sees every op's outputs, adds
each storage it has not seen (``UntypedStorage.nbytes()``) to the live total when the op returns, and
subtracts it when the storage is freed (a weak reference's callback, which fires when the storage itself
dies, not when a Python handle to it does). ``peak`` is the largest live total after any op. Tensors
that exist before the mode is entered are counted only when ``track`` registers them (parameters,
optimizer state): the measured peak is then "what the registered tensors and the step's own allocations
hold at the worst moment", the quantity a plan's ``peak_memory_bytes`` predicts.

DTensor: the mode declines ops on DTensors (returns ``NotImplemented``), so DTensor runs them as ops on
local shards, which the mode then sees and counts; the fake-tensor ops of DTensor's sharding
propagation allocate nothing and are skipped. This is how PyTorch's own ``MemTracker``
(``torch.distributed._tools.mem_tracker``) handles DTensor; we do not use it because it attributes
memory to ``nn.Module`` calls and refuses a root module called more than once per step, which gradient
accumulation and pipeline schedules do.

Not counted: a kernel's internal scratch space (never a tensor), storages resized in place after they
were first seen (autopar's runtime does not resize storages), and the allocator's slack around each
block (``StepMemory.rss_growth`` gives the process's resident set for that).

``measure_step`` runs one training step of a parallel module under the tracker, as
``benchmarks/memory_check.py`` and ``tests/test_memory_check.py`` compare it with the plan.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Live and peak bytes of tensor storage, from the moment the mode is entered (``with`` block).

    ``track(*tensors)`` registers tensors made before (counted from then on until they are freed);
    ``reset_peak()`` starts a new peak from the current total, to read the peak of one phase.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}  # id(storage) -> weak reference whose callback frees it
        self._fake_mode_on_entry: Any = None

    def track(self, *tensors: Any) -> None:
        """Count the storages of ``tensors`` (nested lists, dicts, DTensors and None are fine)."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __enter__(self) -> LiveTensorBytes:
        self._fake_mode_on_entry = active_fake_mode()
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._fake_mode_on_entry:  # DTensor's shape propagation runs under its own
            self.track(out)
        return out

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        for storage in get_untyped_storages(t):  # a DTensor's are its local shard's
            key = id(storage)
            if key in self._refs:
                continue
            nbytes = storage.nbytes()
            self._refs[key] = weakref.ref(storage, lambda ref, key=key, nbytes=nbytes: self._free(key, ref, nbytes))
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def _free(self, key: int, ref: weakref.ref, nbytes: int) -> None:
        if self._refs.get(key) is ref:
            del self._refs[key]
        self.current -= nbytes


@dataclass(frozen=True)
class StepMemory:
    """Bytes of tensor storage one rank holds over a measured training step (``measure_step``)."""

    start: int  # when the step begins: parameters and optimizer state (gradients were set to None)
    step_peak: int  # peak of forward, loss, backward and gradient sync (``module.step``)
    optimizer_peak: int  # peak of ``optimizer.step()``
    params: int  # this rank's parameters (local shards)
    grads: int  # their gradients after the step
    optimizer: int  # the optimizer's state after the step
    rss_growth: int | None  # the resident set's peak during the step above where it began (None: not Linux)

    @property
    def peak(self) -> int:
        return max(self.step_peak, self.optimizer_peak)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "peak": self.peak}


def measure_step(module: Any, make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
                 warmup: Sequence[torch.Tensor], batch: Sequence[torch.Tensor]) -> StepMemory:
    """Train ``module`` (``ParallelModule`` or ``PipelineParallelModule``) one step on ``warmup`` with a new
    optimizer (which creates its state and fills DTensor's caches), then measure one step on ``batch``:
    ``zero_grad(set_to_none=True)``, ``module.step(*batch)``, ``optimizer.step()``, with the parameters
    and optimizer state registered with ``LiveTensorBytes``. The parameters are ``module.parameters()``:
    under ZeRO-1/2 those are the dp- (and cp-) sharded copies, and the replicated ones the program reads are not
    registered, so such plans are not measured whole."""
    params = list(module.parameters())
    optimizer = make_optimizer(params)
    _tracked_step(module, optimizer, params, warmup)
    return _tracked_step(module, optimizer, params, batch)


def _tracked_step(module: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                  batch: Sequence[torch.Tensor]) -> StepMemory:
    optimizer.zero_grad(set_to_none=True)
    tracker = LiveTensorBytes()
    tracker.track(params, _optimizer_state(optimizer))
    start = tracker.current
    rss_before = resident_bytes() if reset_resident_peak() else None
    with tracker:
        module.step(*batch)
        step_peak = tracker.peak
        tracker.reset_peak()
        optimizer.step()
    rss_peak = resident_peak_bytes()
    return StepMemory(start=start, step_peak=step_peak, optimizer_peak=tracker.peak, params=storage_bytes(params),
                      grads=storage_bytes([p.grad for p in params]),
                      optimizer=storage_bytes(_optimizer_state(optimizer)),
                      rss_growth=rss_peak - rss_before if rss_peak is not None and rss_before is not None else None)


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    probe = LiveTensorBytes()
    probe.track(tensors)
    return probe.current


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def resident_bytes() -> int | None:
    """This process's resident set now (``VmRSS``), or None where ``/proc`` does not say (not Linux)."""
    return _proc_status_bytes("VmRSS")


def reset_resident_peak() -> bool:
    """Restart the kernel's record of this process's peak resident set (``VmHWM``); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def resident_peak_bytes() -> int | None:
    """The peak resident set since the last ``reset_resident_peak`` (``VmHWM``), or None off Linux."""
    return _proc_status_bytes("VmHWM")


def _proc_status_bytes(field: str) -> int | None:
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # the kernel writes kB
    return None
