"""The ILP that picks one strategy per decision on one mesh, solved with HiGHS's MIP through OR-Tools'
MathOpt (its ``pywraplp`` HiGHS interface ignores every solver parameter: gap, cutoff, node limit).

Notation: decisions ``d`` (a graph node, or a group of identical nodes of repeated layers, ``n_d``
of them), options ``k`` of a decision with per-occurrence prices compute ``c_dk``, critical-path
communication ``m_dk``, overlappable gradient sync ``g_dk`` (a step's, ``h_dk`` of it redone in each of
``m`` microbatches), one microbatch's backward and forward compute ``b_dk`` and ``f_dk``, and
memory ``M_dk``; edges ``e = (u, i) -> (v, j)`` (output ``i`` of ``u`` feeds input ``j`` of ``v``,
``n_e`` times) with resharding price ``r_e(p, q)`` for producer placement ``p`` and consumer
placement ``q``.

With per-layer activation checkpointing left open (``Problem.layer_modes``: a device's ``L`` layers,
modes ``m``), a layer op's option has a price per mode, ``c_dkm`` etc., and a working set ``R_dkm``
(one recomputed layer's activations, live while its backward runs); the edges into an op that mode
``m`` recomputes run their forward collectives ``f_e(p,q)`` again.

Variables::

    x_dk in {0,1}          decision d takes option k                     (add_choice_variables)
    y_epq in {0,1}         edge e carries placement p into placement q   (add_edge_variables)
    z >= 0                 gradient sync left exposed in the last       (add_overlap_constraint)
                           microbatch's backward
    z' >= 0                ... in each earlier microbatch's (m > 1 only)
    z_f >= 0               prefetched parameter gathers left exposed in one microbatch's forward
    o                      communication run beside compute (where compute slows beside it)
    n_m in {0..L}          layers that run in checkpointing mode m       (add_layer_mode_variables)
    a_m in {0,1}           some layer runs in recomputing mode m
    w_dkm >= 0             = n_m x_dk: layers of option k in mode m      (add_mode_choice_variables)
    v_dkm >= 0             = a_m x_dk: option k's working set is held
    u_epqm >= 0            = n_m y_epq: layers whose edge p->q reruns    (add_recompute_edge_variables)
    g_t in [0,1]           = X_t Y_t: a root-sharding term t holds       (add_root_sharding_variables)
    G^s >= 0               memory row s's largest gathered unit          (add_memory_constraint)
    s_gpq in [0,1]         shared move g runs from p to q                (add_shared_move_variables)
    u_gpqm >= 0            = n_m s_gpq: layers whose shared move reruns

Constraints::

    (1) sum_k x_dk = 1                                          one option per decision
    (2) sum_q y_epq = sum_{k: out_i(u,k) = p} x_uk   for all p   edges agree with their producer
        sum_p y_epq = sum_{k: in_j(v,k)  = q} x_vk   for all q   ... and with their consumer
    (3) z >= sum_dk n_d (g_dk - (m-1) h_dk) x_dk + sum_epq n_e (g_e - (m-1) h_e)(p,q) y_epq
                  + sum_gpq n_g (g_g - (m-1) h_g)(p,q) s_gpq
                  - beta * sum_dk n_d b_dk x_dk                 gradient sync hides behind backward (g_e:
        z' >= sum_dk n_d h_dk x_dk + sum_epq n_e h_e(p,q) y_epq  a parameter's regather the lowered runtime
                  + sum_gpq n_g h_g(p,q) s_gpq                  issues ahead, ``edge_sync_terms``; g_g: an
                  - beta * sum_dk n_d b_dk x_dk                 activation's it launches ahead, on a shared
                                                                move of (11), or on an edge's g_e): the
                                                                last microbatch's backward hides what runs
                                                                once a step and its own share of what
                                                                runs every microbatch (``h``: ZeRO-2's,
                                                                lowered FSDP's), each earlier one its own
                                                                share (``pricing.OverlapSlack``)
        z_f >= sum_epq n_e a_e(p,q) y_epq / m - beta * sum_dk n_d f_dk x_dk   the parameter gathers the
                                                                lowered runtime issues a unit ahead
                                                                (``a_e``, a step's) hide behind forward
                                                                compute (``f_dk``, one microbatch's)
    (3') o = sum_dk n_d g_dk x_dk + sum_epq n_e (g_e + a_e)(p,q) y_epq + sum_gpq n_g g_g(p,q) s_gpq
                                                                the communication (3) overlaps
    (4) sum_dk n_d M^s_dk x_dk <= capacity      for each row s   memory of every device (add_memory_constraint)
    (5) sum_m n_m = L;  n_m <= L a_m                            every layer has one mode
    (6) sum_m w_dkm = L x_dk;  sum_k w_dkm = n_m                w = n x, exact once x is integral
    (7) v_dkm <= x_dk;  sum_k v_dkm = a_m                       working set of a recomputing mode in use
    (8) u_epqm <= L y_epq;  sum_{pq in F_e} (u_epqm - L y_epq) >= n_m - L   forward collectives run again
    (9) g_t <= X_t;  g_t <= Y_t;  g_t >= X_t + Y_t - 1           a value gathered for an op that leaves its
                                                                 gradient partial
    (10) (1 + f) (objective - Z) + Z <= cutoff                 with a cutoff: only plans that beat it
                                                                 (f: the pipeline bubble's share, 0 without)
    (11) s_gpq >= sum_h y_e,p,(q,h)   for every edge e of g      a move shared by readers runs once
         u_gpqm >= n_m - L (1 - s_gpq)                          ... and once more per recomputed layer
    (12) G^s >= sum_{d in unit, k} c_du W_dk x_dk  for each unit  the largest unit gathered over data
                                                                 parallelism, a term of row s of (4)

In (3), (4) and the objective a layer op's term ``n_d P_dk x_dk`` becomes ``sum_m (n_d / L) P_dkm w_dkm``
(its price mixed over the layers' modes), memory (4) adds ``sum_dkm R_dkm v_dkm`` and the objective
``sum_epqm (n_e / L) f_e(p,q) u_epqm``, over the pairs ``F_e`` of edge ``e`` with forward collectives.
(6) and (7) multiply "one option per decision" by ``n_m`` or ``a_m`` (a reformulation-linearization):
they make the products exact at integral ``x`` without big-M rows and keep the LP relaxation tight (a
transportation polytope per decision). (8) is exact at integral ``y``: u is 0 off the chosen pair and,
on a chosen pair of ``F_e``, at least ``n_m``; only ``F_e`` gets variables, which keeps the model small.

(9) prices what two decisions decide together (``Problem.root_terms``): a term ``t`` holds when its
consumer takes one of a set of options (``X_t = sum_{k in K_t} x_dk``: they read a parameter, or an
activation through a view, alike and leave its gradient partial) and the decision ``r`` that makes
the value read takes a placement it is gathered from, one of a set with the same price
(``Y_t = sum_{j in J_t} x_rj``). The gradient is then reduced inside backward by the gather's dual
(FSDP's, or sequence parallelism's, reduce_scatter) instead of by the overlapped gradient sync or the
one all_reduce the consumer's option assumed, so the term carries a price change ``D_t`` (critical
path up, gradient sync and its host work down) that enters the objective, (3) and (4) as
``n_t D_t g_t``, like an option's price. The three rows are the product's linearization (McCormick),
exact at integral ``x`` whichever sign ``D_t`` has.

(11) prices a redistribute several edges share (``Problem.shared``, ``problem.SharedResharding``): the
readers of one value in one region that read it at the same placement ``q`` read one redistribute at
run time (sequence parallelism's q, k and v: one all_gather, one reduce_scatter), so the move
``p -> q`` is priced ``T_g(p,q)`` once on ``s_gpq``, which is 1 as soon as one of the group's edges
carries ``p`` into ``q`` (whatever the dims ``h`` it leaves the gradient partial on), and the edges'
own prices ``r_e`` leave it out. ``s`` and ``u`` are continuous: the objective pushes them down to the
max of the group's ``y`` (and to ``n_m`` times it), exact once ``y`` is integral. Only groups of two or
more edges whose moves cost something get variables: one ``s`` per (group, pair) and one row per
member edge.

(12) prices FSDP's working set (``Problem.gathered_units``): a parameter stored sharded over data
parallelism is gathered whole while its unit (a layer, a module outside layers; each parameter alone in
a plan pinned to DTensor) runs, beside the next unit gathered ahead (``problem.GATHERED_COPIES``); ``W_dk``
is that for option ``k`` of parameter decision ``d`` (``Option.gathered_bytes``), ``c_du`` how many of
``d``'s nodes unit ``u`` holds. A device holds one unit's at a time, so each memory row adds the largest: ``G^s`` is
continuous and bounded below by every unit's sum, which is what the row needs (feasible exactly when
the largest fits).

Objective (predicted step time)::

    min  sum_dk n_d (c_dk + m_dk) x_dk + sum_epq n_e r_e(p,q) y_epq + sum_gpq n_g T_g(p,q) s_gpq + Z
    Z =  (1 - a) (z + (m - 1) z' + m z_f) + a o                 overlapped communication: what the step
                                                                waits for, and the compute slowed beside
                                                                the rest (a = s / (1 + s), compute running
                                                                s longer beside a collective:
                                                                ``DeviceSpec.overlap_slowdown``)

Every device runs the same program (SPMD), so one memory row bounds them all; under a pipeline, two
(``Problem.memory_rows``): the first stage's device, which holds what comes before the repeated layers
(``M^first_dk``: 0 for the head and loss) and the most microbatches in flight, and the last stage's
(``M^last_dk``: 0 for the embedding; a layer's activations at the last stage's microbatches in flight),
over the same variables (``Problem.held_bytes``); the stages between hold neither end and no more
microbatches than the first. ``y`` and the ``z`` are
continuous: once ``x`` is integral, (2) fixes ``y`` to the one pair the two endpoints chose. The
objective is scaled to microseconds and memory to GiB to keep coefficients near 1 for the LP.
``evaluate`` computes the same objective for a given assignment; tests check the solver against
brute force with it. (CP-SAT was tried first: on these problems the LP-based MIP is 10x faster.)

With a cutoff, the LP relaxation is solved alone first (``solve``, ``cannot_beat``): where no fractional
assignment beats the cutoff the problem is pruned without branching. The rows (2) of a mesh's edges are
worked out once and shared by the problems derived from it (``Problem.edge_rows``).

The solve is deterministic: no wall-clock limit, only a limit on branch-and-bound nodes
(``NODE_LIMIT``), so one problem gives one plan whatever the machine's load; the plan reports the
solver's proven bound and whether the limit stopped it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping, NamedTuple

from ortools.math_opt import model_pb2, result_pb2, solution_pb2
from ortools.math_opt.core.python import solver as core_solver
from ortools.math_opt.solvers import highs_pb2
from ortools.math_opt.python import callback, init_arguments, mathopt, model_parameters

from autopar.core.errors import NoFeasiblePlanError
from autopar.core.units import fmt_bytes
from autopar.planning.problem import Edge, EdgeRows, Problem, edge_pair
from autopar.planning.pricing import OverlapSlack, contention_share

_US = 1e6  # objective in microseconds keeps coefficients well scaled
_GIB = 2.0**30
RELATIVE_GAP = 1e-4
"""The solver stops once its plan is proven within this share of the optimum (``Solution.gap``)."""
NODE_LIMIT = 20_000
"""Branch-and-bound nodes the solver may explore on one problem: a limit on work, not on time, so
that the same problem gives the same plan on any machine under any load (``Solution.limit_hit``
says when it stopped the search; the plan is then the best found, with its bound)."""


@dataclass(frozen=True)
class Solution:
    choice: dict[str, int]  # decision key -> option index
    status: str  # optimal | feasible (the node limit stopped the search first)
    objective_s: float
    bound_s: float  # the solver's proven lower bound of the problem's optimum
    wall_s: float
    variables: int
    constraints: int
    layer_modes: dict[str, int] = field(default_factory=dict)  # checkpointing mode -> layers (n_m)
    nodes: int = 0  # branch-and-bound nodes explored: the deterministic measure of the work done
    limit_hit: bool = False  # NODE_LIMIT (or the caller's) stopped the search before it proved the gap

    @property
    def gap(self) -> float:
        return 0.0 if self.objective_s <= 0 else max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


@contextlib.contextmanager
def _native_output_dropped() -> Iterator[None]:
    """HiGHS prints some debugging lines from C++ straight to file descriptor 1 despite
    ``enable_output=False``; stdout belongs to ``--json`` and stderr to the progress line, so what the
    solve prints goes nowhere."""
    sys.stdout.flush()
    saved = os.dup(1)
    sink = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(sink, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(sink)


class Pruned(Exception):
    """The problem has no solution better than ``cutoff_s``: its lower bound is already worse."""


def solve(problem: Problem, node_limit: int = NODE_LIMIT, cutoff_s: float | None = None,
          bubble_fraction: float = 0.0) -> Solution:
    """Optimal assignment of ``problem`` (HiGHS through OR-Tools' MathOpt). With ``cutoff_s`` (the best
    step time found elsewhere) the objective is bounded by it (10), and ``Pruned`` is raised when
    nothing here beats it; under a pipeline whose bubble is ``bubble_fraction`` of the work, by the
    step time the bubble makes of it. No wall-clock limit: the result depends on the problem alone.

    With a cutoff, the LP relaxation is solved first, alone: most cutoffs the search sets are proven
    unbeatable by it, where HiGHS's MIP would add cuts and heuristics at the root before it stopped (on
    Mixtral's search, 109 pruned ILPs took 5.7 s this way and 17.0 s without it; the 14 it solved, 2.1
    and 2.0 s). An infinite cutoff (a search with nothing found yet) is none: a problem that then has no plan
    has none because nothing fits, not because nothing is faster."""
    if least_memory(problem) > problem.memory_capacity_bytes:
        raise NoFeasiblePlanError(infeasible_reason(problem))
    if cutoff_s is not None and math.isinf(cutoff_s):
        cutoff_s = None
    if cutoff_s is not None and (1.0 + bubble_fraction) * least_time(problem) >= cutoff_s:
        raise Pruned(f"mesh {problem.mesh_shape}: its least step time cannot beat {cutoff_s:.6g} s")
    model, x, n = build_model(problem, cutoff_s, bubble_fraction)
    start = time.perf_counter()
    if cutoff_s is not None and _relaxation_infeasible(model):
        raise Pruned(f"mesh {problem.mesh_shape}: its LP relaxation has no plan faster than {cutoff_s:.6g} s")
    result = _solved(model.to_proto(), node_limit)
    wall = time.perf_counter() - start
    if not result.feasible:
        stopped = result.reason == mathopt.TerminationReason.NO_SOLUTION_FOUND and result.limit == result_pb2.LIMIT_NODE
        if cutoff_s is not None and not stopped:
            raise Pruned(f"mesh {problem.mesh_shape}: no plan faster than {cutoff_s:.6g} s")
        raise NoFeasiblePlanError(infeasible_reason(problem, result.reason))
    objective = result.objective / _US
    if cutoff_s is not None and objective > cutoff_s:
        raise Pruned(f"mesh {problem.mesh_shape}: no plan faster than {cutoff_s:.6g} s")
    values = result.values
    choice = {key: max(range(len(vs)), key=lambda k: values[vs[k]]) for key, vs in x.items()}
    optimal = result.reason == mathopt.TerminationReason.OPTIMAL
    return Solution(
        choice=choice,
        status="optimal" if optimal else "feasible",
        objective_s=objective,
        bound_s=min(result.dual_bound / _US, objective),
        wall_s=wall,
        variables=len(model.lower),
        constraints=len(model.row_lower),
        layer_modes={m: round(values[var]) for m, var in n.items()},
        nodes=result.nodes,
        limit_hit=not optimal,
    )


def cannot_beat(problem: Problem, cutoff_s: float, bubble_fraction: float = 0.0) -> bool:
    """Whether no plan of ``problem`` beats ``cutoff_s`` (``solve``'s ``Pruned``), proven by the ILP's LP
    relaxation alone (every ``x`` in [0, 1]): where no fractional assignment satisfies (10), no integral one
    does. False where the relaxation admits one, although the ILP may still have none: a bound for the
    search to prune whole sets of configurations by (``search._MeshSearch._cannot_win``,
    ``search._ChunkBound``), at the price of one LP. (A node limit of one, this check until 2026-12-03,
    also runs HiGHS's cuts and root heuristics: it pruned the same configurations of Llama 3 70B on 1,024
    GPUs, 35 of 75, in 7.4 s of CPU where the LPs took 5.2 s; most of it where it does not prune.)"""
    if least_memory(problem) > problem.memory_capacity_bytes:
        return True
    if (1.0 + bubble_fraction) * least_time(problem) >= cutoff_s:
        return True
    return _relaxation_infeasible(build_model(problem, cutoff_s, bubble_fraction)[0])


def _relaxation_infeasible(model: Ilp) -> bool:
    """Whether HiGHS proves ``model``'s LP relaxation infeasible."""
    return _solved(model.to_proto(relaxed=True), NODE_LIMIT).reason in _PROVEN_INFEASIBLE


_PROVEN_INFEASIBLE = (mathopt.TerminationReason.INFEASIBLE, mathopt.TerminationReason.INFEASIBLE_OR_UNBOUNDED)
"""HiGHS's reasons for an LP with no feasible point (its variables are bounded: never unbounded)."""


def build_model(problem: Problem, cutoff_s: float | None, bubble_fraction: float
                ) -> tuple[Ilp, dict[str, list], dict[str, int]]:
    """The ILP of ``problem`` (the module docstring's variables and constraints (1)-(11), (10) where
    there is a cutoff), with its ``x`` and ``n`` variables, which a solution is read from."""
    model = Ilp()
    x = add_choice_variables(model, problem)
    n, a = add_layer_mode_variables(model, problem)
    w, v = add_mode_choice_variables(model, problem, x, n, a)
    y = add_edge_variables(model, problem, x)
    u = add_recompute_edge_variables(model, problem, y, n)
    moves, overlapped_moves = add_shared_move_variables(model, problem, y, n)
    roots = add_root_sharding_variables(model, problem, x)
    terms = priced_terms(problem, x, w) + roots
    sync = add_overlap_constraint(model, problem, terms + edge_sync_terms(problem, y) + overlapped_moves)
    add_memory_constraint(model, problem, x, w, v, roots)
    objective = set_objective(model, problem, terms, y, u, sync, moves)
    if cutoff_s is not None:
        add_cutoff(model, objective, {var for var, _ in sync}, cutoff_s, bubble_fraction)
    return model, x, n


class _Outcome(NamedTuple):
    """What the solver reads of HiGHS's result (``_solved``)."""

    reason: mathopt.TerminationReason
    limit: int  # result_pb2.LIMIT_*: what stopped a search that proved nothing (NO_SOLUTION_FOUND, FEASIBLE)
    feasible: bool  # a primal feasible solution came back
    objective: float  # its objective (in the ILP's units, ``_US``)
    values: list[float]  # its value of each variable, by index
    dual_bound: float
    nodes: int  # branch-and-bound nodes explored


def _solved(proto: model_pb2.ModelProto, node_limit: int) -> _Outcome:
    """HiGHS's result on ``proto`` through MathOpt's core solver, its output kept off stdout.

    Where we diverge from ``mathopt.solve`` (which calls the same core solver): it first rebuilds a Python
    ``Model`` from the proto, and after the solve parses the result into one Python object per variable;
    on Mixtral's 4-D meshes that parse took 11 s of the 43 s spent in MathOpt (cProfile, 340 solves), more
    than a third of HiGHS's own 30 s. Here the result's value arrays are read as they are."""
    with _native_output_dropped():
        result = core_solver.solve(proto, mathopt.SolverType.HIGHS.value,
                                   init_arguments.StreamableSolverInitArguments().to_proto(),
                                   _parameters(node_limit).to_proto(),
                                   model_parameters.ModelSolveParameters().to_proto(),
                                   None, callback.CallbackRegistration().to_proto(), None, None)
    termination = result.termination
    primal = result.solutions[0].primal_solution if result.solutions else None
    feasible = primal is not None and result.solutions[0].HasField("primal_solution") \
        and primal.feasibility_status == solution_pb2.SOLUTION_STATUS_FEASIBLE
    values = [0.0] * len(proto.variables.ids)
    if feasible:
        for index, value in zip(primal.variable_values.ids, primal.variable_values.values):
            values[index] = value
    return _Outcome(mathopt.TerminationReason(termination.reason), termination.limit, feasible,
                   primal.objective_value if feasible else math.nan, values, termination.objective_bounds.dual_bound,
                   int(result.solve_stats.node_count))


def _parameters(node_limit: int) -> mathopt.SolveParameters:
    """The relative gap, the node limit, no output (stdout belongs to ``--json``), one HiGHS thread, no
    HiGHS presolve and two of its heuristics off. One thread: the planner already searches meshes in parallel processes
    (``workers.py``), and HiGHS's own threads mostly wait on each other there (the 20 ILPs of a pinned
    Llama 3 70B took 3.9 s of wall time for 1.8 s of CPU with HiGHS's default threads on the 2-core
    development machine, 1.9 s with one; the same solutions). No presolve: the ILPs are small and already
    reduced (identical layers are one decision), and presolve cost more than it saved: the 209 ILPs of
    Llama 3 70B on 1,024 H100s took 59.3 s with it and 30.8 s without, to the same plan; the slowest
    one, a cutoff proven unbeatable, 10.0 s against 2.4 s (1,511 nodes against 18). No RINS and RENS
    heuristics (sub-MIPs around the LP solution): at the root they took most of the time of ILPs whose
    relaxation is already nearly integral, and halved it when left out (12 of that search's slowest
    ILPs, alternated: 12.3 and 14.3 s with them, 6.8 and 6.8 s without, the same optima)."""
    return mathopt.SolveParameters(
        enable_output=False, relative_gap_tolerance=RELATIVE_GAP, node_limit=node_limit,
        highs=highs_pb2.HighsOptionsProto(int_options={"threads": 1}, string_options={"presolve": "off"},
                                          bool_options={"mip_heuristic_run_rins": False,
                                                        "mip_heuristic_run_rens": False}))


class Ilp:
    """The ILP as arrays, handed to MathOpt in one ``ModelProto``: a variable is its index. (MathOpt's
    ``Model`` takes one Python call per coefficient and per bound, which cost several times the solve
    on problems of 10^4 variables.)"""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.entries: tuple[list[int], list[int], list[float]] = ([], [], [])  # row, column, coefficient
        self.objective: dict[int, float] = {}

    def var(self, lower: float, upper: float, integer: bool = False) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.lower) - 1

    def binary(self) -> int:
        return self.var(0.0, 1.0, integer=True)

    def vars(self, count: int, lower: float, upper: float, integer: bool = False) -> list[int]:
        """``count`` new variables with the same bounds, as ``var`` would make them one by one."""
        first = len(self.lower)
        self.lower.extend([lower] * count)
        self.upper.extend([upper] * count)
        self.integer.extend([integer] * count)
        return list(range(first, first + count))

    def row(self, lower: float, upper: float, terms) -> None:
        """Row ``lower <= sum coef * var <= upper``, a variable's coefficients summed where it appears twice."""
        coefs: dict[int, float] = {}
        for var, coef in terms:
            coefs[var] = coefs.get(var, 0.0) + coef
        index = len(self.row_lower)
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        rows, columns, values = self.entries
        ordered = sorted(coefs)
        rows.extend([index] * len(ordered))
        columns.extend(ordered)
        values.extend([coefs[var] for var in ordered])

    def sorted_row(self, lower: float, upper: float, columns: list[int], values: list[float]) -> None:
        """What ``row`` makes of terms whose variables are distinct and already in ascending order (the
        caller's guarantee): the hot rows (1), (2) and (11), written without merging or sorting."""
        index = len(self.row_lower)
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        rows, entry_columns, entry_values = self.entries
        rows.extend([index] * len(columns))
        entry_columns.extend(columns)
        entry_values.extend(values)

    def to_proto(self, relaxed: bool = False) -> model_pb2.ModelProto:
        """The model for MathOpt; ``relaxed``: its LP relaxation (no variable integral)."""
        proto = model_pb2.ModelProto()
        proto.variables.ids.extend(range(len(self.lower)))
        proto.variables.lower_bounds.extend(self.lower)
        proto.variables.upper_bounds.extend(self.upper)
        proto.variables.integers.extend([False] * len(self.integer) if relaxed else self.integer)
        proto.linear_constraints.ids.extend(range(len(self.row_lower)))
        proto.linear_constraints.lower_bounds.extend(self.row_lower)
        proto.linear_constraints.upper_bounds.extend(self.row_upper)
        rows, columns, values = self.entries
        proto.linear_constraint_matrix.row_ids.extend(rows)
        proto.linear_constraint_matrix.column_ids.extend(columns)
        proto.linear_constraint_matrix.coefficients.extend(values)
        ids = sorted(self.objective)
        proto.objective.linear_coefficients.ids.extend(ids)
        proto.objective.linear_coefficients.values.extend(self.objective[i] for i in ids)
        return proto


