"""The planner: capture once, then for every candidate mesh build the ILP, solve it, keep the best.

The mesh search enumerates factorizations of the world into pipeline stages and, per stage, a
data-parallel and a tensor-parallel dimension (``pp x dp x tp``; ``mesh_candidates``). Unless pinned,
``tp`` stays inside a node (tensor parallelism all-reduces on the critical path, so it belongs on
NVLink) and ``pp`` divides the node count (stages span whole nodes; Narayanan et al., SC21). The plan's
``mesh`` is one stage's submesh. Each mesh dimension has a role that the placeholders' candidate
placements and the ``allow`` rules encode:

* ``dp``: example inputs are split on their batch dimension (``S(0)``), buffers are replicated, and
  every op downstream of the inputs keeps its output split (or partial) on this dim: each rank works
  on its own share of the batch, never on a gathered copy. Parameters are replicated (DDP; ZeRO-1/2
  with ``fsdp`` 1/2, which shard the optimizer state and gradients in ``pricing.py``), sharded
  (``fsdp=3``, FSDP) or left to the solver. The gradient all_reduce follows from the strategies.
* ``dp_replicate`` (HSDP): a second data-parallel dim across nodes over which parameters stay
  replicated while ``dp`` shards them inside a node; ops place tensors alike on both dims.
* ``tp``: example inputs are replicated and every weight matrix (parameter of 2+ dims) is split on
  this dim; the ILP picks which dim (column/row, heads, vocabulary) and how activations flow
  between them (sharded, partial, or split on the sequence) from DTensor's strategies. Constraint
  ``sp`` pins sequence parallelism: 1 keeps the norms and the residual stream split on the sequence
  over tp, 0 keeps the norms off it (``sequence_parallel.py``).

A size-1 dimension is dropped. Per mesh, ``_MeshSearch`` tries activation checkpointing modes for the
whole model (none, selective, full: more recomputation only when it lets fewer microbatches fit) and
microbatch counts (without a pipeline the fewest that fit; with one, larger counts while the bubble
shrinks faster than the kernels slow down), applying ``stages.stage_problem`` to price one device of
the pipeline. When the best plan recomputes, ``refine_layer_modes`` re-solves it with each layer's mode
a decision of the ILP: recomputing some layers, not all, often fits at less cost.
Constraints (``{"dp": 2, "tp": 2}``) pin degrees and options; the rest is searched. Meshes are solved
in order (no pipeline first) with the best step time so far as a cutoff: the solver stops on a mesh as
soon as its bound shows it cannot win, and the plan lists it under ``solver.pruned_meshes``.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
from torch import fx

from .capture import CapturedGraph, module_path
from .explain import collective_terms, explanations
from .cost_models import Cluster, adamw_step_time, usable_bytes
from .errors import BadInputError, NoFeasiblePlanError
from .placement import is_sharded
from .pricing import Pricer, global_flops, is_matmul
from .problem import Problem, Roles, build_problem, placeholder_candidates
from .sequence_parallel import norm_sites, sequence_parallel_rule, sequence_sharded
from .solver import Pruned, Solution, exposed_grad_sync, infeasible_reason, least_memory, solve
from .plan import CHECKPOINTING, MIXED, Plan
from .stages import (SCHEDULES, Staging, assign_layer_modes, checkpointing_summary, device_layers, layer_roles,
                     stage_problem)
from .strategies import LOCAL_RULES, StrategyFinder, tensor_inputs

KNOWN_CONSTRAINTS = {"dp", "tp", "pp", "sp", "fsdp", "dp_shard", "cp", "ep", "microbatches", "microbatch_size",
                     "schedule", "virtual_stages", "checkpointing", "memory_gb", "time_limit_s", "dtype"}
OVERLAP_FRACTION = 0.8
"""Share of backward compute behind which bucketed gradient all_reduce can hide (the last bucket and
the first layers' gradients cannot overlap; PyTorch DDP, Li et al., VLDB 2020)."""


@dataclass(frozen=True)
class MeshChoice:
    """A stage submesh (``dims``: name and size per dim) and how many pipeline stages share the world."""

    dims: tuple[tuple[str, int], ...]  # (name, size) per mesh dim of one stage
    stages: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    def degree(self, name: str) -> int:
        """Parallel degree of ``name``; ``dp`` counts every data-parallel rank (HSDP: replicas x shards)."""
        if name == "pp":
            return self.stages
        sizes = dict(self.dims)
        if name == "dp":
            return sizes.get("dp", 1) * sizes.get("dp_replicate", 1)
        return sizes.get(name, 1)

    def dims_named(self, *names: str) -> list[int]:
        return [i for i, (n, s) in enumerate(self.dims) if n in names and s > 1]

    def describe(self) -> dict[str, int]:
        return {**({"pp": self.stages} if self.stages > 1 else {}), **dict(self.dims)}


@dataclass
class Candidate:
    """One solved (mesh, staging, microbatch count) and its pipelined step time."""

    mesh: MeshChoice
    staging: Staging
    problem: Problem
    solution: Solution
    step_s: float  # solution.objective_s plus pipeline bubble and stage-to-stage transfers
    bubble_s: float = 0.0
    p2p_s: float = 0.0

    @property
    def layer_modes(self) -> dict[str, int]:
        """How many of a device's layers run in each checkpointing mode."""
        if self.solution.layer_modes:
            return self.solution.layer_modes
        layers = self.staging.layers_per_stage
        return {self.staging.checkpointing[0]: layers} if layers else {}

    @property
    def checkpointing(self) -> str:
        return checkpointing_summary(self.layer_modes)

    @property
    def compute_s(self) -> float:
        chosen = self.solution.choice
        problem = self.problem.settled(chosen)
        return sum(d.count * d.options[chosen[k]].cost.compute_s for k, d in problem.decisions.items())


def make_plan(
    captured: CapturedGraph, cluster: Cluster, *, model_name: str, constraints: Mapping[str, Any] | None = None,
    model_dims: Mapping[str, int] | None = None,
) -> Plan:
    """The best plan of ``captured`` on ``cluster``. ``model_dims`` (named sizes such as ``h``, ``vocab``)
    are recorded in ``plan.model["dims"]`` so that ``explain`` can write tensor sizes as formulas."""
    constraints = validate_constraints(constraints or {})
    dtype = constraints.get("dtype") or ("fp32" if cluster.device.name == "cpu" else "bf16")
    capacity = constraints["memory_gb"] * 1e9 if "memory_gb" in constraints else usable_bytes(cluster.device)
    batch = _global_batch(captured)
    results: list[Candidate] = []
    failures: list[str] = []
    pruned: list[MeshChoice] = []
    start = time.perf_counter()
    search = _MeshSearch(captured, cluster, dtype, capacity, batch, constraints)
    for mesh in _sequence_splits(captured, constraints, mesh_candidates(cluster, constraints, batch,
                                                                       captured.layer_count())):
        best = min(results, key=lambda c: c.step_s, default=None)
        if "pp" not in constraints and _pipeline_cannot_win(mesh, best, batch):
            pruned.append(mesh)
            continue
        found = search.run(mesh, best.step_s if best else None)
        if isinstance(found, MeshChoice):
            pruned.append(found)
        elif isinstance(found, str):
            failures.append(found)
        else:
            results.append(found)
    if not results:
        raise NoFeasiblePlanError(_shortfall(failures))
    results.sort(key=lambda c: c.step_s)
    refined = search.refine_layer_modes(results[0])
    if refined is not results[0]:
        results.insert(0, refined)
    plan = _to_plan(captured, cluster, model_name, dtype, results[0], results, pruned,
                    time.perf_counter() - start, constraints)
    return replace(plan, model={**plan.model, "dims": dict(model_dims)}) if model_dims else plan


def _sequence_splits(captured: CapturedGraph, constraints: Mapping[str, Any], meshes: list[MeshChoice]
                     ) -> list[MeshChoice]:
    """The meshes constraint ``sp=1`` can run on: those whose tp degree splits every norm's sequence dim
    evenly (plans keep shards equal; ``mesh_candidates`` already left out meshes without tp)."""
    if constraints.get("sp") != 1:
        return meshes
    sites = norm_sites(captured)
    if not sites:
        raise BadInputError("constraint sp=1: the model has no LayerNorm or RMSNorm over [batch, seq, hidden] "
                            "activations to split on the sequence")
    lengths = sorted({site.seq_len for site in sites})
    kept = [m for m in meshes if all(n % m.degree("tp") == 0 for n in lengths)]
    if not kept:
        degrees = sorted({m.degree("tp") for m in meshes})
        raise BadInputError(f"constraint sp=1: sequence length {', '.join(map(str, lengths))} cannot be split "
                            f"evenly over tp={' or '.join(map(str, degrees))}")
    return kept


def _pipeline_cannot_win(mesh: MeshChoice, best: Candidate | None, batch: int | None) -> bool:
    """Whether a free pipeline mesh is skipped unsolved (a pinned ``pp`` is always solved).

    A pipeline pays a bubble of at least ``(p - 1) / m_max`` of its compute and wins only by removing
    communication (data-parallel gathers and syncs across nodes, tensor parallelism wider than a
    node): when the best plan so far exposes less communication than that bubble, the mesh is
    skipped. (Skipping pipelines wherever a single-stage plan fits is unsound: a 162B GPT on 64 A100s
    fits as FSDP x TP, yet pp=8 x tp=8 is 11% faster; ``benchmarks/cost_model_validation.py``.)"""
    if mesh.stages == 1 or best is None:
        return False
    most_microbatches = (batch or 1) // mesh.degree("dp")
    compute = best.compute_s
    return compute * (mesh.stages - 1) / max(1, most_microbatches) >= best.step_s - compute


class _MeshSearch:
    """Everything one mesh's search needs: per mesh, the schedules, checkpointing modes and
    microbatch counts worth solving, each priced with its pipeline bubble."""

    def __init__(self, captured: CapturedGraph, cluster: Cluster, dtype: str, capacity: float,
                 batch: int | None, constraints: Mapping[str, Any]):
        self.captured, self.cluster, self.dtype = captured, cluster, dtype
        self.capacity, self.batch, self.constraints = capacity, batch, constraints
        self.time_limit_s = constraints.get("time_limit_s", 30.0)

    def run(self, mesh: MeshChoice, cutoff_s: float | None) -> Candidate | MeshChoice | str:
        """The best candidate on ``mesh``, the reason nothing fit, or ``mesh`` itself when its bound
        shows it cannot beat ``cutoff_s`` (the best step time of the meshes solved before it)."""
        counts = microbatch_counts(self.batch, mesh.degree("dp"), self.constraints)
        if not counts:
            pinned = ", ".join(f"{k}={self.constraints[k]}" for k in ("microbatches", "microbatch_size")
                               if k in self.constraints)
            return f"global batch {self.batch} cannot be cut into {pinned} x dp={mesh.degree('dp')}"
        pricer = pricer_for(self.cluster, mesh, self.dtype, self.constraints)
        per_m = _MicrobatchProblems(_problem_for(self.captured, mesh, pricer, self.capacity, self.constraints), pricer)
        best: Candidate | None = None
        reason, was_pruned = "", False
        fewest_fitting: int | None = None
        for staging in self._stagings(mesh):
            # more recomputation only pays when it lets fewer microbatches fit than less did
            tried = counts if fewest_fitting is None else [m for m in counts if m < fewest_fitting]
            first = next((i for i, m in enumerate(tried)
                          if least_memory(self._staged(per_m[m], staging)) <= self.capacity), None)
            if first is None:
                if tried and not reason:
                    reason = infeasible_reason(self._staged(per_m[tried[-1]], staging))
                continue
            fitting = counts[counts.index(tried[first]):]  # activations shrink with more microbatches
            fewest_fitting = fitting[0]
            found = self._best_microbatching(mesh, staging, per_m, fitting, pricer,
                                             min(cutoff_s or float("inf"), best.step_s if best else float("inf")))
            if isinstance(found, Candidate):
                best = found
            elif isinstance(found, str):
                reason = found
            else:
                was_pruned = True
        if best is not None:
            return best
        return mesh if was_pruned or not reason else reason

    def refine_layer_modes(self, best: Candidate) -> Candidate:
        """``best`` (one checkpointing mode for every layer) re-solved with each layer's mode left to the
        ILP (``solver.py`` (5)-(8)), on its mesh and microbatch count; the better of the two.

        The mesh search prices whole-model modes, which keeps each of its ILPs small and fast; the
        per-layer ILP is larger and its memory row makes it a hard knapsack (HiGHS did not prove an
        8-layer GPT's optimum in 120 s, where a uniform mode takes 1-2 s), so it runs once, on the
        winner, under the search's time limit, with SCIP, which returns its best plan when the limit
        stops it (OR-Tools' HiGHS interface returns none)."""
        if "checkpointing" in self.constraints or best.checkpointing == "none" or best.staging.layers_per_stage < 2:
            return best
        staging = replace(best.staging, checkpointing=CHECKPOINTING)
        pricer = pricer_for(self.cluster, best.mesh, self.dtype, self.constraints)
        whole = _problem_for(self.captured, best.mesh, pricer, self.capacity, self.constraints)
        problem = self._staged(whole.with_microbatches(best.problem.microbatches, pricer), staging)
        try:
            solution = solve(problem, self.time_limit_s, backend="SCIP")
        except NoFeasiblePlanError:
            return best  # the limit stopped the solver before it found a plan
        found = _with_pipeline_time(self.captured, best.mesh, staging, problem.with_layer_modes(solution.layer_modes),
                                    solution, pricer)
        return found if found.step_s < best.step_s else best

    def _stagings(self, mesh: MeshChoice) -> list[Staging]:
        layers = self.captured.layer_count()
        schedule, chunks = "none", 1
        if mesh.stages > 1:
            schedule = self.constraints.get("schedule", "1f1b")
            chunks = self.constraints.get("virtual_stages", 2 if schedule == "interleaved" else 1)
        modes = [self.constraints["checkpointing"]] if "checkpointing" in self.constraints else list(CHECKPOINTING)
        return [Staging(mesh.stages, layers, schedule, chunks, (mode,)) for mode in modes]

    def _staged(self, problem: Problem, staging: Staging) -> Problem:
        return stage_problem(problem, self.captured, staging)

    def _best_microbatching(self, mesh, staging, per_m, fitting, pricer, cutoff_s) -> Candidate | MeshChoice | str:
        """Without a pipeline the fewest microbatches that fit win (more only add cost). With one,
        more microbatches shrink the bubble: larger counts are tried while the step time improves."""
        best: Candidate | None = None
        reason = ""
        for m in fitting[:1] if mesh.stages == 1 else _pipeline_microbatch_counts(fitting, mesh.stages):
            problem = self._staged(per_m[m], staging)
            try:
                solution = solve(problem, self.time_limit_s, cutoff_s=cutoff_s)
            except Pruned:
                break  # no count can beat the cutoff once the fewest that fit cannot
            except NoFeasiblePlanError as exc:
                reason = str(exc)
                continue
            found = _with_pipeline_time(self.captured, mesh, staging, problem, solution, pricer)
            if best is not None and found.step_s >= best.step_s:
                break
            best = found
            cutoff_s = min(cutoff_s, found.step_s)
        return best if best is not None else (reason or mesh)  # mesh: pruned


MAX_PIPELINE_MICROBATCH_TRIES = 6


class _MicrobatchProblems(dict):
    """``problem.with_microbatches(m)`` per microbatch count, priced on first use (re-pricing every
    option of a large model is the costly part of trying a count)."""

    def __init__(self, whole: Problem, pricer: Pricer):
        super().__init__()
        self.whole, self.pricer = whole, pricer

    def __missing__(self, m: int) -> Problem:
        self[m] = self.whole.with_microbatches(m, self.pricer)
        return self[m]


def _pipeline_microbatch_counts(fitting: list[int], stages: int) -> list[int]:
    """Counts worth solving under a pipeline, ascending: at least ``stages`` when any fit (fewer leave
    stages idle for most of the step), each at least twice the previous, at most a handful."""
    counts = [m for m in fitting if m >= stages] or fitting[-1:]
    picked: list[int] = []
    for m in counts:
        if not picked or m >= 2 * picked[-1]:
            picked.append(m)
    return picked[:MAX_PIPELINE_MICROBATCH_TRIES]


def _with_pipeline_time(captured: CapturedGraph, mesh: MeshChoice, staging: Staging, problem: Problem,
                        solution: Solution, pricer: Pricer) -> Candidate:
    """Step time of a pipeline: each microbatch's work (the ILP's objective less the gradient sync
    exposed after the last microbatch, plus its transfers between stages) runs ``m + (p - 1) / v``
    times on the critical path (the bubble is ``(p - 1) / (v m)`` of the ideal time)."""
    if staging.stages == 1:
        return Candidate(mesh, staging, problem, solution, solution.objective_s)
    m = problem.microbatches
    transfer = sum(pricer.stage_transfer(nbytes / m, copies_dim)
                   for nbytes, copies_dim in _boundary_tensors(captured, problem, solution, pricer, mesh))
    p2p = 2 * staging.chunks * m * transfer  # activations forward, their gradients backward
    per_microbatch = (solution.objective_s - exposed_grad_sync(problem, solution.choice) + p2p) / m
    bubble = per_microbatch * m * staging.bubble_fraction(m)
    return Candidate(mesh, staging, problem, solution, solution.objective_s + p2p + bubble, bubble, p2p)


def _boundary_tensors(captured: CapturedGraph, problem: Problem, solution: Solution, pricer: Pricer,
                      mesh: MeshChoice) -> list[tuple[float, int | None]]:
    """Per tensor one layer hands the next: (bytes per device for the whole batch, the tp mesh dim if
    every rank of it holds the same copy, else None), as the solution places it."""
    roles = layer_roles(captured, problem)
    tp_dims = [i for i, n in enumerate(mesh.names) if n == "tp"]
    layers = max(1, captured.layer_count())
    out = []
    for key in sorted(roles.boundary):
        d = problem.decisions[key]
        placements = d.options[solution.choice[key]].strategy.outputs[0]
        val = captured.node(d.nodes[0]).meta["val"]
        if placements is None or not isinstance(val, torch.Tensor):
            continue
        per_layer = len(d.nodes) / layers
        copies = next((i for i in tp_dims if placements[i] == "R" and mesh.shape[i] > 1), None)
        out.append((pricer.local_bytes(val, placements) * per_layer, copies))
    return out


def microbatch_counts(batch: int | None, dp: int, constraints: Mapping[str, Any]) -> list[int]:
    """Microbatch counts m with every microbatch still split evenly over dp (batch % (m * dp) == 0),
    ascending; one count when ``microbatches`` or ``microbatch_size`` (per dp rank) is pinned."""
    if batch is None:
        return [1]
    if "microbatch_size" in constraints:
        size = constraints["microbatch_size"] * dp
        return [batch // size] if batch % size == 0 else []
    fixed = constraints.get("microbatches")
    if fixed is not None:
        return [] if batch % (fixed * dp) else [fixed]
    return [m for m in _divisors(batch // dp) if (batch // m) % dp == 0]


def _shortfall(failures: list[str]) -> str:
    if not failures:
        return "no mesh shape satisfies the constraints"
    if all("cannot be cut into" in f for f in failures):
        raise BadInputError(failures[0])
    return "no plan fits any mesh; closest: " + min((f for f in failures if "cannot be cut" not in f), key=len)


def validate_constraints(constraints: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(constraints) - KNOWN_CONSTRAINTS
    if unknown:
        raise BadInputError(f"unknown constraint(s) {', '.join(sorted(unknown))}: "
                            f"known are {', '.join(sorted(KNOWN_CONSTRAINTS))}")
    out = dict(constraints)
    for key in ("cp", "ep"):
        if int(out.get(key, 1)) != 1:
            raise BadInputError(f"constraint {key}={out[key]}: this version plans {key}=1 only "
                                "(context and expert parallelism are not implemented yet)")
    if "fsdp" in out:
        if str(out["fsdp"]) not in ("0", "1", "2", "3"):
            raise BadInputError(f"constraint fsdp={out['fsdp']!r}: expected a ZeRO stage, 0 (replicated "
                                "parameters, DDP), 1 (sharded optimizer state), 2 (and gradients) or 3 "
                                "(and parameters: FSDP)")
        out["fsdp"] = int(out["fsdp"])
    if "sp" in out:
        out["sp"] = _switch("sp", out["sp"])
    for key in ("dp", "tp", "pp", "dp_shard", "microbatches", "microbatch_size", "virtual_stages"):
        if key in out:
            out[key] = _positive(key, out[key], int)
    if out.get("sp") == 1 and out.get("tp") == 1:
        raise BadInputError("constraint sp=1 splits the norms on the sequence over the tp mesh dim: it needs "
                            "tp > 1, got tp=1")
    if "dp_shard" in out and out.get("fsdp", 3) != 3:
        raise BadInputError(f"constraint dp_shard={out['dp_shard']} (HSDP) shards parameters: it needs fsdp=3, "
                            f"got fsdp={out['fsdp']}")
    if "microbatches" in out and "microbatch_size" in out:
        raise BadInputError("constraints microbatches and microbatch_size: pin one of them (the global batch "
                            "fixes the other)")
    for key in ("memory_gb", "time_limit_s"):
        if key in out:
            out[key] = _positive(key, out[key], float)
    if out.get("dtype") not in (None, "fp32", "bf16", "fp16"):
        raise BadInputError(f"constraint dtype={out['dtype']!r}: expected fp32, bf16 or fp16")
    _check_choice(out, "checkpointing", CHECKPOINTING)
    _check_choice(out, "schedule", SCHEDULES)
    if out.get("schedule") == "interleaved" and out.get("virtual_stages", 2) < 2:
        raise BadInputError("constraint virtual_stages must be at least 2 with schedule=interleaved")
    if "virtual_stages" in out and out["virtual_stages"] > 1 and out.get("schedule", "interleaved") != "interleaved":
        raise BadInputError(f"constraint virtual_stages={out['virtual_stages']} needs schedule=interleaved")
    if "virtual_stages" in out and out["virtual_stages"] > 1:
        out["schedule"] = "interleaved"
    return out


_SWITCH = {"0": 0, "1": 1, "false": 0, "true": 1}


def _switch(key: str, value: Any) -> int:
    """An on/off constraint (``sp``) as 0 or 1, from 0, 1, true or false (any case, or a Python bool)."""
    on = _SWITCH.get(str(value).strip().lower())
    if on is None:
        raise BadInputError(f"constraint {key}={value!r}: expected 0 or 1 (or false/true)")
    return on


def _check_choice(out: dict[str, Any], key: str, allowed: tuple[str, ...]) -> None:
    if key in out:
        value = str(out[key]).lower()
        if value not in allowed:
            raise BadInputError(f"constraint {key}={out[key]!r}: expected one of {', '.join(allowed)}")
        out[key] = value


def _positive(key: str, value: Any, kind: type) -> Any:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = 0
    if number <= 0 or (kind is int and str(value).strip() != str(number)):
        raise BadInputError(f"constraint {key}={value!r}: expected a positive {'integer' if kind is int else 'number'}")
    return number


def mesh_candidates(cluster: Cluster, constraints: Mapping[str, Any], batch: int | None,
                    layers: int = 0) -> list[MeshChoice]:
    """Every ``pp x dp x tp`` factorization of the world the constraints and topology allow, pipeline
    degree first (1 first), then tensor-parallel degree. Unless pinned, ``tp`` stays inside a node
    (its all_reduces are on the critical path) and ``pp`` divides the node count (a stage spans whole
    nodes, so only stage-to-stage transfers cross the network; Narayanan et al., SC21)."""
    world = cluster.world_size
    fixed = {k: constraints.get(k) for k in ("pp", "dp", "tp")}
    if fixed["dp"] and fixed["tp"] and not fixed["pp"] and world % (fixed["dp"] * fixed["tp"]) == 0:
        fixed["pp"] = world // (fixed["dp"] * fixed["tp"])  # dp and tp pinned: the rest are stages
    _check_fixed_degrees(cluster, fixed, layers, constraints)
    out = []
    for pp in _divisors(world):
        if fixed["pp"] and pp != fixed["pp"] or not fixed["pp"] and not _free_stages_ok(pp, cluster, layers):
            continue
        for tp in _divisors(world // pp):
            dp = world // (pp * tp)
            if (fixed["tp"] and tp != fixed["tp"]) or (fixed["dp"] and dp != fixed["dp"]):
                continue
            if not fixed["tp"] and tp > cluster.devices_per_node:
                continue  # keep tensor parallelism on NVLink unless asked otherwise
            if tp == 1 and constraints.get("sp") == 1:
                continue  # sequence parallelism splits over the tp dim
            if batch is not None and batch % dp:
                if fixed["dp"]:
                    raise BadInputError(f"global batch {batch} is not divisible by dp={dp}")
                continue
            for replicas in _replica_counts(cluster, constraints, dp, tp):
                named = (("dp_replicate", replicas), ("dp", dp // replicas), ("tp", tp))
                dims = tuple((n, s) for n, s in named if s > 1) or (("dp", 1),)
                out.append(MeshChoice(dims, pp))
    if not out and constraints.get("sp") == 1:
        raise BadInputError(f"constraint sp=1 needs a tp mesh dim (tp > 1), and no mesh of the {world} devices "
                            f"of {cluster.spec} has one (tp <= {cluster.devices_per_node} devices per node"
                            + (f", global batch {batch}" if batch is not None else "") + ")")
    if not out:
        raise BadInputError(f"global batch {batch} cannot be split over any data-parallel degree of "
                            f"{world} devices with tp <= {cluster.devices_per_node}: use a batch divisible "
                            f"by {world // min(world, cluster.devices_per_node)}")
    return out


def _replica_counts(cluster: Cluster, constraints: Mapping[str, Any], dp: int, tp: int) -> list[int]:
    """HSDP replica groups to try for a data-parallel degree: 1 (plain DDP/FSDP), and, when the dp
    group leaves the node and parameters may be sharded, shard groups that fill a node's devices
    (parameter gathers on NVLink, only the gradient all_reduce across nodes; Zhao et al., VLDB 2023).
    ``dp_shard`` pins the shard group."""
    if "dp_shard" in constraints:
        shard = constraints["dp_shard"]
        if dp % shard:
            return []
        return [dp // shard]
    shard = cluster.devices_per_node // tp
    if constraints.get("fsdp", 3) != 3 or shard <= 1 or dp % shard or dp <= shard:
        return [1]
    return [1, dp // shard]


def _free_stages_ok(pp: int, cluster: Cluster, layers: int) -> bool:
    return pp == 1 or (cluster.nodes % pp == 0 and pp <= layers)


def _check_fixed_degrees(cluster: Cluster, fixed: dict[str, int | None], layers: int,
                         constraints: Mapping[str, Any]) -> None:
    world = cluster.world_size
    for key, value in fixed.items():
        if value and world % value:
            raise BadInputError(f"{key}={value} does not divide the {world} devices of {cluster.spec}")
    pinned = [v for v in fixed.values() if v]
    product = 1
    for v in pinned:
        product *= v
    if world % product or (len(pinned) == 3 and product != world):
        raise BadInputError(" x ".join(f"{k}={v}" for k, v in fixed.items() if v)
                            + f" = {product} does not fit the {world} devices of {cluster.spec}")
    pp = fixed["pp"] or 1
    chunks = constraints.get("virtual_stages", 2 if constraints.get("schedule") == "interleaved" else 1)
    if pp > 1 and chunks > 1 and pp * chunks > layers:
        raise BadInputError(f"pp={pp} with {chunks} virtual stages needs {pp * chunks} layers; the model has {layers}")
    if pp > 1 and layers == 0:
        raise BadInputError(f"pp={pp}: the model has no repeated layers to split into pipeline stages")
    if pp > layers > 0:
        raise BadInputError(f"pp={pp}: the model has only {layers} repeated layers to split into stages")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _global_batch(captured: CapturedGraph) -> int | None:
    if not captured.user_inputs:
        return None
    val = captured.node(captured.user_inputs[0]).meta["val"]
    return int(val.shape[0]) if val.ndim else None


def pricer_for(cluster: Cluster, mesh: MeshChoice, dtype: str, constraints: Mapping[str, Any]) -> Pricer:
    """The pricer of one stage of ``mesh``; ``fsdp`` 1 or 2 pins ZeRO-1/2 optimizer (and gradient) sharding."""
    zero = constraints.get("fsdp") if constraints.get("fsdp") in (1, 2) else 0
    return Pricer(cluster, mesh.shape, dtype, stages=mesh.stages, zero_stage=zero,
                  dp_dims=mesh.dims_named("dp", "dp_replicate"))


def _problem_for(captured: CapturedGraph, mesh: MeshChoice, pricer: Pricer, capacity: float,
                 constraints: Mapping[str, Any]) -> Problem:
    """The ILP of one stage under the dims' roles. ``dp`` and ``dp_replicate`` split the batch;
    parameters are replicated on ``dp_replicate`` (HSDP's replica groups) and, on ``dp``, replicated
    (fsdp 0-2), sharded (fsdp 3, and always under HSDP) or free for the solver to choose."""
    shape = mesh.shape
    dp_dims = mesh.dims_named("dp", "dp_replicate")
    shard_dims = mesh.dims_named("dp")
    replica_dims = mesh.dims_named("dp_replicate")
    tp_dims = [i for i, n in enumerate(mesh.names) if n == "tp"]
    pins_buffers = {i: "R" for i in dp_dims}
    fsdp = 3 if replica_dims else constraints.get("fsdp")
    pins_params = {i: "R" for i in (dp_dims if fsdp in (0, 1, 2) else replica_dims)}
    sharded_on_dp = shard_dims if fsdp == 3 else []
    pins_inputs = {i: ("S(0)" if n in ("dp", "dp_replicate") else "R") for i, n in enumerate(mesh.names)}
    param_candidates = placeholder_candidates(shape, pins_params)
    roles = Roles(
        param=lambda val: _split_matrices(param_candidates(val), val, tp_dims + sharded_on_dp),
        user_input=placeholder_candidates(shape, pins_inputs),
        buffer=placeholder_candidates(shape, pins_buffers),
        allow=_all_of(_batch_stays_split(captured, dp_dims), _weights_stay_split(captured, tp_dims),
                      _replicas_act_as_shards(replica_dims, shard_dims),
                      sequence_parallel_rule(captured, tp_dims, constraints.get("sp"))),
    )
    copies = {r: shard_dims[0] for r in replica_dims} if shard_dims else {}
    return build_problem(captured, StrategyFinder(shape, copies), pricer, roles, capacity, OVERLAP_FRACTION)


def _split_matrices(cands: list, val: torch.Tensor, dims: list[int]) -> list:
    """A weight matrix is split on each of ``dims`` (tp dims; dp dims under fsdp=3) when it can be."""
    if val.ndim < 2 or not dims:
        return cands
    split = [c for c in cands if all(c[d] != "R" for d in dims)]
    return split or cands


def _batch_stays_split(captured: CapturedGraph, dp_dims: list[int]):
    """Data-parallel role: ops that depend on the inputs read the data split on dp and keep their
    (non-scalar) output split there: sharded, or partial where the op reduces (a sum over the batch).
    Gathering the data on dp, or a partial output of an op that does not shrink its input, would be
    tensor parallelism on the dp dim under the wrong name (each rank computing a slice or an addend of
    the whole batch), which the role forbids."""
    on_data = _downstream_of(captured.graph, set(captured.user_inputs))

    def allow(node: fx.Node, strategy) -> bool:
        if node.name not in on_data or not dp_dims:
            return True
        out, val = strategy.outputs[0], node.meta.get("val")
        val = val[0] if isinstance(val, (tuple, list)) and val else val  # a multi-output op's main output
        if out is None or not isinstance(val, torch.Tensor) or val.ndim == 0:
            return True
        args = tensor_inputs(node)
        if any(a.name in on_data and a.meta["val"].ndim > 0 and placements[d] == "R"
               for a, placements in zip(args, strategy.inputs) for d in dp_dims):
            return False
        reduces = val.numel() < max((a.meta["val"].numel() for a in args if a.name in on_data), default=0)
        return all(out[d].startswith("S(") or (reduces and out[d].startswith("P")) for d in dp_dims)

    return allow


def _weights_stay_split(captured: CapturedGraph, tp_dims: list[int]):
    """Tensor-parallel role: an op reading a weight matrix reads it split on every tp dim, never
    gathered (gathering weights is what the dp dims with fsdp are for; on a tp dim it would turn
    tensor parallelism into sharded data parallelism under the wrong name)."""
    kinds = captured.gradient_kinds()  # "param": a parameter or a view of one (the permute before a mm)

    def allow(node: fx.Node, strategy) -> bool:
        for arg, placements in zip(tensor_inputs(node), strategy.inputs):
            if kinds[arg.name] == "param" and arg.meta["val"].ndim >= 2 and any(placements[d] == "R" for d in tp_dims):
                return False
        return True

    return allow


def _replicas_act_as_shards(replica_dims: list[int], shard_dims: list[int]):
    """HSDP: its two data-parallel dims split the work as one; every op places its tensors alike on
    both (only parameters differ: replicated across replica groups, sharded within one)."""
    pairs = [(r, s) for r in replica_dims for s in shard_dims]

    def allow(node: fx.Node, strategy) -> bool:
        placed = [p for p in (*strategy.inputs, *strategy.outputs) if p is not None]
        return all(p[r] == p[s] for p in placed for r, s in pairs)

    return allow


def _all_of(*rules):
    return lambda node, strategy: all(rule(node, strategy) for rule in rules)


def _downstream_of(graph: fx.Graph, sources: set[str]) -> set[str]:
    seen = set(sources)
    for node in graph.nodes:
        if any(a.name in seen for a in node.all_input_nodes):
            seen.add(node.name)
    return seen


# ---- assembling the Plan ------------------------------------------------------------------------

def _to_plan(captured: CapturedGraph, cluster: Cluster, model_name: str, dtype: str, best: Candidate,
             results: list[Candidate], pruned: list[MeshChoice], search_wall_s: float,
             constraints: Mapping[str, Any]) -> Plan:
    mesh, solution, staging = best.mesh, best.solution, best.staging
    problem = best.problem.settled(solution.choice)  # prices as the chosen parameter placements make them
    chosen = {key: problem.decisions[key].options[k] for key, k in solution.choice.items()}
    by_node = {n: (key, opt) for key, opt in chosen.items() for n in problem.decisions[key].nodes}
    pricer = pricer_for(cluster, mesh, dtype, constraints)
    placements = {fqn: list(by_node[name][1].strategy.outputs[0]) for name, fqn in captured.params.items()}
    return Plan(
        model={"name": model_name, "params": captured.num_params(), "layers": captured.layer_count(),
               "flops_per_step": model_flops(captured), "graph_fingerprint": fingerprint(captured),
               "dtype": dtype},
        cluster={**cluster.to_dict(), "spec": cluster.spec, "devices": cluster.world_size},
        mesh={"shape": list(mesh.shape), "dim_names": list(mesh.names)},
        degrees=_degrees(mesh, captured, by_node, pricer.zero_stage),
        pipeline=_pipeline_section(captured, best),
        checkpointing=best.checkpointing,
        recomputed_layers=_recomputed_layers(captured, best),
        placements=placements,
        inputs={name: {"placements": list(by_node[name][1].strategy.outputs[0]),
                       "shape": list(captured.node(name).meta["val"].shape),
                       "dtype": str(captured.node(name).meta["val"].dtype).replace("torch.", "")}
                for name in captured.user_inputs},
        buffers={fqn: list(by_node[name][1].strategy.outputs[0]) for name, fqn in captured.buffers.items()},
        ops=_ops(captured, problem, solution, by_node, pricer),
        predicted=_predicted(captured, cluster, best, problem, chosen, pricer),
        solver={"status": solution.status, "objective": solution.objective_s, "bound": solution.bound_s,
                "gap": solution.gap, "wall_s": solution.wall_s, "search_wall_s": search_wall_s,
                "variables": solution.variables, "constraints": solution.constraints,
                "decisions": len(problem.decisions), "meshes_tried": len(results) + len(pruned),
                "pruned_meshes": [m.describe() for m in pruned]},
        explanations=explanations(best.problem, solution.choice, _explanation_index(captured, problem)),
        candidates=[{"mesh": {"shape": list(c.mesh.shape), "dim_names": list(c.mesh.names)},
                     "degrees": {"pp": c.mesh.stages, "dp": c.mesh.degree("dp"), "tp": c.mesh.degree("tp")},
                     "microbatches": c.problem.microbatches, "schedule": c.staging.schedule,
                     "checkpointing": c.checkpointing, "layer_modes": c.layer_modes,
                     "step_time_s": c.step_s, "status": c.solution.status} for c in results],
    )


def _pipeline_section(captured: CapturedGraph, best: Candidate) -> dict[str, Any]:
    """Stages as layer ranges ``[first, last + 1)``: ``p`` of them, or ``p v`` model chunks (chunk
    ``i`` on stage ``i mod p``) when interleaved; the layers of a 1-stage plan are one range."""
    staging, m = best.staging, best.problem.microbatches
    layers = captured.layer_count()
    chunks = staging.stages * staging.chunks
    per_chunk = math.ceil(layers / chunks) if layers else 0
    ranges = [[min(i * per_chunk, layers), min((i + 1) * per_chunk, layers)] for i in range(chunks)]
    return {"stages": ranges, "schedule": staging.schedule, "virtual_stages": staging.chunks,
            "microbatches": m,
            "microbatch_size": (_global_batch(captured) or 1) // (m * best.mesh.degree("dp"))}


def _recomputed_layers(captured: CapturedGraph, best: Candidate) -> dict[str, str]:
    """Under mixed checkpointing, each recomputed layer's mode: on every device (stage), its first
    layers get the most recomputation (``stages.assign_layer_modes``)."""
    if best.checkpointing != MIXED:
        return {}
    layers = device_layers(captured, _pipeline_section(captured, best)["stages"], best.staging.stages)
    modes = assign_layer_modes(layers, best.layer_modes)
    return {layer: mode for layer, mode in modes.items() if mode != "none"}


def _ops(captured: CapturedGraph, problem: Problem, solution: Solution, by_node: dict, pricer: Pricer
         ) -> dict[str, dict[str, Any]]:
    """Each op's strategy and, per occurrence, its predicted cost (own + resharding of its inputs) and
    the collectives behind that cost (shown in closed form by ``autopar explain``)."""
    reshard = _incoming_reshard(problem, solution)
    strategy_of = lambda name: by_node[name][1].strategy  # noqa: E731
    ops = {}
    for node in captured.graph.nodes:
        if node.op == "call_function" and node.name in by_node:
            key, option = by_node[node.name]
            s, c = option.strategy, option.cost
            comm = dict(c.comm_s)
            for kind, sec in reshard.get(key, {}).items():
                comm[kind] = comm.get(kind, 0.0) + sec
            ops[node.name] = {"op": str(node.target), "module": module_path(node), "decision": key,
                              "inputs": [list(p) for p in s.inputs],
                              "outputs": [list(p) if p is not None else None for p in s.outputs],
                              "cost": {"compute_s": c.compute_s, "comm_s": comm, "grad_sync_s": c.grad_sync_s,
                                       "memory_bytes": int(c.memory_bytes)}}
            if str(node.target) in problem.unsupported_ops or node.target in LOCAL_RULES:
                ops[node.name]["local"] = True
            collectives = collective_terms(node, captured, strategy_of, pricer)
            if collectives:
                ops[node.name]["collectives"] = collectives
    return ops


def _incoming_reshard(problem: Problem, solution: Solution) -> dict[str, dict[str, float]]:
    """Per consumer decision, the resharding seconds of its inputs, per occurrence of the decision."""
    out: dict[str, dict[str, float]] = {}
    for edge in problem.edges:
        p = problem.decisions[edge.src].options[solution.choice[edge.src]].strategy.outputs[edge.src_out]
        q = problem.decisions[edge.dst].options[solution.choice[edge.dst]].edge_key(edge.slot)
        share = edge.count / problem.decisions[edge.dst].count
        for kind, sec in edge.price[(p, q)].comm_s.items():
            out.setdefault(edge.dst, {})[kind] = out.setdefault(edge.dst, {}).get(kind, 0.0) + share * sec
    return out


def _explanation_index(captured: CapturedGraph, problem: Problem) -> dict[str, str]:
    index = {}
    for key, d in problem.decisions.items():
        for name in d.nodes:
            index[name] = key
            if name in captured.params:
                index[captured.params[name]] = key
    return index


def _degrees(mesh: MeshChoice, captured: CapturedGraph, by_node: dict, zero_stage: int) -> dict[str, int]:
    """Degrees of design.md §5 (``sp`` is the tp degree when a norm's result is split on its sequence
    dim over tp: ``sequence_parallel.norm_sites``), plus ``dp_replicate`` (HSDP's replica groups, 1
    without HSDP) and, when anything is sharded over data parallelism, ``zero``: the ZeRO stage (1-2 optimizer state and
    gradients sharded, 3 parameters too); absent for DDP."""
    tp, dp = mesh.degree("tp"), mesh.degree("dp")
    fsdp = 1
    if mesh.dims_named("dp"):  # fsdp = the shard group when most parameter bytes are sharded on it
        dp_dim = mesh.names.index("dp")
        numel = {n: captured.node(n).meta["val"].numel() for n in captured.params}
        sharded = sum(numel[n] for n in captured.params if is_sharded(by_node[n][1].strategy.outputs[0][dp_dim]))
        if sharded * 2 > sum(numel.values()):
            fsdp = mesh.degree("dp") // mesh.degree("dp_replicate")
    outputs = lambda name: by_node[name][1].strategy.outputs[0] if name in by_node else None  # noqa: E731
    sp = tp if tp > 1 and sequence_sharded(norm_sites(captured), outputs, mesh.names.index("tp")) else 1
    zero = 3 if fsdp > 1 else zero_stage
    return {"dp": dp, "fsdp": fsdp, "tp": tp, "sp": sp, "cp": 1, "ep": 1, "pp": mesh.stages,
            "dp_replicate": mesh.degree("dp_replicate"), **({"zero": zero} if zero else {})}


def _predicted(captured: CapturedGraph, cluster: Cluster, best: Candidate, problem: Problem, chosen: dict,
               pricer: Pricer) -> dict[str, Any]:
    mesh = best.mesh
    compute = sync = hide = 0.0
    comm: dict[str, float] = {}
    memory = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
    for key, opt in chosen.items():
        d = problem.decisions[key]
        compute += d.count * opt.cost.compute_s
        sync += d.count * opt.cost.grad_sync_s
        hide += d.count * problem.overlap_fraction * opt.cost.backward_compute_s
        for kind, s in opt.cost.comm_s.items():
            comm[kind] = comm.get(kind, 0.0) + d.count * s
        _add_memory(memory, captured, d, opt, pricer)
    for edge in problem.edges:
        p = chosen[edge.src].strategy.outputs[edge.src_out]
        q = chosen[edge.dst].edge_key(edge.slot)
        for kind, s in edge.price[(p, q)].comm_s.items():
            comm[kind] = comm.get(kind, 0.0) + edge.count * s
    comm["p2p"] = comm.get("p2p", 0.0) + best.p2p_s
    exposed = sum(comm.values()) + max(0.0, sync - hide)
    comm["all_reduce"] = comm.get("all_reduce", 0.0) + sync
    step = best.step_s
    flops = model_flops(captured)
    peak = cluster.device.peak(pricer.dtype)
    tokens = _tokens_per_step(captured)
    return {
        "step_time_s": step,
        "tokens_per_s": tokens / step if step > 0 else 0.0,
        "mfu": flops / (step * cluster.world_size * peak) if step > 0 else 0.0,
        "compute_s": compute,
        "comm_s": {k: comm.get(k, 0.0) for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")},
        "grad_sync_s": sync,
        "exposed_comm_s": exposed,
        "bubble_s": best.bubble_s,
        "peak_memory_bytes": int(sum(memory.values())),
        "memory_bytes": {k: int(v) for k, v in memory.items()},
        "memory_capacity_bytes": problem.memory_capacity_bytes,
        "optimizer_s": _optimizer_s(captured, problem, chosen, pricer),
    }


def _optimizer_s(captured: CapturedGraph, problem: Problem, chosen: dict, pricer: Pricer) -> float:
    """Seconds of the AdamW update after a step, on one device: every parameter tensor it holds, over the
    elements whose optimizer state it keeps (its shard; under ZeRO-1/2 the share of that). Apart from
    ``step_time_s``, which prices ``pm.step`` (design.md §2: the optimizer is the caller's)."""
    seconds = 0.0
    for key, opt in chosen.items():
        d = problem.decisions[key]
        name = d.nodes[0]
        if name not in captured.params or not captured.has_node(name):
            continue
        val, placements = captured.node(name).meta["val"], opt.strategy.outputs[0]
        updated = pricer.local_numel(val, placements) / pricer.optimizer_shards(val, placements)
        seconds += d.count * adamw_step_time([updated], pricer.cluster.device, pricer.dtype)
    return seconds


def _add_memory(memory: dict, captured: CapturedGraph, d, opt, pricer: Pricer) -> None:
    first = captured.node(d.nodes[0]) if captured.has_node(d.nodes[0]) else None
    if first is not None and first.op == "placeholder" and first.name in captured.params:
        for part, b in pricer.parameter_memory(first.meta["val"], opt.strategy.outputs[0]).items():
            memory[part] += d.count * b
    else:
        memory["activations"] += d.count * opt.cost.memory_bytes


def _tokens_per_step(captured: CapturedGraph) -> float:
    if not captured.user_inputs:
        return 0.0
    val = captured.node(captured.user_inputs[0]).meta["val"]
    if val.dtype in (torch.int64, torch.int32) and val.ndim >= 2:
        return float(val.shape[0] * val.shape[1])
    return float(val.shape[0]) if val.ndim else 1.0


def model_flops(captured: CapturedGraph) -> float:
    """Matmul FLOPs of forward + backward (3x forward), the convention of MFU (PaLM, Megatron-LM)."""
    return 3.0 * sum(global_flops(n) for n in captured.graph.nodes if n.op == "call_function" and is_matmul(n))


def fingerprint(captured: CapturedGraph) -> str:
    """Identity of what a plan applies to: parameter names and shapes, input shapes and dtypes.

    Not the node list: captures on different devices differ in layout ops (a ``clone`` the meta kernels
    need and the CPU kernels do not), and the runtime follows its own graph, taking each op's placements
    from the plan by node name and letting ops the plan does not name follow their inputs.
    """
    parts = [f"{fqn}:{tuple(shape)}" for fqn, shape in sorted(captured.param_shapes().items())]
    for name in captured.user_inputs:
        val = captured.node(name).meta["val"]
        parts.append(f"{name}:{tuple(val.shape)}:{val.dtype}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
