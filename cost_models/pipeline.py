"""Pipeline schedules in numbers: the bubble and the microbatches in flight on a stage.

This module evaluates the pipeline formulas of ``symbolic.py`` (``BUBBLE_FRACTION``,
``MICROBATCHES_IN_FLIGHT``, ``LAST_STAGE_IN_FLIGHT``, ``LAST_CHUNK_IN_FLIGHT``; Narayanan et al., SC21, §2.2; Korthikanti et al. 2022, §4.2.3) for
one schedule. It is not for choosing stages or pricing their sends (the planner does that, with
``comm.collective_time("send_recv", ...)``).

Schedules: ``gpipe`` (all forwards, then all backwards; Huang et al. 2019), ``1f1b`` (one forward,
one backward; Narayanan et al., SOSP 2019), ``interleaved`` (1F1B over ``chunks`` model chunks per
device; Narayanan et al., SC21). With one stage there is no pipeline: no bubble, and each
microbatch's backward follows its forward (gradient accumulation), so one is in flight.

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) split each backward
into an input-gradient step (B, which the previous stage waits for) and a weight-gradient step (W, which
nobody waits for and which fills the bubbles). Their bubble depends on how long F, B and W take, so
they have no formula here: ``zero_bubble`` (torch's ``ScheduleInterleavedZeroBubble``, the paper's
ZB-1p over ``chunks`` chunks per device) is priced by running torch's own action table (the schedule's
``pipeline_order``, ``torch_schedule_order``) through ``simulate``, with each chunk's F, B and W taking
``F_B_W`` of a microbatch's work. Torch's first stage has no input gradient to send, so it skips B and
runs the whole backward as its W; the simulation does the same. Activations are held from a
microbatch's F until its W (or whole backward) ends.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .symbolic import (BUBBLE_FRACTION, LAST_CHUNK_IN_FLIGHT, LAST_STAGE_IN_FLIGHT, MICROBATCHES_IN_FLIGHT,
                       compile_expr, m, p, v)

SIMULATED = {"zero_bubble": "ScheduleInterleavedZeroBubble"}
"""Schedules priced by simulating torch's action table: name -> the class of
``torch.distributed.pipelining.schedules`` that builds it (and that the runtime runs)."""
SCHEDULES = (*BUBBLE_FRACTION, *SIMULATED)
MULTI_CHUNK = ("interleaved", *SIMULATED)
"""Schedules that may run several model chunks per device."""
F_B_W = (1.0, 1.0, 1.0)
"""Durations of one chunk's forward, input-gradient and weight-gradient step of a microbatch, in any
unit: equal, as for a transformer layer's matmuls, each of which runs once in each step (Qi et al.
2024, §2; the assumption under which torch's zero-bubble schedules have no bubble)."""