def add_choice_variables(model: Ilp, problem: Problem) -> dict[str, list]:
    """x_dk and constraint (1)."""
    x = {}
    for key, d in problem.decisions.items():
        x[key] = model.vars(len(d.options), 0.0, 1.0, integer=True)
        model.sorted_row(1.0, 1.0, x[key], [1.0] * len(x[key]))
    return x


def add_edge_variables(model: Ilp, problem: Problem, x: Mapping[str, list]) -> dict[int, list]:
    """y_epq and constraints (2), per edge a list in the order of its ``price`` pairs. y may be continuous:
    with x integral the marginals fix it. The rows come from ``shared_edge_rows``, reused by each of the
    ILPs and LP relaxations of the problems that share them."""
    y = {}
    for e_idx in range(len(problem.edges)):
        rows = shared_edge_rows(problem, e_idx)
        pairs = model.vars(rows.pairs, 0.0, 1.0)
        for pair_indices, end, options in rows.rows:
            # an end's x were made before any y, each decision's in option order, and ``edge_rows`` lists
            # options and pairs ascending: the row's variables are distinct and already sorted
            ends = x[end]
            model.sorted_row(0.0, 0.0, [ends[k] for k in options] + [pairs[i] for i in pair_indices],
                             [-1.0] * len(options) + [1.0] * len(pair_indices))
        y[e_idx] = pairs
    return y


