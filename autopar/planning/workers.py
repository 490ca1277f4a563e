"""Candidate meshes searched side by side in forked processes, to a result that does not depend on how many.

``make_plan`` hands the meshes over in order through ``Workers.in_order``, and each mesh is searched against
a cutoff, the best step time among the meshes up to the first that found a plan and those at least
``WINDOW`` places before it (never the ones closer: those may still be running). The outcomes are taken in
mesh order. Which meshes are pruned, which plan wins and everything the plan reports (wall times aside) thus
depend on ``WINDOW``, a constant, and never on the number of cores, the machine's load or which worker
finished first: one worker runs the meshes one after the other, in this process, to the same plan that two
run side by side.

The window is a sliding one, not a batch: a mesh starts as soon as a worker is free and the mesh
``WINDOW`` places before it has been taken, so a mesh whose search is long (a pipeline mesh's solves take
seconds) holds up one worker, while the other goes on through the meshes after it, instead of
idling until a batch's slowest mesh is done. (On Llama 3 70B's 45 meshes of 1,024 GPUs, batches of two
kept the second of two workers idle for 40% of the search.)

Workers are forked once the step is captured, so they inherit the captured graph and the search's state
without pickling them; what comes back per mesh is its outcome (a solved candidate of about 100 kB, the
mesh itself when its bound lost, or the reason nothing fit), the seconds its phases took and the
warnings its search raised. Those are raised again in this process as each outcome is taken, at the
place the worker raised them, under the caller's warning filters, each text and place once a search
(the meshes' searches warn alike: an op without a sharding rule), so a caller sees the same warnings in
the same order with one worker or several. Where the platform cannot fork (Windows; macOS, where forking
a process that has loaded system frameworks is unsafe) one worker runs everything. Forked workers run only
planning code on meta tensors, numpy and HiGHS, no torch kernels, so the parent's thread pools are not
needed in them.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import warnings
from typing import Any, Callable, Iterator, TypeVar

WINDOW = 4
"""How many places before a mesh the meshes are whose outcomes its cutoff reads: the meshes in between may
be in flight while it starts. A wider window keeps more workers busy around a long search, and gives
each mesh a staler cutoff (more of its ILPs solved only to lose)."""
WORKERS = 2
"""Processes the meshes are searched in by default (no more than the cores this process may use)."""

_T = TypeVar("_T")
_R = TypeVar("_R")
_task: Callable[[Any], Any] | None = None  # the batch task, set in the parent before the workers fork
Warned = tuple[str, type, str, int]
"""A warning a task raised, as it travels back: its text, category, file and line."""


def worker_count() -> int:
    """Processes to search in: ``WORKERS`` (or what ``AUTOPAR_PLAN_WORKERS`` asks for), at most the cores
    this process may use and ``WINDOW``, one where the platform cannot fork."""
    asked = os.environ.get("AUTOPAR_PLAN_WORKERS")
    if asked is not None and asked.strip().isdigit() and int(asked) >= 1:
        limit = int(asked)
    else:
        limit = WORKERS
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    can_fork = sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
    return max(1, min(limit, WINDOW, cores)) if can_fork else 1


class Workers:
    """Runs ``task`` over items in forked workers when there are more than one, or in this process; the
    results come back in the items' order. Use as a context manager (the workers end with it)."""

    def __init__(self, task: Callable[[_T], _R], count: int):
        self.task, self.count = task, count
        self._pool: Any = None
        self._warned: set[Warned] = set()  # raised already: each warning once per search

    def in_order(self, count: int, item_for: Callable[[int], _T | None],
                 settles: Callable[[_R | None], bool] = lambda result: True) -> Iterator[tuple[int, _R | None]]:
        """``(i, task(item_for(i)))`` for ``i`` in ``range(count)``, in that order; ``(i, None)`` where
        ``item_for(i)`` is None (nothing to run). ``item_for(i)`` is called once the caller has taken the
        results of items ``0 .. max(s, i - WINDOW)`` and no later ones, ``s`` the first item whose result
        ``settles`` (gives the later items what they read: a cutoff), whether one worker runs the tasks or
        several: what it reads of them is the same either way. Until a result settles, the items thus run
        one at a time, each reading every result before it, and every later one reads the settling result:
        a search without any cutoff can take a hundred times as long (Llama 3 8B on 64 GPUs: its third mesh,
        searched beside the first, 3.5 s instead of 0.4; DeepSeek-V3 on 128 GPUs, whose first mesh fits
        nothing: its third and fourth, 381 and 411 s of HiGHS where the second's plan prunes them in one).
        Running alone, an item runs in this process, and the workers forked after it start from its
        caches. Every task's warnings, wherever it ran, are raised here when its result is taken
        (``_reraised``)."""
        started: dict[int, tuple[bool, Any]] = {}
        next_index = 0
        settled = False
        for taken in range(count):
            while next_index < min(count, taken + WINDOW if settled else taken + 1):
                started[next_index] = self._start(item_for(next_index), alone=not settled)
                next_index += 1
            result = self._finish(started.pop(taken))
            settled = settled or settles(result)
            yield taken, result

    def _start(self, item: _T | None, alone: bool) -> tuple[bool, Any]:
        """(whether it runs in a worker, its asynchronous result there or else ``item`` itself, which
        ``_finish`` runs here: nothing to run, an item that runs alone, or a single worker)."""
        if item is None or alone or self.count == 1:
            return False, item
        if self._pool is None:
            global _task
            _task = self.task
            self._pool = multiprocessing.get_context("fork").Pool(self.count)
        return True, self._pool.apply_async(_run_task, (item,))

    def _finish(self, started: tuple[bool, Any]) -> _R | None:
        in_worker, value = started
        if in_worker:
            result, warned = value.get()
        elif value is None:
            return None
        else:
            result, warned = _recording_warnings(self.task, value)
        self._reraised(warned)
        return result

    def _reraised(self, warned: list[Warned]) -> None:
        """Raise a task's warnings here, under this process's filters, each (text, category, place) once.
        (Not through ``warn_explicit``'s registry: recording a task's warnings changes the filters, which
        empties every registry.)"""
        for warning in warned:
            if warning not in self._warned:
                self._warned.add(warning)
                warnings.warn_explicit(*warning)

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()


def _run_task(item: Any) -> tuple[Any, list[Warned]]:
    assert _task is not None  # set by ``Workers._start`` before the fork
    return _recording_warnings(_task, item)


def _recording_warnings(task: Callable[[_T], _R], item: _T) -> tuple[_R, list[Warned]]:
    """``task(item)`` and the warnings it raised, in order, each (text, category, place) once: all of them,
    the filters that decide which are shown are the caller's, applied by ``Workers._reraised``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = task(item)
    return result, list(dict.fromkeys((str(w.message), w.category, w.filename, w.lineno) for w in caught))
