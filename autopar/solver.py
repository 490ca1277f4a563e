"""The ILP that picks one strategy per decision on one mesh, solved with OR-Tools (HiGHS MIP).

Notation: decisions ``d`` (a graph node, or a group of identical nodes of repeated layers, ``n_d``
of them), options ``k`` of a decision with per-occurrence prices compute ``c_dk``, critical-path
communication ``m_dk``, overlappable gradient all_reduce ``g_dk``, backward compute ``b_dk`` and
memory ``M_dk``; edges ``e = (u, i) -> (v, j)`` (output ``i`` of ``u`` feeds input ``j`` of ``v``,
``n_e`` times) with resharding price ``r_e(p, q)`` for producer placement ``p`` and consumer
placement ``q``.

Variables::

    x_dk in {0,1}          decision d takes option k                     (add_choice_variables)
    y_epq in {0,1}         edge e carries placement p into placement q   (add_edge_variables)
    z >= 0                 gradient all_reduce time left exposed         (add_overlap_constraint)

Constraints::

    (1) sum_k x_dk = 1                                          one option per decision
    (2) sum_q y_epq = sum_{k: out_i(u,k) = p} x_uk   for all p   edges agree with their producer
        sum_p y_epq = sum_{k: in_j(v,k)  = q} x_vk   for all q   ... and with their consumer
    (3) z >= sum_dk n_d g_dk x_dk - beta * sum_dk n_d b_dk x_dk  gradient sync hides behind backward
    (4) sum_dk n_d M_dk x_dk <= capacity                        memory of every device (add_memory_constraint)

Objective (predicted step time)::

    min  sum_dk n_d (c_dk + m_dk) x_dk + sum_epq n_e r_e(p,q) y_epq + z

Every device runs the same program (SPMD), so one memory row bounds them all. ``y`` and ``z`` are
continuous: once ``x`` is integral, (2) fixes ``y`` to the one pair the two endpoints chose. The
objective is scaled to microseconds and memory to GiB to keep coefficients near 1 for the LP.
``evaluate`` computes the same objective for a given assignment; tests check the solver against
brute force with it. (CP-SAT was tried first: on these problems the LP-based MIP is 10x faster.)
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Mapping

from ortools.linear_solver import pywraplp

from .errors import NoFeasiblePlanError
from .problem import Problem

_US = 1e6  # objective in microseconds keeps coefficients well scaled
_GIB = 2.0**30


@dataclass(frozen=True)
class Solution:
    choice: dict[str, int]  # decision key -> option index
    status: str
    objective_s: float
    bound_s: float
    wall_s: float
    variables: int
    constraints: int

    @property
    def gap(self) -> float:
        return 0.0 if self.objective_s <= 0 else max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


@contextlib.contextmanager
def _native_stdout_to_stderr() -> Iterator[None]:
    """HiGHS can print diagnostics from C++ straight to file descriptor 1 despite ``output_flag=false``;
    stdout belongs to ``--json``, so the solve writes to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


class Pruned(Exception):
    """The problem has no solution better than ``cutoff_s``: its lower bound is already worse."""