def edge_rows(problem: Problem, edge: Edge) -> EdgeRows:
    """``edge``'s rows (2): its placement pairs and its ends' options grouped by producer placement, then
    by consumer ``Option.edge_key``, each group in the order it first appears (pairs first)."""
    by_src: dict = {}
    by_dst: dict = {}
    for i, (p, q) in enumerate(edge.price):
        by_src.setdefault(p, ([], []))[0].append(i)
        by_dst.setdefault(q, ([], []))[0].append(i)
    for k, o in enumerate(problem.decisions[edge.src].options):
        by_src.setdefault(o.strategy.outputs[edge.src_out], ([], []))[1].append(k)
    for k, o in enumerate(problem.decisions[edge.dst].options):
        by_dst.setdefault(o.edge_key(edge.slot), ([], []))[1].append(k)
    rows = [(tuple(pairs), edge.src, tuple(options)) for pairs, options in by_src.values()]
    consumer_from = len(rows)
    rows += [(tuple(pairs), edge.dst, tuple(options)) for pairs, options in by_dst.values()]
    return EdgeRows((edge.src, edge.src_out, edge.dst, edge.slot), len(edge.price), tuple(rows), consumer_from)


def shared_edge_rows(problem: Problem, e_idx: int) -> EdgeRows:
    """``edge_rows`` of ``problem``'s edge ``e_idx``, worked out once for the problems that share
    ``Problem.edge_rows`` (a mesh's, re-priced per microbatch count and staged per schedule and mode):
    which pairs and options share a row depends on the placements alone, which hashing reads through
    DTensor's Python ``__hash__``."""
    edge = problem.edges[e_idx]
    key = (edge.src, edge.src_out, edge.dst, edge.slot)
    shared = problem.edge_rows
    rows = shared.get(e_idx) if shared is not None else None
    if rows is None or rows.key != key:
        rows = edge_rows(problem, edge)
        if shared is not None:
            shared[e_idx] = rows
    return rows


