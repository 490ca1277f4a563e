"""Pipeline schedules in numbers: the bubble and the microbatches in flight on a stage.

This module evaluates the pipeline formulas of ``symbolic.py`` (``BUBBLE_FRACTION``,
``MICROBATCHES_IN_FLIGHT``, ``LAST_CHUNK_IN_FLIGHT``; Narayanan et al., SC21, §2.2; Korthikanti et al. 2022, §4.2.3) for
one schedule. It is not for choosing stages or pricing their sends (the planner does that, with
``comm.collective_time("send_recv", ...)``).

Schedules: ``gpipe`` (all forwards, then all backwards; Huang et al. 2019), ``1f1b`` (one forward,
one backward; Narayanan et al., SOSP 2019), ``interleaved`` (1F1B over ``chunks`` model chunks per
device; Narayanan et al., SC21). With one stage there is no pipeline: no bubble, and each
microbatch's backward follows its forward (gradient accumulation), so one is in flight.
"""

from __future__ import annotations

import functools
from typing import Callable

from .symbolic import BUBBLE_FRACTION, LAST_CHUNK_IN_FLIGHT, MICROBATCHES_IN_FLIGHT, compile_expr, m, p, v

SCHEDULES = tuple(BUBBLE_FRACTION)


def pipeline_bubble_fraction(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of the ideal step time: ``(p-1)/m`` (GPipe, 1F1B), ``(p-1)/(v m)`` (interleaved)."""
    _checked(schedule, stages, microbatches, chunks)
    return float(_compiled("bubble", schedule)(stages, microbatches, chunks))


def microbatches_in_flight(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Microbatches whose activations the first stage holds at once: ``m`` (GPipe), ``min(p, m)``
    (1F1B), ``min(p, m) (1 + (p-1)/(p v))`` (interleaved); 1 with a single stage."""
    if _checked(schedule, stages, microbatches, chunks) == 1:
        return 1.0
    return float(_compiled("in_flight", schedule)(stages, microbatches, chunks))


def last_chunk_in_flight(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Microbatches whose activations the model's last chunk (final norm, head, loss) holds at once:
    ``m`` (GPipe), 1 (1F1B, interleaved: its backward follows its forward); 1 with a single stage."""
    if _checked(schedule, stages, microbatches, chunks) == 1:
        return 1.0
    return float(_compiled("last_in_flight", schedule)(stages, microbatches, chunks))


@functools.cache
def _compiled(quantity: str, schedule: str) -> Callable[[int, int, int], float]:
    formulas = {"bubble": BUBBLE_FRACTION, "in_flight": MICROBATCHES_IN_FLIGHT,
                "last_in_flight": LAST_CHUNK_IN_FLIGHT}[quantity]
    return compile_expr((p, m, v), formulas[schedule])


def _checked(schedule: str, stages: int, microbatches: int, chunks: int) -> int:
    """Validate the arguments; return ``stages``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pipeline {name} must be a positive int, got {value!r}")
    if chunks > 1 and schedule != "interleaved":
        raise ValueError(f"chunks={chunks} needs the interleaved schedule, got {schedule!r}")
    return stages
