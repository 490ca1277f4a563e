"""Candidate meshes searched side by side in forked processes, to a result that does not depend on how many.

``make_plan`` hands the meshes over in batches of ``BATCH``. Every mesh of a batch is searched against the
same cutoff, the best step time of the batches before it, and the batch's outcomes are taken in mesh
order. Which meshes are pruned, which plan wins and everything the plan reports (wall times aside) thus
depend on ``BATCH``, a constant, and never on the number of cores, the machine's load or which worker
finished first: one worker runs a batch's meshes one after the other, in this process, to the same plan
that two run side by side.

Workers are forked once the step is captured, so they inherit the captured graph and the search's state
without pickling them; what comes back per mesh is its outcome (a solved candidate of about 100 kB, the
mesh itself when its bound lost, or the reason nothing fit) and the seconds its phases took. Where the
platform cannot fork (Windows; macOS, where forking a process that has loaded system frameworks is
unsafe) one worker runs everything. Forked workers run only planning code on meta tensors, numpy and
HiGHS, no torch kernels, so the parent's thread pools are not needed in them.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Any, Callable, Sequence, TypeVar

BATCH = 2
"""Meshes searched against one cutoff. Two uses both cores of a two-core machine; a larger batch would
search more meshes whose cutoff a batch-mate could have tightened."""

_T = TypeVar("_T")
_R = TypeVar("_R")
_task: Callable[[Any], Any] | None = None  # the batch task, set in the parent before the workers fork


def worker_count() -> int:
    """Processes to run a batch in: up to ``BATCH``, at most the cores this process may use, one where the
    platform cannot fork (or ``AUTOPAR_PLAN_WORKERS=1`` asks for one)."""
    asked = os.environ.get("AUTOPAR_PLAN_WORKERS")
    if asked is not None and asked.strip().isdigit() and int(asked) >= 1:
        limit = int(asked)
    else:
        limit = BATCH
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    can_fork = sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
    return max(1, min(limit, BATCH, cores)) if can_fork else 1


class Workers:
    """Runs ``task`` over the items of each batch, in forked workers when there are more than one; the
    results come back in the items' order. Use as a context manager (the workers end with it)."""

    def __init__(self, task: Callable[[_T], _R], count: int):
        self.task, self.count = task, count
        self._pool: Any = None

    def map(self, items: Sequence[_T]) -> list[_R]:
        if self.count == 1 or len(items) <= 1:
            return [self.task(item) for item in items]
        if self._pool is None:
            global _task
            _task = self.task
            self._pool = multiprocessing.get_context("fork").Pool(self.count)
        return self._pool.map(_run_task, items, chunksize=1)

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()


def _run_task(item: Any) -> Any:
    assert _task is not None  # set by ``Workers.map`` before the fork
    return _task(item)