def add_layer_mode_variables(model: Ilp, problem: Problem) -> tuple[dict, dict]:
    """n_m, a_m and constraint (5); none without ``layer_modes``."""
    modes = problem.layer_modes
    if modes is None:
        return {}, {}
    n = {m: model.var(0.0, modes.layers, integer=True) for m in modes.modes}
    a = {m: model.binary() for m in modes.modes if m != "none"}
    model.row(modes.layers, modes.layers, [(var, 1.0) for var in n.values()])
    for m, used in a.items():
        model.row(-math.inf, 0.0, [(n[m], 1.0), (used, -float(modes.layers))])
    return n, a


def add_mode_choice_variables(model: Ilp, problem: Problem, x: Mapping[str, list],
                              n: Mapping[str, object], a: Mapping[str, object]) -> tuple[dict, dict]:
    """w_dkm, v_dkm and constraints (6), (7), for the decisions priced per mode."""
    w: dict[tuple[str, int], dict] = {}
    v: dict[tuple[str, int], dict] = {}
    if problem.layer_modes is None:
        return w, v
    layers = float(problem.layer_modes.layers)
    for key, d in problem.decisions.items():
        if not d.options[0].by_mode:
            continue
        for k in range(len(d.options)):
            w[key, k] = {m: model.var(0.0, layers) for m in n}
            model.row(0.0, 0.0, [*((var, 1.0) for var in w[key, k].values()), (x[key][k], -layers)])
            v[key, k] = {m: model.var(0.0, 1.0) for m in a}
            for var in v[key, k].values():
                model.row(-math.inf, 0.0, [(var, 1.0), (x[key][k], -1.0)])
        for m in n:
            model.row(0.0, 0.0, [*((w[key, k][m], 1.0) for k in range(len(d.options))), (n[m], -1.0)])
        for m in a:
            model.row(0.0, 0.0, [*((v[key, k][m], 1.0) for k in range(len(d.options))), (a[m], -1.0)])
    return w, v


