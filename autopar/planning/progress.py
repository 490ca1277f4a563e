"""``SearchProgress``: what a plan's search has done so far, for a live progress line and the plan.

The search reports into it: seconds per phase (capture, build: strategies, prices and staging of each
candidate's problem; solve: the ILPs), candidates solved and pruned out of those listed, and the best
step time found with its proven bound. A listener (the CLI's progress line on a terminal) is called
after every change; the phase seconds end up in ``plan.solver["phases_s"]``. Timings are reported, never
decided on: no result depends on them.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping


@dataclass
class SearchProgress:
    listener: Callable[["SearchProgress"], None] | None = None
    phases_s: dict[str, float] = field(default_factory=dict)
    phase_now: str = ""
    candidates: int = 0  # meshes the search lists
    solved: int = 0
    pruned: int = 0
    best_s: float | None = None  # best predicted step time so far
    best_bound_s: float | None = None  # the solver's proven bound of that plan's problem
    best_label: str = ""  # its mesh, e.g. "dp=32 x tp=2"
    _timed: list[str] = field(default_factory=list, init=False, repr=False)  # the timed phases open, innermost last

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``name`` (nested phases count in their own name only)."""
        outer, start = self.phase_now, time.perf_counter()
        outer_timed = bool(self._timed)
        self.phase_now = name
        self._timed.append(name)
        self._tell()
        try:
            yield
        finally:
            self.phases_s[name] = self.phases_s.get(name, 0.0) + time.perf_counter() - start
            self._timed.pop()
            self.phase_now = outer
            if outer_timed:  # the outer phase's clock does not count the inner one
                timed = self._timed[-1]
                self.phases_s[timed] = self.phases_s.get(timed, 0.0) - (time.perf_counter() - start)

    @contextmanager
    def showing(self, name: str) -> Iterator[None]:
        """Show ``name`` as the phase while the block runs, without timing it: workers in other
        processes are timing their phases (``add_phases``)."""
        outer = self.phase_now
        self.phase_now = name
        self._tell()
        try:
            yield
        finally:
            self.phase_now = outer

    def add_phases(self, seconds: Mapping[str, float]) -> None:
        """Add a worker's seconds per phase (``workers.py``): phases then sum the workers' time, which
        can exceed the wall time when they run side by side."""
        for name, s in seconds.items():
            self.phases_s[name] = self.phases_s.get(name, 0.0) + s

    def found(self, step_s: float, bound_s: float, label: str) -> None:
        """A candidate was solved; remember it when it is the best so far."""
        self.solved += 1
        if self.best_s is None or step_s < self.best_s:
            self.best_s, self.best_bound_s, self.best_label = step_s, bound_s, label
        self._tell()

    def skipped(self) -> None:
        """A candidate was pruned: its bound showed it cannot beat the best."""
        self.pruned += 1
        self._tell()

    def line(self) -> str:
        """One line: phase, candidates done, best plan so far and its bound."""
        done = f"{self.solved + self.pruned}/{self.candidates} meshes ({self.pruned} pruned)" if self.candidates else ""
        best = (f"best {self.best_label} {self.best_s * 1e3:.1f} ms/step (bound {self.best_bound_s * 1e3:.1f} ms)"
                if self.best_s is not None else "")
        return "  ".join(part for part in (f"planning: {self.phase_now or 'done'}", done, best) if part)

    def _tell(self) -> None:
        if self.listener is not None:
            self.listener(self)