def pipeline_bubble_fraction(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of the ideal step time: ``(p-1)/m`` (GPipe, 1F1B), ``(p-1)/(v m)`` (interleaved);
    zero-bubble schedules: simulated (``simulated_schedule``)."""
    if schedule in SIMULATED and _checked(schedule, stages, microbatches, chunks) > 1:
        return simulated_schedule(schedule, stages, microbatches, chunks).bubble_fraction
    _checked(schedule, stages, microbatches, chunks)
    return float(_compiled("bubble", schedule)(stages, microbatches, chunks))


def least_bubble_fraction(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """A lower bound of ``pipeline_bubble_fraction`` that simulates nothing: the formula itself where the
    schedule has one; for a simulated schedule, ``(p - 1) F / (v m (F + B + W))`` (``F_B_W``). In
    ``simulate``'s model every device does ``v m (F + B + W)`` of work, and the last device's first action,
    a forward of its first stage (stage ``p - 1`` at the least), waits for that microbatch's forwards on
    the ``p - 1`` stages before it, so its work ends no earlier than ``(p - 1) F`` after the ideal. It
    equals the simulated bubble of torch's zero-bubble schedule wherever ``m >= p`` (tested), and costs
    nothing where the simulation of a table of tens of thousands of actions costs a second or more; the
    planner prunes with it (``search._MeshSearch.least_bubble``)."""
    if schedule in SIMULATED and _checked(schedule, stages, microbatches, chunks) > 1:
        forward, backward_input, weight = F_B_W
        return (stages - 1) * forward / (chunks * microbatches * (forward + backward_input + weight))
    return pipeline_bubble_fraction(schedule, stages, microbatches, chunks)


def microbatches_in_flight(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Microbatches whose activations the first stage holds at once: ``m`` (GPipe), ``min(p, m)``
    (1F1B), ``min(m, ((v - 1) r + 2 (p - 1) + 1) / v)`` with ``r`` microbatches a round (interleaved);
    zero-bubble schedules: the most any device holds in torch's action table (``held_in_schedule``); 1 with a
    single stage."""
    if _checked(schedule, stages, microbatches, chunks) == 1:
        return 1.0
    if schedule in SIMULATED:
        return held_in_schedule(schedule, stages, microbatches, chunks).in_flight
    return float(_compiled("in_flight", schedule)(stages, microbatches, chunks))


def last_stage_in_flight(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Microbatches whose activations the last stage (the device of the model's last chunk) holds at once,
    in stages' worth: ``m`` (GPipe), 1 (1F1B), ``((v - 1) r + 1) / v`` (interleaved); zero-bubble schedules:
    from torch's action table (``held_in_schedule``); 1 with a single stage."""
    if _checked(schedule, stages, microbatches, chunks) == 1:
        return 1.0
    if schedule in SIMULATED:
        return held_in_schedule(schedule, stages, microbatches, chunks).last_stage_in_flight
    return float(_compiled("last_stage_in_flight", schedule)(stages, microbatches, chunks))


def last_chunk_in_flight(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Microbatches whose activations the model's last chunk (final norm, head, loss) holds at once:
    ``m`` (GPipe), 1 (1F1B, interleaved: its backward follows its forward); zero-bubble schedules: from
    torch's action table (the last chunk's W waits to fill a bubble, ``held_in_schedule``); 1 with a single
    stage."""
    if _checked(schedule, stages, microbatches, chunks) == 1:
        return 1.0
    if schedule in SIMULATED:
        return held_in_schedule(schedule, stages, microbatches, chunks).last_in_flight
    return float(_compiled("last_in_flight", schedule)(stages, microbatches, chunks))


# ---- simulating an action table ------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    """One step of a device's schedule: ``kind`` F (forward), B (input gradient), W (weight gradient) or
    BW (the whole backward) of ``microbatch`` on model chunk ``stage`` (0 .. p v - 1)."""

    stage: int
    kind: str
    microbatch: int


@dataclass(frozen=True)
class HeldActivations:
    """The activations an action table holds (``held_activations``)."""

    in_flight: float  # most microbatches whose activations one device holds at once, in stages' worth
    last_in_flight: int  # most microbatches the model's last chunk holds at once
    last_stage_in_flight: float  # most microbatches the last chunk's device holds at once, in stages' worth


@dataclass(frozen=True)
class SimulatedSchedule(HeldActivations):
    """What ``simulate`` finds: the activations held, the step's length and its idle share."""

    makespan: float  # from the first forward to the last step's end, on the busiest device
    work: float  # one device's compute (every device has the same)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ideal step time (one device's work), as ``pipeline_bubble_fraction``."""
        return self.makespan / self.work - 1.0


def simulate(order: Mapping[int, Sequence[Action | None]], chunks: int,
             durations: tuple[float, float, float] = F_B_W) -> SimulatedSchedule:
    """Run each device's actions (``order``: device -> its actions in order, None for an idle slot) as
    soon as the device is free and their inputs are ready: a forward after the previous chunk's forward
    of that microbatch, an input gradient (B or BW) after the next chunk's of it (the last chunk's,
    after its own forward), a W after its B. ``durations``: one chunk's F, B and W; BW takes B + W, and
    the first chunk's B (none to send) takes 0 and its W the whole backward, as torch runs them.
    Transfers are free. Raises ValueError if the actions wait on each other (an invalid table).

    Each action is compiled first into the slot of the result it waits for, the slot it fills and its
    duration (``_compiled_actions``), so the run itself only compares and adds: the planner simulates
    tables of tens of thousands of actions (torch's zero-bubble schedule at 128 microbatches and 20
    chunks a device: 30,720)."""
    queues = {rank: [a for a in actions if a is not None] for rank, actions in order.items()}
    every = [a for actions in queues.values() for a in actions]
    last, microbatches = max(a.stage for a in every), 1 + max(a.microbatch for a in every)
    compiled = {rank: _compiled_actions(actions, last, microbatches, durations) for rank, actions in queues.items()}
    done: list[float | None] = [None] * (2 * (last + 1) * microbatches)  # (chunk, F or B, microbatch) -> end
    position, free = dict.fromkeys(order, 0), dict.fromkeys(order, 0.0)
    remaining = sum(len(actions) for actions in queues.values())
    while remaining:
        progressed = False
        for rank, actions in compiled.items():
            at, end_of_rank, count = position[rank], free[rank], len(actions)
            while at < count:
                needed, filled, cost = actions[at]
                if needed < 0:
                    start = end_of_rank
                else:
                    ready = done[needed]
                    if ready is None:
                        break
                    start = end_of_rank if end_of_rank > ready else ready
                end_of_rank = start + cost
                at += 1
                if filled >= 0:
                    done[filled] = end_of_rank
            if at > position[rank]:
                progressed = True
                remaining -= at - position[rank]
                position[rank], free[rank] = at, end_of_rank
        if not progressed:
            raise ValueError("pipeline schedule's actions wait on each other: not a valid action table")
    first_rank = next(iter(order))
    work = sum(action[2] for action in compiled[first_rank])
    held = held_activations(order, chunks)
    return SimulatedSchedule(held.in_flight, held.last_in_flight, held.last_stage_in_flight, max(free.values()), work)


def held_activations(order: Mapping[int, Sequence[Action | None]], chunks: int) -> HeldActivations:
    """The most activations each device of ``order`` (device -> its actions in order) holds at once: a
    forward holds its microbatch's from its start, the end of its W or BW frees them. A device runs its
    actions one after another, each starting no earlier than the one before it ends, so what it holds when
    an action starts follows from the order alone, whatever the actions take and wait for (a free sorts
    before a forward that starts as it ends): no simulation is needed, and the planner reads these for
    every chunk count it bounds, where it simulates only the tables whose bubble it prices."""
    last = max(a.stage for actions in order.values() for a in actions if a is not None)
    most: dict[int, int] = {}
    last_most = last_held = 0
    last_device = None
    for rank, actions in order.items():
        held = most[rank] = 0
        for a in actions:
            if a is None or a.kind == "B":
                continue
            change = 1 if a.kind == "F" else -1
            held += change
            most[rank] = max(most[rank], held)
            if a.stage == last:
                last_device = rank
                last_held += change
                last_most = max(last_most, last_held)
    return HeldActivations(max(most.values()) / chunks, last_most, most[last_device] / chunks)


def _compiled_actions(actions: Sequence[Action], last: int, microbatches: int,
                      durations: tuple[float, float, float]) -> list[tuple[int, int, float]]:
    """Per action, for ``simulate``: the slot of the end time it waits for (-1: none), the slot it fills
    (-1: none, a W) and its duration. Slot ``2 (c M + mb)`` holds the end
    of chunk ``c``'s forward of microbatch ``mb`` (``M`` microbatches), the slot after it the end of its
    input gradient (a B or BW); the previous chunk's are ``2 M`` slots before, the next chunk's ``2 M``
    after."""
    forward, backward_input, weight = durations
    cost = {"F": forward, "B": backward_input, "W": weight, "BW": backward_input + weight}
    first_cost = {**cost, "B": 0.0, "W": backward_input + weight}
    chunk = 2 * microbatches  # slots a chunk's results take
    compiled = []
    for a in actions:
        kind, stage = a.kind, a.stage
        own = chunk * stage + 2 * a.microbatch  # this chunk's forward of the microbatch
        if kind == "F":
            needed, filled = (own - chunk if stage > 0 else -1), own
        elif kind == "W":
            needed, filled = own + 1, -1
        else:  # B or BW: after the last chunk's own forward, or the next chunk's input gradient
            needed, filled = (own if stage == last else own + chunk + 1), own + 1
        compiled.append((needed, filled, (first_cost if stage == 0 else cost)[kind]))
    return compiled


def schedule_available(schedule: str) -> bool:
    """Whether the installed torch has ``schedule`` (the simulated ones are torch classes; the others
    always run)."""
    if schedule not in SIMULATED:
        return schedule in SCHEDULES
    from torch.distributed.pipelining import schedules

    return hasattr(schedules, SIMULATED[schedule])


@functools.cache
def simulated_schedule(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> SimulatedSchedule:
    """``simulate`` of torch's action table of ``schedule`` (``SIMULATED``) with ``F_B_W``."""
    return simulate(_torch_table(schedule, stages, microbatches, chunks), chunks)


@functools.cache
def held_in_schedule(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> HeldActivations:
    """``held_activations`` of torch's action table of ``schedule`` (``SIMULATED``)."""
    return held_activations(_torch_table(schedule, stages, microbatches, chunks), chunks)


@functools.lru_cache(maxsize=8)
def _torch_table(schedule: str, stages: int, microbatches: int, chunks: int) -> dict[int, list[Action]]:
    """``torch_schedule_order`` of ``schedule``, kept for the few sizes read last: the held activations and the
    simulation of one size are asked for together, and tables run to tens of thousands of actions."""
    _checked(schedule, stages, microbatches, chunks)
    return torch_schedule_order(SIMULATED.get(schedule, schedule), stages, microbatches, chunks)


def torch_schedule_order(torch_class: str, stages: int, microbatches: int, chunks: int) -> dict[int, list[Action]]:
    """Device -> its actions, as torch's schedule class ``torch_class`` (of
    ``torch.distributed.pipelining.schedules``, one that takes a list of stages) orders them for ``stages``
    devices of ``chunks`` chunks each (without idle slots). The table is the schedule object's
    ``pipeline_order``, which torch computes for every device when it is built; the stages it is built
    with are stand-ins carrying only the sizes it reads, so no process group is needed. Raises ValueError
    where torch refuses the sizes (e.g. microbatches not a multiple of its rounds) or does not have the
    class."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, torch_class, None)
    if cls is None:
        raise ValueError(f"pipeline schedule {torch_class} is not in the installed torch")
    placeholders = [SimpleNamespace(num_stages=stages * chunks, group_size=stages, group_rank=0,
                                    stage_index=i * stages, submod=None) for i in range(chunks)]
    # the order of each device's actions only: torch's lowering of it to sends and receives (most of the
    # build's time) is skipped, and so is the zero-bubble schedule's pass that pads each device's order
    # with idle slots (``_add_bubbles_to_actions``: it only inserts Nones, which ``simulate`` drops; the
    # build of a 30,720-action table took 0.246 s with it, 0.186 s without)
    table_only = type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": lambda self, *args, **kwargs: None,
                                             "_add_bubbles_to_actions": lambda self, *args: self.pipeline_order})
    built = table_only(placeholders, microbatches, loss_fn=lambda output, target: output)
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "BW"}
    return {rank: [Action(a.stage_index, kinds[a.computation_type.name], a.microbatch_index)
                   for a in actions if a is not None]
            for rank, actions in built.pipeline_order.items()}


@functools.cache
def _compiled(quantity: str, schedule: str) -> Callable[[int, int, int], float]:
    formulas = {"bubble": BUBBLE_FRACTION, "in_flight": MICROBATCHES_IN_FLIGHT,
                "last_in_flight": LAST_CHUNK_IN_FLIGHT, "last_stage_in_flight": LAST_STAGE_IN_FLIGHT}[quantity]
    return compile_expr((p, m, v), formulas[schedule])


def _checked(schedule: str, stages: int, microbatches: int, chunks: int) -> int:
    """Validate the arguments; return ``stages``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pipeline {name} must be a positive int, got {value!r}")
    if chunks > 1 and schedule not in MULTI_CHUNK:
        raise ValueError(f"chunks={chunks} needs a schedule of several chunks a device "
                         f"({', '.join(MULTI_CHUNK)}), got {schedule!r}")
    return stages