def add_recompute_edge_variables(model: Ilp, problem: Problem, y: Mapping[int, dict],
                                 n: Mapping[str, object]) -> dict:
    """u_epqm and constraint (8), for the edge pairs into recomputed ops with forward collectives; keyed
    (edge, pair's position in the edge's ``price``, mode)."""
    u: dict[tuple[int, int, str], object] = {}
    if problem.layer_modes is None:
        return u
    layers = float(problem.layer_modes.layers)
    for e_idx, edge in enumerate(problem.edges):
        rerun = [i for i, c in enumerate(edge.price.values()) if c.forward_comm_s]
        if not edge.recomputed_under or not rerun:
            continue
        for m in edge.recomputed_under:
            for i in rerun:  # u <= L y
                u[e_idx, i, m] = model.var(0.0, layers)
                model.row(-math.inf, 0.0, [(u[e_idx, i, m], 1.0), (y[e_idx][i], -layers)])
            # sum_F u - n_m - L sum_F y >= -L
            model.row(-layers, math.inf, [*((u[e_idx, i, m], 1.0) for i in rerun), (n[m], -1.0),
                                          *((y[e_idx][i], -layers) for i in rerun)])
    return u


def add_shared_move_variables(model: Ilp, problem: Problem, y: Mapping[int, list], n: Mapping[str, object]
                              ) -> tuple[list[tuple[int, float]], list]:
    """s_gpq, u_gpqm and constraints (11); returns their (variable, objective coefficient in seconds), and
    (variable, cost, occurrences) of the moves that run beside compute, for (3): an activation's regather the
    lowered runtime launches ahead (``Pricer.prefetched``)."""
    priced, overlapped = [], []
    layers = float(problem.layer_modes.layers) if problem.layer_modes is not None else 0.0
    for g in problem.shared:
        count = g.count(problem.edges)
        rerun = g.recomputed_under(problem.edges) if problem.layer_modes is not None else ()
        carried = [_by_move(problem.edges[e], y[e]) for e in g.edges]
        for (p, q), cost in g.price.items():
            s = model.var(0.0, 1.0)
            for by_move in carried:  # s >= sum_h y_e,p,(q,h)
                if (p, q) in by_move:  # the edge's y, ascending and made before s: a sorted row
                    carrying = by_move[p, q]
                    model.sorted_row(0.0, math.inf, [*carrying, s], [-1.0] * len(carrying) + [1.0])
            priced.append((s, count * cost.exposed_s))
            if cost.grad_sync_s:
                overlapped.append((s, cost, count))
            again = sum(cost.forward_comm_s.values())
            for m in rerun if again else ():  # u - n_m - L s >= -L
                u = model.var(0.0, layers)
                model.row(-layers, math.inf, [(u, 1.0), (n[m], -1.0), (s, -layers)])
                priced.append((u, count / layers * again))
    return priced, overlapped