def solve(problem: Problem, time_limit_s: float = 30.0, backend: str = "HIGHS",
          cutoff_s: float | None = None) -> Solution:
    """Optimal assignment of ``problem``. With ``cutoff_s`` (the best step time found elsewhere) the
    search stops as soon as its bound shows nothing here can beat it, and raises ``Pruned``."""
    if least_memory(problem) > problem.memory_capacity_bytes:
        raise NoFeasiblePlanError(infeasible_reason(problem))
    solver = pywraplp.Solver.CreateSolver(backend)
    if solver is None:
        raise RuntimeError(f"OR-Tools has no {backend} backend in this build")
    # No banner on stdout (``--json`` prints only JSON); a tighter gap than HiGHS's default 1e-4.
    options = "output_flag=false\nmip_rel_gap=1e-6"
    if cutoff_s is not None:  # HiGHS prunes every branch whose bound reaches it
        options += f"\nobjective_bound={cutoff_s * _US}"
    solver.SetSolverSpecificParametersAsString(options)
    solver.SetTimeLimit(int(time_limit_s * 1000))
    x = add_choice_variables(solver, problem)
    y = add_edge_variables(solver, problem, x)
    z = add_overlap_constraint(solver, problem, x)
    add_memory_constraint(solver, problem, x)
    set_objective(solver, problem, x, y, z)
    start = time.perf_counter()
    with _native_stdout_to_stderr():
        status = solver.Solve()
    wall = time.perf_counter() - start
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        if cutoff_s is not None and status == pywraplp.Solver.INFEASIBLE:
            raise Pruned(f"mesh {problem.mesh_shape}: no plan faster than {cutoff_s:.6g} s")
        raise NoFeasiblePlanError(infeasible_reason(problem, status))
    choice = {key: max(range(len(vs)), key=lambda k: vs[k].solution_value()) for key, vs in x.items()}
    objective = solver.Objective().Value() / _US
    if cutoff_s is not None and objective > cutoff_s:  # HiGHS returns its incumbent once the bound prunes all
        raise Pruned(f"mesh {problem.mesh_shape}: no plan faster than {cutoff_s:.6g} s")
    bound = solver.Objective().BestBound() / _US if status == pywraplp.Solver.FEASIBLE else objective
    return Solution(
        choice=choice,
        status="optimal" if status == pywraplp.Solver.OPTIMAL else "feasible",
        objective_s=objective,
        bound_s=min(bound, objective),
        wall_s=wall,
        variables=solver.NumVariables(),
        constraints=solver.NumConstraints(),
    )

# The model is built with OR-Tools' low-level API (SetCoefficient on rows): its operator-overloading
# API builds Python expression trees and costs more than the solve on problems of 10^5 variables.


def add_choice_variables(solver: pywraplp.Solver, problem: Problem) -> dict[str, list]:
    """x_dk and constraint (1)."""
    x = {}
    for key, d in problem.decisions.items():
        x[key] = [solver.BoolVar(f"x[{key}][{k}]") for k in range(len(d.options))]
        _row(solver, 1.0, 1.0, [(v, 1.0) for v in x[key]])
    return x


def add_edge_variables(solver: pywraplp.Solver, problem: Problem, x: Mapping[str, list]) -> dict:
    """y_epq and constraints (2). y may be continuous: with x integral the marginals fix it."""
    y = {}
    for e_idx, edge in enumerate(problem.edges):
        src, dst = problem.decisions[edge.src], problem.decisions[edge.dst]
        pairs = {pq: solver.NumVar(0.0, 1.0, "") for pq in edge.price}
        by_src: dict = {}
        by_dst: dict = {}
        for (p, q), var in pairs.items():
            by_src.setdefault(p, []).append((var, 1.0))
            by_dst.setdefault(q, []).append((var, 1.0))
        for k, o in enumerate(src.options):
            by_src.setdefault(o.strategy.outputs[edge.src_out], []).append((x[edge.src][k], -1.0))
        for k, o in enumerate(dst.options):
            by_dst.setdefault(o.edge_key(edge.slot), []).append((x[edge.dst][k], -1.0))
        for terms in (*by_src.values(), *by_dst.values()):
            _row(solver, 0.0, 0.0, terms)
        y[e_idx] = pairs
    return y


def add_overlap_constraint(solver: pywraplp.Solver, problem: Problem, x: Mapping[str, list]):
    """z and constraint (3): z - sum(sync) + beta * sum(backward) >= 0."""
    z = solver.NumVar(0.0, solver.infinity(), "z")
    terms = _weighted(problem, x, lambda c: (problem.overlap_fraction * c.backward_compute_s - c.grad_sync_s) * _US)
    _row(solver, 0.0, solver.infinity(), [(z, 1.0), *terms])
    return z


def add_memory_constraint(solver: pywraplp.Solver, problem: Problem, x: Mapping[str, list]) -> None:
    """Constraint (4)."""
    terms = _weighted(problem, x, lambda c: c.memory_bytes / _GIB)
    _row(solver, -solver.infinity(), problem.memory_capacity_bytes / _GIB, terms)