def _by_move(edge: Edge, pairs: list) -> dict[tuple, list]:
    """An edge's y variables by the move they carry: (producer placement, consumer placement)."""
    found: dict[tuple, list] = {}
    for (p, (q, _)), var in zip(edge.price, pairs):
        found.setdefault((p, q), []).append(var)
    return found


def add_root_sharding_variables(model: Ilp, problem: Problem, x: Mapping[str, list]) -> list:
    """g_t and constraints (9); returns their priced terms (variable, price change, occurrences)."""
    terms = []
    for t in problem.root_terms:
        g = model.var(0.0, 1.0)
        consumer = [(x[t.consumer][k], -1.0) for k in t.options]
        root = [(x[t.root][j], -1.0) for j in t.root_options]
        model.row(-math.inf, 0.0, [(g, 1.0), *consumer])
        model.row(-math.inf, 0.0, [(g, 1.0), *root])
        model.row(-1.0, math.inf, [(g, 1.0), *consumer, *root])
        terms.append((g, t.delta, problem.decisions[t.consumer].count * t.share))
    return terms


def priced_terms(problem: Problem, x: Mapping[str, list], w: Mapping[tuple[str, int], dict]) -> list:
    """(variable, cost, occurrences) of every priced choice: ``x_dk`` with ``n_d``, or for an option
    priced per mode, ``w_dkm`` with ``n_d / L``."""
    terms = []
    for key, d in problem.decisions.items():
        for k, option in enumerate(d.options):
            if (key, k) in w:
                share = d.count / problem.layer_modes.layers
                terms.extend((w[key, k][m], option.by_mode[m], share) for m in w[key, k])
            else:
                terms.append((x[key][k], option.cost, d.count))
    return terms


def add_overlap_constraint(model: Ilp, problem: Problem, terms: list) -> list:
    """``z``, ``z'``, ``z_f`` and constraint (3), one per part of ``OverlapSlack``, and ``o``, the
    communication they overlap (3'); returns their objective terms, ``(1 - a) (z + (m - 1) z' + m z_f) + a o``.
    ``z'`` and ``z_f`` exist only where some option has work of their part (sync redone every microbatch,
    gathers prefetched in forward), ``o`` where compute slows beside a collective (``a`` > 0)."""
    m, beta = problem.microbatches, problem.overlap_fraction
    slack = {id(c): OverlapSlack.of(c, beta, m) for _, c, _ in terms}
    share = contention_share(problem.overlap_slowdown)
    parts = [(lambda s: s.last, 1.0, True),
             (lambda s: s.each, float(m - 1), m > 1 and any(c.grad_sync_per_microbatch_s for _, c, _ in terms)),
             (lambda s: s.forward, float(m), any(c.prefetched_s for _, c, _ in terms))]
    objective = []
    for part, coefficient, present in parts:
        if present:
            z = model.var(0.0, math.inf)
            model.row(0.0, math.inf, [(z, 1.0), *_weighted(terms, lambda c: -part(slack[id(c)]) * _US)])
            objective.append((z, (1.0 - share) * coefficient))
    overlapped = _weighted(terms, lambda c: -slack[id(c)].overlapped * _US)
    if share and overlapped:
        o = model.var(-math.inf, math.inf)  # free: a fractional root-sharding term may take sync below 0
        model.row(0.0, 0.0, [(o, 1.0), *overlapped])
        objective.append((o, share))
    return objective


def edge_sync_terms(problem: Problem, y: Mapping[int, list]) -> list:
    """(variable, cost, occurrences) of the edge pairs whose collectives run beside compute for (3): a
    parameter's gathers the lowered runtime issues ahead, in forward and again in backward, and an activation's
    regather it launches ahead, where no other reader shares the move (``Pricer.prefetched``); none on DTensor."""
    return [(var, cost, edge.count) for e_idx, edge in enumerate(problem.edges)
            for var, cost in zip(y[e_idx], edge.price.values()) if cost.grad_sync_s or cost.prefetched_s]


def add_memory_constraint(model: Ilp, problem: Problem, x: Mapping[str, list], w: Mapping[tuple[str, int], dict],
                          v: Mapping, roots: list) -> None:
    """Constraint (4), one row per memory row of the problem (``Problem.memory_rows``: the first and the
    last stage of a pipeline), with the working sets of (7); ``roots``: the root-sharding terms of (9),
    in the order of ``problem.root_terms``."""
    for stage in problem.memory_rows:
        terms = _memory_terms(problem, stage, x, w, v, roots) + _gathered_terms(model, problem, stage, x)
        model.row(-math.inf, problem.memory_capacity_bytes / _GIB, [(var, gib) for var, gib in terms if gib])


def _gathered_terms(model: Ilp, problem: Problem, stage: str, x: Mapping[str, list]) -> list[tuple[int, float]]:
    """(12) for memory row ``stage``: a variable ``G`` at least each unit's gathered bytes on that device,
    returned as the row's term (none when nothing can be gathered there)."""
    units = [[(x[key][k], count * option.gathered_bytes / _GIB)
              for key, count in members.items() if problem.holds(stage, key)
              for k, option in enumerate(problem.decisions[key].options) if option.gathered_bytes]
             for members in problem.gathered_units.values()]
    units = [terms for terms in units if terms]
    if not units:
        return []
    largest = model.var(0.0, math.inf)
    for terms in units:
        model.row(-math.inf, 0.0, terms + [(largest, -1.0)])
    return [(largest, 1.0)]


def _memory_terms(problem: Problem, stage: str, x: Mapping[str, list], w: Mapping[tuple[str, int], dict],
                  v: Mapping, roots: list) -> list[tuple[int, float]]:
    """(variable, GiB) of memory row ``stage``: each option's bytes on that device (``Problem.held_bytes``),
    per layer mode where the modes are open, their working sets, and the root-sharding terms'."""
    terms = []
    for key, d in problem.decisions.items():
        for k, option in enumerate(d.options):
            if (key, k) in w:
                share = d.count / problem.layer_modes.layers
                terms.extend((w[key, k][m], share * problem.held_bytes(stage, key, option.by_mode[m]) / _GIB)
                             for m in w[key, k])
            else:
                terms.append((x[key][k], d.count * problem.held_bytes(stage, key, option.cost,
                                                                      option.working_set_bytes) / _GIB))
    for (key, k), held in v.items():
        recompute_bytes = problem.decisions[key].options[k].recompute_bytes
        if problem.holds(stage, key):
            terms.extend((var, recompute_bytes[m] / _GIB) for m, var in held.items() if recompute_bytes.get(m))
    terms.extend((g, occurrences * problem.held_bytes(stage, t.consumer, delta) / _GIB)
                 for t, (g, delta, occurrences) in zip(problem.root_terms, roots))
    return terms


def set_objective(model: Ilp, problem: Problem, terms: list, y, u, sync: list,
                  moves: list[tuple[int, float]] = ()) -> list:
    """The objective; returns its (variable, coefficient) terms (``sync``: the exposed gradient sync's,
    ``add_overlap_constraint``; ``moves``: the shared moves' variables and seconds,
    ``add_shared_move_variables``)."""
    linear = _weighted(terms, lambda c: c.exposed_s * _US)
    prices = [list(edge.price.values()) for edge in problem.edges]  # in the order of y's and u's pairs
    for e_idx, edge in enumerate(problem.edges):
        linear.extend((var, edge.count * cost.exposed_s * _US)
                      for var, cost in zip(y[e_idx], prices[e_idx]) if cost.exposed_s)
    for (e_idx, i, m), var in u.items():
        again = sum(prices[e_idx][i].forward_comm_s.values())
        if again:
            linear.append((var, problem.edges[e_idx].count / problem.layer_modes.layers * again * _US))
    linear.extend((var, seconds * _US) for var, seconds in moves if seconds)
    linear.extend(sync)
    for var, coef in linear:
        model.objective[var] = coef
    return linear


def add_cutoff(model: Ilp, objective: list, sync: set, cutoff_s: float, bubble_fraction: float) -> None:
    """(10) only plans faster than the best found elsewhere: ``(1 + f) (objective - Z) + Z <= cutoff``,
    a lower bound of the step time under a pipeline bubble of ``f`` of the work (every microbatch's
    work but the exposed overlapped communication ``Z``, whose variables ``sync`` holds, is
    stretched; stage transfers only add; ``assemble.with_pipeline_time``). HiGHS's own
    ``objective_bound`` option proved unreliable through MathOpt: it returned plans above it."""
    stretched = [(var, coef if var in sync else (1.0 + bubble_fraction) * coef) for var, coef in objective]
    model.row(-math.inf, cutoff_s * _US, stretched)


def _weighted(terms: list, price) -> list:
    out = []
    for var, cost, occurrences in terms:
        coef = occurrences * price(cost)
        if coef:
            out.append((var, coef))
    return out


def evaluate(problem: Problem, choice: Mapping[str, int], layer_modes: Mapping[str, int] | None = None
             ) -> tuple[float, float]:
    """(objective seconds, memory bytes) of an assignment (with its layers' checkpointing modes when the
    problem leaves them open), by the ILP's own formulas: the memory of its largest row (4)."""
    if problem.layer_modes is not None:
        problem = problem.with_layer_modes(dict(layer_modes or {}))
    problem = problem.settled(choice)
    step = 0.0
    for key, d in problem.decisions.items():
        step += d.count * d.options[choice[key]].cost.exposed_s
    for edge in problem.edges:
        step += edge.count * edge.price[edge_pair(problem, edge, choice)].exposed_s
    step += sum(g.count(problem.edges) * c.exposed_s for g in problem.shared for c in g.taken(problem, choice))
    return step + exposed_grad_sync(problem, choice), max(problem.memory_by_stage(choice).values())


def exposed_grad_sync(problem: Problem, choice: Mapping[str, int]) -> float:
    """``Z`` of the objective at an assignment: the gradient sync and prefetched gathers left over after
    hiding behind compute, and the compute slowed beside the rest."""
    return overlap_slack(problem.settled(choice), choice).exposed_s(problem.microbatches, problem.overlap_slowdown)