def set_objective(solver: pywraplp.Solver, problem: Problem, x, y, z) -> None:
    objective = solver.Objective()
    for var, coef in _weighted(problem, x, lambda c: c.exposed_s * _US):
        objective.SetCoefficient(var, coef)
    for e_idx, edge in enumerate(problem.edges):
        for pq, var in y[e_idx].items():
            if edge.price[pq].exposed_s:
                objective.SetCoefficient(var, edge.count * edge.price[pq].exposed_s * _US)
    objective.SetCoefficient(z, 1.0)
    objective.SetMinimization()


def _row(solver: pywraplp.Solver, lb: float, ub: float, terms) -> None:
    row = solver.Constraint(lb, ub)
    for var, coef in terms:
        row.SetCoefficient(var, row.GetCoefficient(var) + coef)


def _weighted(problem: Problem, x: Mapping[str, list], price) -> list:
    terms = []
    for key, d in problem.decisions.items():
        for k, option in enumerate(d.options):
            coef = d.count * price(option.cost)
            if coef:
                terms.append((x[key][k], coef))
    return terms


def evaluate(problem: Problem, choice: Mapping[str, int]) -> tuple[float, float]:
    """(objective seconds, memory bytes) of an assignment, by the ILP's own formulas."""
    step = memory = 0.0
    for key, d in problem.decisions.items():
        c = d.options[choice[key]].cost
        step += d.count * c.exposed_s
        memory += d.count * c.memory_bytes
    for edge in problem.edges:
        p = problem.decisions[edge.src].options[choice[edge.src]].strategy.outputs[edge.src_out]
        q = problem.decisions[edge.dst].options[choice[edge.dst]].edge_key(edge.slot)
        step += edge.count * edge.price[(p, q)].exposed_s
    return step + exposed_grad_sync(problem, choice), memory


def exposed_grad_sync(problem: Problem, choice: Mapping[str, int]) -> float:
    """``z`` of constraint (3) at an assignment: gradient sync left over after hiding behind backward."""
    sync = hide = 0.0
    for key, d in problem.decisions.items():
        c = d.options[choice[key]].cost
        sync += d.count * c.grad_sync_s
        hide += d.count * problem.overlap_fraction * c.backward_compute_s
    return max(0.0, sync - hide)


def brute_force(problem: Problem) -> tuple[dict[str, int], float]:
    """The best feasible assignment by enumeration (tests only: exponential)."""
    keys = list(problem.decisions)
    best: tuple[dict[str, int], float] | None = None
    for combo in itertools.product(*(range(len(problem.decisions[k].options)) for k in keys)):
        choice = dict(zip(keys, combo))
        step, memory = evaluate(problem, choice)
        if memory <= problem.memory_capacity_bytes and (best is None or step < best[1]):
            best = (choice, step)
    if best is None:
        raise NoFeasiblePlanError("no assignment fits memory")
    return best


def least_memory(problem: Problem) -> float:
    """A lower bound of any plan's memory per device: every decision at its smallest option."""
    return sum(d.count * min(o.cost.memory_bytes for o in d.options) for d in problem.decisions.values())


def infeasible_reason(problem: Problem, status: int = pywraplp.Solver.INFEASIBLE) -> str:
    least = least_memory(problem)
    if status == pywraplp.Solver.INFEASIBLE and least <= problem.memory_capacity_bytes:
        return (f"no plan on mesh {problem.mesh_shape} with {problem.microbatches} microbatch(es): the "
                f"cheapest placements of each op fit memory together only in combinations the edges forbid; "
                f"smallest per-op total {least / 2**30:.1f} GiB vs capacity {problem.memory_capacity_bytes / 2**30:.1f} GiB")
    if status == pywraplp.Solver.INFEASIBLE:
        return (f"no plan on mesh {problem.mesh_shape} with {problem.microbatches} microbatch(es) fits: even the smallest placements need "
                f"{least / 2**30:.1f} GiB per device, capacity is {problem.memory_capacity_bytes / 2**30:.1f} GiB")
    return f"the solver stopped without a plan on mesh {problem.mesh_shape} (status {status})"