def overlap_slack(problem: Problem, choice: Mapping[str, int]) -> OverlapSlack:
    """The ``OverlapSlack`` of a settled ``problem`` at an assignment: its decisions', its edges' and its shared
    moves'."""
    m, beta, slack = problem.microbatches, problem.overlap_fraction, OverlapSlack()
    for key, d in problem.decisions.items():
        slack = slack.plus(OverlapSlack.of(d.options[choice[key]].cost, beta, m, d.count))
    for edge in problem.edges:
        slack = slack.plus(OverlapSlack.of(edge.price[edge_pair(problem, edge, choice)], beta, m, edge.count))
    for g in problem.shared:
        for cost in g.taken(problem, choice):
            slack = slack.plus(OverlapSlack.of(cost, beta, m, g.count(problem.edges)))
    return slack


class Best(NamedTuple):
    choice: dict[str, int]
    step_s: float
    layer_modes: dict[str, int]  # empty unless the problem leaves checkpointing modes open


def brute_force(problem: Problem) -> Best:
    """The best feasible assignment by enumeration, layers' checkpointing modes included (tests only:
    exponential)."""
    keys = list(problem.decisions)
    best: Best | None = None
    for counts in _layer_mode_counts(problem):
        plain = problem.with_layer_modes(counts)
        for combo in itertools.product(*(range(len(problem.decisions[k].options)) for k in keys)):
            choice = dict(zip(keys, combo))
            step, memory = evaluate(plain, choice)
            if memory <= problem.memory_capacity_bytes and (best is None or step < best.step_s):
                best = Best(choice, step, counts)
    if best is None:
        raise NoFeasiblePlanError("no assignment fits memory")
    return best


def _layer_mode_counts(problem: Problem) -> Iterator[dict[str, int]]:
    """Every way of giving the problem's layers modes (one empty assignment when none are open)."""
    if problem.layer_modes is None:
        yield {}
        return
    modes, layers = problem.layer_modes.modes, problem.layer_modes.layers
    for counts in itertools.product(range(layers + 1), repeat=len(modes) - 1):
        if sum(counts) <= layers:
            yield {**dict(zip(modes, counts)), modes[-1]: layers - sum(counts)}


def least_memory(problem: Problem) -> float:
    """A lower bound of any plan's memory per device: in each memory row (``Problem.memory_rows``), every
    decision at its smallest option (and checkpointing mode), the decisions of one gathered unit at their
    smallest with its working set (12) (``_least_with_unit``), of the unit that raises it most; the
    largest row."""
    as_priced = {key: d.least_memory() for key, d in problem.decisions.items()}

    def row(stage: str) -> float:
        least = {key: as_priced[key] if problem.held_as_priced(stage, key)
                 else d.least_memory(functools.partial(problem.held_bytes, stage, key))
                 for key, d in problem.decisions.items() if problem.holds(stage, key)}
        return sum(least.values()) + max((_least_with_unit(problem, stage, members, least)
                                          for members in problem.gathered_units.values()), default=0.0)

    return max(row(stage) for stage in problem.memory_rows)


def _least_with_unit(problem: Problem, stage: str, members: Mapping[str, int], least: Mapping[str, float]) -> float:
    """How much one gathered unit's working set (12) raises row ``stage``'s bound ``least`` (per decision):
    each of its parameters at its smallest memory with its part of the working set counted, less its
    smallest memory alone. Whatever the options, the row holds at least that unit's working set."""
    raised = 0.0
    for key, count in members.items():
        if key in least:
            d = problem.decisions[key]
            raised += min(d.count * problem.held_bytes(stage, key, o.cost, o.working_set_bytes)
                          + count * o.gathered_bytes for o in d.options) - least[key]
    return raised


def least_time(problem: Problem) -> float:
    """A lower bound of the objective without building the ILP: each decision at its cheapest option,
    where an option's price includes, for every edge into it, the cheapest pair of that edge the option
    allows (each edge is charged to its reader once; an option no pair of some edge allows is never
    taken, constraint (2)) and every root-sharding term on that option that lowers a price, at its most
    (the exposed sync and the shared moves at 0). Where no option of a decision is allowed (the problem
    is infeasible, which the ILP reports), the edges are left out of the bound.
    With the cutoff row (10) it prunes a problem before its model is built."""
    if problem.layer_modes is not None:
        return 0.0  # prices per mode: the ILP's own bound is needed
    own = {key: [d.count * o.cost.exposed_s for o in d.options] for key, d in problem.decisions.items()}
    for t in problem.root_terms:
        gain = min(0.0, problem.decisions[t.consumer].count * t.share * t.delta.exposed_s)
        for k in t.options:
            own[t.consumer][k] += gain
    with_edges = {key: list(prices) for key, prices in own.items()}
    for e_idx, edge in enumerate(problem.edges):
        rows = shared_edge_rows(problem, e_idx)
        pair_prices = [cost.exposed_s for cost in edge.price.values()]
        prices = with_edges[edge.dst]
        for pair_indices, _, options in rows.rows[rows.consumer_from:]:  # one per consumer edge key
            cheapest = min((pair_prices[i] for i in pair_indices), default=math.inf)
            for k in options:
                prices[k] += edge.count * cheapest
    if any(min(prices) == math.inf for prices in with_edges.values()):
        with_edges = own
    return sum(min(prices) for prices in with_edges.values())


def infeasible_reason(problem: Problem, reason: mathopt.TerminationReason = mathopt.TerminationReason.INFEASIBLE
                      ) -> str:
    least, capacity = least_memory(problem), problem.memory_capacity_bytes
    infeasible = reason == mathopt.TerminationReason.INFEASIBLE
    if infeasible and least <= capacity:
        return (f"no plan on mesh {problem.mesh_shape} with {problem.microbatches} microbatch(es): the "
                f"cheapest placements of each op fit memory together only in combinations the edges forbid; "
                f"smallest per-op total {fmt_bytes(least)} vs capacity {fmt_bytes(capacity)}")
    if infeasible:
        return (f"no plan on mesh {problem.mesh_shape} with {problem.microbatches} microbatch(es) fits: even the "
                f"smallest placements need {fmt_bytes(least)} per device, {fmt_bytes(least - capacity)} more than "
                f"the capacity of {fmt_bytes(capacity)}")
    return (f"the solver stopped without a plan on mesh {problem.mesh_shape} ({reason.name.lower()}; "
            f"node limit {NODE_LIMIT})")
