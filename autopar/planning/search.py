"""The planner: capture once, then for every candidate mesh build the ILP, solve it, keep the best.

The candidates are the factorizations of the world into pipeline stages and, per stage, data- and
tensor-parallel mesh dims (``meshes.py``); each mesh dim's role in the ILP is ``roles.py``'s, and the
winner becomes a ``Plan`` in ``assemble.py``.

Per mesh, ``_MeshSearch`` tries activation checkpointing modes for the
whole model (``plan.CHECKPOINTING``, none to full: more recomputation only when it lets fewer
microbatches fit) and
microbatch counts (without a pipeline the fewest that fit; with one, larger counts while the bubble
shrinks faster than the kernels slow down), applying ``stages.stage_problem`` to price one device of
the pipeline; then, with the schedule free, interleaved 1F1B and zero bubble with more model chunks a
device (``_schedules``, ``_more_chunks``). A pipeline mesh is pruned only by the least bubble of the
schedules still to try there (``least_bubble``), never by 1F1B's alone. When the best plan recomputes,
``refine_layer_modes`` re-solves it, its placements kept, with each layer's mode a decision of the
ILP: recomputing some layers, not all, often fits at less cost.
Unless the ZeRO stage is pinned, a data-parallel mesh whose plan had to recompute or shard parameters
to fit, or whose fewest microbatch counts did not fit (or where nothing fit) is searched again with the
optimizer state sharded over data parallelism (ZeRO-1, Megatron-LM's distributed optimizer): it frees 12
bytes of state per parameter for a reduce_scatter and an all_gather per parameter in place of the
gradient all_reduce, which often costs less than the gathers of FSDP or the recomputation it replaces
(``_distributed_optimizer_may_help``); that second search of a mesh reads the strategies, the traced
batch and sequence dims and the resharding prices of the first (``_shared_with_earlier_search``), which
ZeRO does not change.
Where the parameters' state replicated over dp cannot fit a device at all (``must_shard_parameters``), or
memory refuses the fewest microbatch count without recomputation (``fewest_count_refused``), ZeRO-1 is
searched first and the search without it second, against ZeRO-1's step time. Elsewhere a mesh whose search
without ZeRO the cutoff prunes is searched under ZeRO-1 as well, against the same cutoff: the bound that
pruned it holds for plans without ZeRO only, and ZeRO-1's own bound prunes it again where it cannot win
either. (Llama 3 405B on 16,384 H100s: pp 16 x dp 128 x tp 8 fits its fewest count without ZeRO, is
pruned there, and under ZeRO-1 runs 5.60 s a step, where the search without this retry chose pp 8 x dp 256
x tp 8 at 6.03 s; planning took 6.5 s against 7.4, the better cutoff pruning more.)
Unless ``cp`` is pinned, when activation memory shaped the best plan (nothing fit, or it recomputes), or
its pipeline bubble is most of its step, the meshes with a context-parallel ``cp`` dim are searched as well
(``context_parallel_meshes``): splitting every sequence divides the activations, for the gathers of keys and
values, and leaves each data-parallel replica more sequences to fill its pipeline with.
Constraints (``core/constraints.py``, e.g. dp=2, tp=2) pin degrees and options; the rest is searched. Meshes are solved
in order (no pipeline first), side by side in forked processes, each with the best step time of the
meshes up to the first that found a plan and of those at least ``workers.WINDOW`` places before it as a
cutoff (until one finds a plan, they run one at a time): the solver stops on a mesh as soon as
its bound shows it cannot win, and the plan lists it under ``solver.pruned_meshes``. The window, not the
number of processes that run it, fixes every cutoff, so the plan is the same on any machine.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Mapping

from torch.distributed.tensor import Replicate

from autopar.core.axes import ZERO_AXES, MeshAxis
from autopar.core.collector import collector_paused
from autopar.core.constraints import Constraints
from autopar.ir.layers import layer_count, unalike_layers
from autopar.ir.float8 import float8_linears
from autopar.ir.capture import CapturedGraph
from autopar.cost_models import Cluster, usable_bytes
from autopar.cost_models.pipeline import SIMULATED, schedule_available
from autopar.core.errors import BadInputError, NoFeasiblePlanError
from autopar.core.units import fmt_bytes
from autopar.planning.pricing import EdgePrices, Pricer, with_fields
from autopar.planning.progress import SearchProgress
from autopar.planning.problem import Problem, with_edges
from autopar.planning.sequence_parallel import norm_sites
from autopar.planning.solver import (NODE_LIMIT, Pruned, Solution, cannot_beat, evaluate, infeasible_reason,
                                     least_memory, solve)
from autopar.core.plan import ALLGATHER, CHECKPOINTING, MULTI_CHUNK_SCHEDULES, Plan
from autopar.planning.stages import FewestHeld, Staging, stage_problem, staged_alike
from autopar.planning.assemble import Candidate, least_stage_transfers, to_plan, with_pipeline_time
from autopar.planning.meshes import MeshChoice, global_batch, mesh_candidates, microbatch_counts
from autopar.planning.workers import Workers, worker_count
from autopar.planning.roles import (MeshTrace, check_context_parallel, expert_count, mesh_cp_attention, mesh_trace,
                                    pricer_for, problem_for)

def make_plan(
    captured: CapturedGraph, cluster: Cluster, *, model_name: str, constraints: Constraints = Constraints(),
    model_dims: Mapping[str, int] | None = None, progress: SearchProgress | None = None,
) -> Plan:
    """The best plan of ``captured`` on ``cluster`` under ``constraints`` (checked when they were built).
    ``model_dims`` (named sizes such as ``h``, ``vocab``) are recorded in ``plan.model["dims"]`` so that
    ``explain`` can write tensor sizes as formulas. ``progress`` hears of each step of the search."""
    progress = progress or SearchProgress()
    dtype = constraints.dtype or ("fp32" if cluster.device.name == "cpu" else "bf16")
    capacity = constraints.memory_gb * 1e9 if constraints.memory_gb is not None else usable_bytes(cluster.device)
    batch_size = global_batch(captured)
    results: list[Candidate] = []
    failures: list[str] = []
    pruned: list[MeshChoice] = []
    start = time.perf_counter()
    search = _MeshSearch(captured, cluster, dtype, capacity, batch_size, constraints, progress)
    shortfall = _Shortfalls()
    _refuse_stages_of_unalike_layers(captured, constraints)
    _refuse_float8_without_fp8_cores(captured, cluster, constraints)
    meshes = _sequence_splits(captured, constraints, mesh_candidates(cluster, constraints, batch_size,
                                                                     layer_count(captured), expert_count(captured)))
    progress.candidates = len(meshes)

    def solve_each(meshes: list[MeshChoice]) -> list[tuple[MeshChoice, MeshOutcome]]:
        searched = []

        def task_for(i: int) -> tuple[MeshChoice, float | None] | None:
            """Mesh ``i`` and its cutoff, the best step among the results taken so far (``Workers.in_order``:
            those of the meshes ``WINDOW`` places before it and earlier); None: skipped unsolved."""
            best = min(results, key=lambda c: c.step_s, default=None)
            if constraints.pp is None and _pipeline_cannot_win(meshes[i], best, search.least_bubble(meshes[i])):
                return None
            return meshes[i], best.step_s if best else None

        with progress.showing(f"search ({workers.count} workers)") if workers.count > 1 else nullcontext():
            for i, outcome in workers.in_order(len(meshes), task_for, settles=_found_a_plan):
                if outcome is None:
                    pruned.append(meshes[i])
                    progress.skipped()
                    continue
                searched.append((meshes[i], outcome))
                shortfall.note(outcome)
                progress.add_phases(outcome.phases_s)
                found = outcome.found
                if isinstance(found, MeshChoice):
                    pruned.append(found)
                    progress.skipped()
                elif isinstance(found, str):
                    failures.append(found)
                    progress.skipped()
                else:
                    results.append(found)
                    progress.found(found.step_s, found.solution.bound_s + (found.step_s - found.solution.objective_s),
                                   " x ".join(f"{k}={v}" for k, v in found.mesh.describe().items()))
        return searched

    more: list[MeshChoice] = []
    with collector_paused(), Workers(search.search_mesh, worker_count()) as workers:
        searched = solve_each(meshes)
        if _context_parallel_may_help(constraints, results):
            more = context_parallel_meshes(captured, cluster, constraints, batch_size)
            progress.candidates += len(more)
            # cp = 1 is the smallest degree: its one-stage meshes that fit whole rule out larger ones too
            fit_whole = {_without_cp(mesh) for mesh, outcome in searched if outcome.fits_whole}
            for degree in sorted({m.size(MeshAxis.CP) for m in more}):
                group = [m for m in more if m.size(MeshAxis.CP) == degree]
                kept = [m for m in group if not _dominated_by_less_cp(m, fit_whole)]
                for _ in range(len(group) - len(kept)):
                    progress.skipped()
                pruned += [m for m in group if m not in kept]
                fit_whole |= {_without_cp(mesh) for mesh, outcome in solve_each(kept) if outcome.fits_whole}
    if not results:
        raise NoFeasiblePlanError(_shortfall(failures, shortfall.closest if not shortfall.solver_failed else None,
                                             constraints))
    listed = {mesh: i for i, mesh in enumerate([*meshes, *more])}
    pruned.sort(key=listed.__getitem__)  # in the order listed, however each was ruled out
    results.sort(key=lambda c: c.step_s)
    refined = search.refine_layer_modes(results[0])
    if refined is not results[0]:
        results.insert(0, refined)
    plan = to_plan(captured, cluster, model_name, dtype, results[0], results, pruned,
                    time.perf_counter() - start, progress.phases_s)
    return replace(plan, model={**plan.model, "dims": dict(model_dims)}) if model_dims else plan


def _found_a_plan(outcome: "MeshOutcome | None") -> bool:
    """Whether a mesh's search found a plan, whose step time the meshes after it are cut off by
    (``Workers.in_order``'s ``settles``)."""
    return outcome is not None and isinstance(outcome.found, Candidate)


BUBBLE_DOMINATES = 0.5
"""The share of a plan's step its pipeline bubble takes above which meshes with a ``cp`` dim are searched too
(``_context_parallel_may_help``)."""


def _context_parallel_may_help(constraints: Constraints, results: list[Candidate]) -> bool:
    """Whether meshes with a ``cp`` dim are searched too: ``cp`` is free and activation memory shaped
    the best plan (nothing fit, or it recomputes), which splitting every sequence over ``cp`` divides
    (``context_parallel_meshes``), or its pipeline bubble is most of its step (too few sequences a replica
    to fill the stages: a cp dim takes ranks from ``dp``, so each replica runs more microbatches; Llama 3
    405B at 128k tokens, 128 sequences on 16,384 H100s: 41.5 s a step at one microbatch without cp, 21.2 s
    on the one-stage cp=16 mesh this searches, 9.1 s with pp=16 and cp=16 pinned; ``BUBBLE_DOMINATES``).
    Elsewhere context parallelism only adds the gathers of keys and
    values, so short sequences are not searched with it."""
    if constraints.cp is not None:
        return False
    best = min(results, key=lambda c: c.step_s, default=None)
    return best is None or best.checkpointing != "none" or best.bubble_s > BUBBLE_DOMINATES * best.step_s


def _without_cp(mesh: MeshChoice) -> tuple:
    """What a cp mesh is but for its cp and dp degrees: its stages and the sizes of its other dims."""
    return mesh.stages, tuple((n, s) for n, s in zip(mesh.names, mesh.shape) if n not in (MeshAxis.CP, MeshAxis.DP_SHARD))


def _dominated_by_less_cp(mesh: MeshChoice, fit_whole: set[tuple]) -> bool:
    """Whether a one-stage mesh with a larger ``cp`` degree is skipped unsolved: a one-stage mesh searched
    before with a smaller degree (1 included: the search's own meshes, which have no cp dim) and otherwise
    the same dims (``_without_cp``: the same tp, the rest data parallel) fit its activations without
    recomputation at some microbatch count ``m`` it can run.

    At a fixed world, tp and global batch, a device holds the same tokens of a microbatch whatever the cp
    degree (``B S tp / (world m)``); what a larger degree buys is more microbatch counts (``dp`` shrinks,
    so ``B / dp`` grows), which only matter while activations do not fit. At ``m`` the larger degree
    computes the same balanced share of attention, reduces its gradients over the same dp x cp ranks, and
    gathers more of each sequence's keys and values (``(cp - 1) / cp`` of them, for ``cp`` times as many
    sequences per device): it costs more and needs more memory; at more microbatches it costs more again
    (without a pipeline the fewest that fit win, ``_best_microbatching``)."""
    return _without_cp(mesh) in fit_whole


def context_parallel_meshes(captured: CapturedGraph, cluster: Cluster, constraints: Constraints,
                            batch: int | None) -> list[MeshChoice]:
    """The meshes of every ``cp`` degree above 1 that divides the world and whose ``2 cp`` chunks divide
    the sequence, as if pinned (``mesh_candidates``), on one stage unless ``pp`` is pinned (free, pipelines
    with cp would multiply the meshes solved: seven times as many for Llama 3 405B on 16,384 GPUs), and with
    HSDP only where ``dp_shard`` is pinned (its replica groups shrink as cp grows, so no smaller degree
    rules a larger one out, ``_dominated_by_less_cp``, and they doubled the meshes of that search: 30 s
    against 23); none for a model context parallelism cannot split (``roles.check_context_parallel``)."""
    try:
        _, seq = check_context_parallel(captured, 1)
    except BadInputError:
        return []
    found = []
    for cp in range(2, min(cluster.world_size, seq) + 1):
        if cluster.world_size % cp or seq % (2 * cp):
            continue
        try:
            pinned = replace(constraints, cp=cp)
            found += [m for m in _sequence_splits(captured, pinned, mesh_candidates(cluster, pinned, batch,
                                                                                   layer_count(captured)))
                      if (m.stages == 1 or constraints.pp is not None)
                      and (m.size(MeshAxis.DP_REPLICATE) == 1 or constraints.dp_shard is not None)]
        except BadInputError:  # no mesh has this cp degree (the batch, a pinned degree, sp=1)
            continue
    return found


def _zero_one_applies(search: "_MeshSearch", mesh: MeshChoice) -> bool:
    """Whether ``mesh`` may be searched under ZeRO-1 as well: the ZeRO stage is free and the mesh has a
    ``dp`` or ``cp`` dim to shard over (``ZERO_AXES``) without HSDP's replica dim (which shards parameters
    anyway)."""
    return search.constraints.zero_stage is None and bool(mesh.dims_of(*ZERO_AXES)) \
        and mesh.size(MeshAxis.DP_REPLICATE) == 1


def _distributed_optimizer_may_help(search: "_MeshSearch", mesh: MeshChoice,
                                    found: "Candidate | MeshChoice | str") -> bool:
    """Whether ``mesh`` is searched again under ZeRO-1 (``_zero_one_applies``) after its search without: memory
    was what shaped the plan there: nothing fit, the plan recomputes or shards parameters over data or context
    parallelism (``shards_parameters_over_data_dims``), or memory refused the fewest microbatch counts at the
    least recomputation (``microbatches_raised``), where the state ZeRO-1 frees may let fewer, larger
    microbatches run, or more model chunks a device, without sharding parameters. (Mixtral 8x7B on 64 H100s: pp4
    x dp2 x ep4 x tp2 ran 32 microbatches of 1 sample, 2 chunks a device, 3,575 ms, without ZeRO; under ZeRO-1
    16 of 2, 4 chunks, 3,407 ms, the search's winner, where pp4 x dp8 x tp2 had won at 3,504 ms. Llama 3 8B, 70B
    and 405B keep their plans.) Or the cutoff pruned it: its bound holds for the plans without ZeRO only
    (ZeRO-1 frees memory), so ZeRO-1 is tried against the same cutoff (the module doc)."""
    if not _zero_one_applies(search, mesh):
        return False
    return (isinstance(found, (str, MeshChoice)) or found.checkpointing != "none" or search.microbatches_raised
            or search.shards_parameters_over_data_dims(found))


def _cutoff(best_s: float | None, found: "Candidate | MeshChoice | str") -> float | None:
    """The step time a second search of a mesh must beat: the best before it, and the mesh's first plan."""
    times = ([best_s] if best_s is not None else []) + ([found.step_s] if isinstance(found, Candidate) else [])
    return min(times) if times else None


def _gathered_attention_runs_lowered(constraints: Constraints, mesh: MeshChoice) -> bool:
    """Whether ``mesh`` is searched again with its keys and values gathered over cp (``cp_attention``
    pinned to all-gather), priced for the lowered runtime: a one-stage mesh with a cp dim whose fused
    attention is left open is priced for DTensor, which runs the ring (``roles.priced_runtime``), and
    ``autoparallelize`` runs a plan of it that gathers on the lowered program, whose prices are lower
    (the parameter gathers it prefetches beside compute)."""
    return (mesh.stages == 1 and mesh.size(MeshAxis.CP) > 1 and constraints.cp_attention is None
            and constraints.runtime is None)


def _better(first: "Candidate | MeshChoice | str", second: "Candidate | MeshChoice | str"
            ) -> "Candidate | MeshChoice | str":
    """Of two searches of one mesh: the faster plan; else a pruning (the mesh cannot win) over a failure."""
    if isinstance(second, Candidate):
        return second if not isinstance(first, Candidate) or second.step_s < first.step_s else first
    if isinstance(first, Candidate):
        return first
    return second if isinstance(second, MeshChoice) else first


def _refuse_stages_of_unalike_layers(captured: CapturedGraph, constraints: Constraints) -> None:
    """A pinned pipeline of a model whose layers are not alike, refused naming two that differ: stages are
    cut between alike layers, whose prices one layer's scale to a stage's (``layers.layer_count``), after
    any leading layers that do not repeat (``layers.repeating_layers``)."""
    unalike = unalike_layers(captured) if (constraints.pp or 1) > 1 else None
    if unalike is not None:
        raise BadInputError(f"pp={constraints.pp}: pipeline stages are cut between alike layers, and no two of this "
                            f"model's last layers repeat alike: {unalike[0]} and {unalike[1]} differ (layers are alike "
                            "when their ops and shapes are; first layers that differ go with the first stage); plan "
                            "it without pp")


def _refuse_float8_without_fp8_cores(captured: CapturedGraph, cluster: Cluster, constraints: Constraints) -> None:
    """A pinned ``fp8`` refused on a device without FP8 tensor cores (no ``fp8`` peak), or for a model none of
    whose ops the float8 rule takes (``ir/float8.py``), rather than planned as if it did nothing."""
    if constraints.fp8 is None:
        return
    if "fp8" not in cluster.device.peak_flops:
        raise BadInputError(f"fp8={constraints.fp8}: device {cluster.device.name} has no FP8 tensor cores (its peak "
                            f"FLOP/s are for {', '.join(cluster.device.peak_flops)}); float8 linears need H100, H200, "
                            "B200, or a device profile stating an fp8 peak")
    if not float8_linears(captured):
        raise BadInputError(f"fp8={constraints.fp8}: this model has no linear layer float8 can run: float8 takes the "
                            "mm/addmm of a weight both of whose dims are multiples of 16, inside the model's repeated "
                            "layers (autopar/ir/float8.py)")


def _sequence_splits(captured: CapturedGraph, constraints: Constraints, meshes: list[MeshChoice]
                     ) -> list[MeshChoice]:
    """The meshes constraint ``sp=1`` can run on: those whose tp degree splits every norm's sequence dim
    evenly (plans keep shards equal; ``mesh_candidates`` already left out meshes without tp)."""
    if constraints.sp != 1:
        return meshes
    sites = norm_sites(captured)
    if not sites:
        raise BadInputError("constraint sp=1: the model has no LayerNorm or RMSNorm over [batch, seq, hidden] "
                            "activations to split on the sequence")
    lengths = sorted({site.seq_len for site in sites})
    kept = [m for m in meshes if all(n % m.size(MeshAxis.TP) == 0 for n in lengths)]
    if not kept:
        degrees = sorted({m.size(MeshAxis.TP) for m in meshes})
        raise BadInputError(f"constraint sp=1: sequence length {', '.join(map(str, lengths))} cannot be split "
                            f"evenly over tp={' or '.join(map(str, degrees))}")
    return kept


def _pipeline_cannot_win(mesh: MeshChoice, best: Candidate | None, least_bubble: float) -> bool:
    """Whether a free pipeline mesh is skipped unsolved (a pinned ``pp`` is always solved).

    A pipeline pays a bubble of at least ``least_bubble`` of its compute (``_MeshSearch.least_bubble``:
    the least of the schedules its search may pick) and wins only by removing communication
    (data-parallel gathers and syncs across nodes, tensor parallelism wider than a node): when the best
    plan so far exposes less communication than that bubble, the mesh is skipped. (Skipping pipelines
    wherever a single-stage plan fits is unsound: a 162B GPT on 64 A100s fits as FSDP x TP, yet pp=8 x
    tp=8 is 11% faster; ``benchmarks/cost_model_validation.py``.)"""
    if mesh.stages == 1 or best is None:
        return False
    return math.isfinite(least_bubble) and best.compute_s * least_bubble >= best.step_s - best.compute_s


class _MeshSearch:
    """Everything one mesh's search needs: per mesh, the schedules, checkpointing modes and
    microbatch counts worth solving, each priced with its pipeline bubble."""

    def __init__(self, captured: CapturedGraph, cluster: Cluster, dtype: str, capacity: float,
                 batch: int | None, constraints: Constraints, progress: SearchProgress):
        self.captured, self.cluster, self.dtype = captured, cluster, dtype
        self.capacity, self.batch, self.constraints = capacity, batch, constraints
        self.progress = progress
        self._staged_problems: dict[tuple[int, tuple], tuple[Problem, Problem]] = {}  # keeps the key's problem alive
        self._solved: dict[tuple[int, tuple[str, ...], int], tuple[Staging, Solution]] = {}  # ``_solved_before``
        self._traced: dict[tuple, tuple[EdgePrices, MeshTrace]] = {}  # ``_shared_with_earlier_search``
        # ``_decided``'s, by (mesh, ZeRO stage, cp attention)
        self._decided_problems: dict[tuple[MeshChoice, int | None, str | None], tuple[Pricer, Problem]] = {}
        self.node_limit = constraints.solver_nodes if constraints.solver_nodes is not None else NODE_LIMIT
        self.closest: MemoryShortfall | None = None  # of the configurations whose least memory did not fit
        self.solver_failed = False  # a configuration whose least memory fit had no plan all the same
        self.fits_whole = False  # one stage, and its smallest placements fit with no recomputation at some count
        self.microbatches_raised = False  # memory refused the fewest microbatch counts at the least recomputation
        self.pid = os.getpid()  # of the process that plans (``search_mesh`` may run in a forked worker)

    def search_mesh(self, task: tuple[MeshChoice, float | None]) -> "MeshOutcome":
        """One mesh's whole search against ``cutoff_s`` (the best step time of the meshes searched before
        it): ``searched``, and again with keys and values gathered over cp on the lowered runtime where the
        mesh leaves its attention open (``_gathered_attention_runs_lowered``). Runs in a forked worker or
        in this process (``workers.py``); its shortfall and phase seconds come back with the outcome."""
        mesh, cutoff_s = task
        in_worker = os.getpid() != self.pid
        if in_worker:  # a worker's own clock; its seconds are added to the parent's by ``make_plan``
            self.progress = SearchProgress()
        self.closest, self.solver_failed, self.fits_whole = None, False, False
        self.microbatches_raised = False
        self._traced.clear()  # one mesh's at a time
        self._decided_problems.clear()  # one mesh's at a time
        found = self.searched(mesh, cutoff_s)
        if _gathered_attention_runs_lowered(self.constraints, mesh):
            found = _better(found, self.searched(mesh, _cutoff(cutoff_s, found), ALLGATHER))
        return MeshOutcome(found, self.closest, self.solver_failed, self.progress.phases_s if in_worker else {},
                           self.fits_whole)

    def searched(self, mesh: MeshChoice, cutoff_s: float | None, cp_attention: str | None = None
                 ) -> "Candidate | MeshChoice | str":
        """``run``, then again under ZeRO-1 where memory shaped the plan; under ZeRO-1 first where the
        parameters must be sharded (``must_shard_parameters``). ``cp_attention``: as ``run``'s."""
        if _zero_one_applies(self, mesh) and (self.must_shard_parameters(mesh) or self.fewest_count_refused(mesh)):
            found = self.run(mesh, cutoff_s, zero_stage=1, cp_attention=cp_attention)
            return _better(found, self.run(mesh, _cutoff(cutoff_s, found), cp_attention=cp_attention))
        found = self.run(mesh, cutoff_s, cp_attention=cp_attention)
        if _distributed_optimizer_may_help(self, mesh, found):
            found = _better(found, self.run(mesh, _cutoff(cutoff_s, found), zero_stage=1, cp_attention=cp_attention))
        return found

    def must_shard_parameters(self, mesh: MeshChoice) -> bool:
        """Whether every plan on ``mesh`` without ZeRO must shard parameters over its data-parallel dims
        (``ZERO_AXES``): their state (parameters, gradients, AdamW's) replicated there, split at most over
        the mesh's other dims and the largest stage holding at least ``1 / pp`` of it, needs more than a
        device has. ``searched`` then searches ZeRO-1 first: it is searched in any case
        (``_distributed_optimizer_may_help``: such a plan shards parameters, or none fits), and its step
        time, usually the better one there, is the cutoff that prunes the other search's configurations
        at their ILPs' roots; on Llama 3 70B's pipeline meshes those are its slowest ILPs (FSDP's
        placements under a tight memory row: 0.5-1.6 s each, where a root takes 0.06 s)."""
        pricer = pricer_for(self.cluster, mesh, self.dtype, self.constraints, self.captured)
        replicated = tuple(Replicate() for _ in mesh.shape)
        frozen = self.captured.frozen_parameters()
        state = sum(self.captured.weight(name) * sum(pricer.parameter_memory(
            self.captured.node(name).meta["val"], replicated, name in frozen, name in pricer.float8_weights).values())
                    for name in self.captured.params)
        zero_dims = mesh.dims_of(*ZERO_AXES)
        spread = math.prod(size for dim, size in enumerate(mesh.shape) if dim not in zero_dims) * mesh.stages
        return state / spread > self.capacity

    def fewest_count_refused(self, mesh: MeshChoice) -> bool:
        """Whether, without ZeRO, memory refuses ``mesh``'s fewest microbatch count under its first staging
        (no recomputation unless one is pinned), as ``run`` finds before it solves anything. ``searched``
        then searches ZeRO-1 first: where memory is tight its plan is the likelier winner (it frees the
        optimizer state), and its step time prunes the other search's ILPs at their roots. With no cutoff to
        beat these are the two searches ``_distributed_optimizer_may_help`` would ask for anyway (it also asks
        for ZeRO-1 where the cutoff prunes the search without it), in the order likelier to prune: a pinned
        Llama 3 70B pipeline (pp 4 x dp 4 x tp 8) solved its ILPs in 0.71 s this way against 1.59 s, to a plan of
        the same step time, when activations were priced kept whole (9 ILPs against 8 the other way since
        pointwise values are made again in backward, ``ir/rematerialize.py``). Before a pruned mesh was retried
        under ZeRO-1, this order was what kept DeepSeek-V3 at its size on 128 H100s
        (``benchmarks/published_models.py``) from losing pp 2 x dp 8 x tp 8 under ZeRO-1, 3.57 s a step, to pp 1
        x dp 16 x tp 8 at 3.66 s."""
        counts = self._counts(mesh)
        if isinstance(counts, str):
            return False
        try:
            pricer, decided = self._decided(mesh, self.constraints)
        except BadInputError:
            return False  # ``run`` says why
        fewest = replace(decided, root_terms=[]).with_microbatches(counts[0], pricer)
        return least_memory(stage_problem(fewest, self.captured, self._stagings(mesh)[0])) > self.capacity

    def _counts(self, mesh: MeshChoice) -> list[int] | str:
        """The microbatch counts ``mesh`` is searched at (those a pinned schedule runs), or why there are none."""
        dp = mesh.data_parallel_size
        counts = microbatch_counts(self.batch, dp, self.constraints)
        if not counts:
            pinned = ", ".join(f"{k}={v}" for k, v in self.constraints.to_dict().items()
                               if k in ("microbatches", "microbatch_size"))
            return f"global batch {self.batch} cannot be cut into {pinned} x dp={dp}"
        if mesh.stages > 1 and self.constraints.schedule is not None:
            counts = _runnable_counts(counts, self.constraints.schedule, mesh.stages)
            if not counts:
                return (f"schedule {self.constraints.schedule} runs m microbatches in max(1, m // {mesh.stages}) "
                        f"rounds of equal size: no count of global batch {self.batch} over dp={dp} does")
        return counts

    def _decided(self, mesh: MeshChoice, constraints: Constraints) -> tuple[Pricer, Problem]:
        """``mesh``'s pricer and problem without edges under ``constraints`` (``problem_for``), built once per
        ZeRO stage while ``mesh`` is searched (``fewest_count_refused`` and ``run`` read the same one)."""
        key = (mesh, constraints.zero_stage, constraints.cp_attention)
        if key not in self._decided_problems:
            pricer = pricer_for(self.cluster, mesh, self.dtype, constraints, self.captured)
            with self.progress.phase("build"):
                decided = problem_for(self.captured, mesh, pricer, self.capacity, constraints,
                                      self._shared_with_earlier_search(mesh, pricer, constraints), edges=False)
            self._decided_problems[key] = (pricer, decided)
        return self._decided_problems[key]

    def run(self, mesh: MeshChoice, cutoff_s: float | None, zero_stage: int | None = None,
            cp_attention: str | None = None) -> Candidate | MeshChoice | str:
        """The best candidate on ``mesh``, the reason nothing fit, or ``mesh`` itself when its bound
        shows it cannot beat ``cutoff_s`` (the best step time of the meshes solved before it).
        ``zero_stage`` overrides the constraints' ZeRO stage, ``cp_attention`` their fused attention over cp."""
        constraints = self._constraints(zero_stage, cp_attention)
        counts = self._counts(mesh)
        if isinstance(counts, str):
            return counts
        self._staged_problems.clear()  # one mesh's at a time
        self._solved.clear()
        try:
            pricer, decided = self._decided(mesh, constraints)
        except BadInputError as exc:  # a cp degree the search chose that the model cannot split
            if self.constraints.cp is not None or mesh.size(MeshAxis.CP) == 1:
                raise
            return f"mesh {mesh.describe()}: {exc}"
        # the problems without edges or root terms: memory reads only decisions (``least_memory``), and they
        # are cheap to stage
        memory = _MicrobatchProblems(replace(decided, root_terms=[]), pricer, self.progress)
        stagings = self._stagings(mesh)
        # the mesh bound on the problem without edges first (a relaxation: 24 of the 31 meshes the whole
        # problem's bound prunes in Llama 3 70B's search on 1,024 GPUs), then on the whole problem
        if cutoff_s is not None and self._cannot_win(mesh, stagings[0], decided.with_microbatches(counts[0], pricer),
                                                     cutoff_s):
            return self._pruned(mesh, counts, stagings[0], memory)
        with self.progress.phase("build"):
            whole = with_edges(decided, self.captured, pricer,
                               self._shared_with_earlier_search(mesh, pricer, constraints).priced)
        per_m = _MicrobatchProblems(whole, pricer, self.progress)
        if cutoff_s is not None and self._cannot_win(mesh, stagings[0], per_m[counts[0]], cutoff_s):
            return self._pruned(mesh, counts, stagings[0], memory)
        best: Candidate | None = None
        reason, was_pruned = "", False
        fewest_fitting: int | None = None
        least_bubble = self.least_bubble(mesh, after_first=True)
        for staging in stagings:
            # more recomputation only pays when it lets fewer microbatches fit than less did
            tried = counts if fewest_fitting is None else [m for m in counts if m < fewest_fitting]
            first = self._first_fitting(tried, staging, memory)
            if staging.checkpointing == ("none",) and first is not None and tried == counts and mesh.stages == 1:
                self.fits_whole = True  # activations kept whole fit at some microbatch count, one stage
            if first is None:
                if tried:
                    self._note_shortfall(mesh, staging, self._staged(memory[tried[-1]], staging))
                if tried and not reason:
                    reason = infeasible_reason(self._staged(memory[tried[-1]], staging))  # reads only memory
                continue
            if staging is stagings[0] and tried[first] != counts[0]:
                self.microbatches_raised = True  # ZeRO-1 may let fewer, larger microbatches fit
            fitting = counts[counts.index(tried[first]):]  # activations shrink with more microbatches
            found = self._best_microbatching(mesh, staging, per_m, fitting, pricer,
                                             min(cutoff_s or float("inf"), best.step_s if best else float("inf")),
                                             least_bubble)
            if isinstance(found, Candidate):
                # its cutoff row stretched the least bubble (``least_bubble``), so it may be slower than ``best``
                best = found if best is None or found.step_s < best.step_s else best
            elif isinstance(found, str):
                reason, self.solver_failed = found, True
                continue  # its bound without edges fit, the problem did not: let more recomputation try these counts
            else:
                was_pruned = True
            fewest_fitting = fitting[0]
        if best is not None and mesh.stages > 1:
            for schedule, chunk_counts in self._schedules(best.staging.layers, mesh.stages):
                best = self._more_chunks(mesh, best, schedule, chunk_counts, counts, per_m, memory, pricer, cutoff_s)
        if best is not None and best.step_s < (cutoff_s or math.inf):
            return best
        return mesh if was_pruned or best is not None or not reason else reason

    def _pruned(self, mesh: MeshChoice, counts: list[int], first: Staging, memory: "_MicrobatchProblems") -> MeshChoice:
        """``mesh``, which its bound shows cannot win, noting whether its activations fit whole there
        (one stage, no recomputation: ``fits_whole``, which rules out larger cp degrees; kept where the
        mesh's other search, with or without ZeRO-1, found so)."""
        self.fits_whole = self.fits_whole or mesh.stages == 1 and first.checkpointing == ("none",) \
            and self._first_fitting(counts, first, memory) is not None
        return mesh

    def _shared_with_earlier_search(self, mesh: MeshChoice, pricer: Pricer, constraints: Constraints) -> MeshTrace:
        """``mesh``'s ``MeshTrace``, and its resharding prices shared with ``pricer``: made by the mesh's first
        search, kept for its second (under ZeRO-1, or without it: ``searched``), which reads the same
        strategies, reshardings and prices of what reads no weight (``MeshTrace.priced``); only parameter pins,
        their state and their gradient sync differ."""
        key = (mesh, pricer.runtime, mesh_cp_attention(pricer, constraints))
        if key in self._traced:
            prices, trace = self._traced[key]
            pricer.share_edge_prices(prices)
            return trace
        trace = mesh_trace(self.captured, mesh, mesh_cp_attention(pricer, constraints))
        self._traced[key] = (pricer.edge_prices(), trace)
        return trace

    def _cannot_win(self, mesh: MeshChoice, first: Staging, fewest: Problem, cutoff_s: float) -> bool:
        """Whether no configuration of ``mesh`` can beat ``cutoff_s``, by one LP relaxation: ``fewest`` (its
        problem at the fewest microbatches the batch allows) without recomputation and without its memory
        row, stretched by the least bubble any schedule of the search has there (``least_bubble``).

        That problem's objective bounds every configuration's from below, placement by placement: more
        microbatches only add to a price (a kernel run ``m`` times on ``1/m`` of the batch is no faster in
        all, parameter gathers and per-microbatch syncs repeat, and the gradient sync hides behind a
        shorter last backward; reshardings move the same bytes), a recomputing mode only adds forward
        time, the schedules differ in the bubble, the activations in flight and the stage-to-stage sends,
        which only add, and memory only takes plans away. So where its relaxation proves the cutoff
        unbeatable (``solver.cannot_beat``), the mesh's search of modes, counts and schedules (each ILP
        pruned at its own root, 8 to 11 of them on a 4-D MoE mesh) is skipped. ``fewest`` may be the
        problem without its edges (``problem.build_problem``), whose objective bounds the whole one's."""
        bound = replace(first, checkpointing=("none",))
        problem = with_fields(self._staged(fewest, bound), memory_capacity_bytes=math.inf)
        with self.progress.phase("solve"):
            return cannot_beat(problem, cutoff_s, self.least_bubble(mesh))

    def _schedules(self, layers: int, stages: int) -> list[tuple[str, list[int]]]:
        """The pipeline schedules a mesh of ``stages`` stages is searched under, each with the model chunks a
        device it tries, in the order they are tried: the first is the one ``_stagings`` starts from.

        A pinned schedule with its chunks (``virtual_stages``) is the only one; interleaved 1F1B pinned
        without them tries ``interleaving_chunks`` from 2 on. With the schedule free: 1F1B, then
        torch's zero-bubble schedule with 1 chunk and as many as interleaved may have (where the installed
        torch has it), then interleaved 1F1B (``interleaving_chunks``): zero bubble's third of the bubble
        at as many chunks makes it the likelier winner, whose step then prunes the interleaved tries that
        cannot beat it (a zero-bubble plan may still lose to an interleaved one on memory: it holds the
        last chunk's activations for ``p`` microbatches). GPipe is not tried: its bubble is 1F1B's and it
        holds every microbatch's activations, so it never wins."""
        more = interleaving_chunks(layers, stages)
        if self.constraints.schedule is None:
            zero_bubble = [("zero_bubble", [1, *more])] if schedule_available("zero_bubble") else []
            return [("1f1b", [1]), *zero_bubble, ("interleaved", more)]
        if self._chunks_free():
            return [("interleaved", sorted({self.constraints.model_chunks, *more}))]
        return [(self.constraints.pipeline_schedule, [self.constraints.model_chunks])]

    def least_bubble(self, mesh: MeshChoice, after_first: bool = False) -> float:
        """The least bubble fraction a pipeline on ``mesh`` can have under the schedules its search may pick
        (``_schedules``; ``after_first``: only those ``_more_chunks`` tries after the first), each at its
        most chunks and at the most microbatches the batch allows it (a bubble only shrinks as they grow:
        ``(p - 1) / (v m)``, and zero bubble's ``(p - 1) / (3 v m)`` lower bound, which is its simulated
        bubble there, ``Staging.least_bubble_fraction``: simulating the largest tables cost seconds a
        mesh). Infinite where there are none.

        The search prunes a pipeline mesh by it: at 1F1B's counts the ILP's cutoff row stretches a plan
        by this bubble, not 1F1B's, so a mesh 1F1B cannot win on is still searched under the schedules
        with less bubble (zero bubble has about a third of 1F1B's), and ``_pipeline_cannot_win`` skips
        a mesh unsolved only where no schedule could win."""
        if mesh.stages == 1:
            return 0.0
        counts = microbatch_counts(self.batch, mesh.data_parallel_size, self.constraints)
        layers = layer_count(self.captured)
        schedules = self._schedules(layers, mesh.stages)
        if after_first:
            first, *rest = schedules
            schedules = [(first[0], first[1][1:]), *rest]
        least = math.inf
        for schedule, chunk_counts in schedules:
            allowed = _runnable_counts(counts, schedule, mesh.stages)
            if allowed and chunk_counts:
                staging = Staging(mesh.stages, layers, schedule, max(chunk_counts))
                least = min(least, staging.least_bubble_fraction(allowed[-1]))
        return least

    def _more_chunks(self, mesh: MeshChoice, best: Candidate, schedule: str, chunk_counts: list[int],
                     counts: list[int], per_m: "_MicrobatchProblems", memory: "_MicrobatchProblems", pricer: Pricer,
                     cutoff_s: float | None) -> Candidate:
        """``best`` against ``schedule`` with each of ``chunk_counts`` model chunks per device (ascending), in
        ``best``'s checkpointing mode, until a count no longer fits (more chunks hold more activations in
        flight) or its plan is slower than the one before under ``schedule``. Interleaving ``v`` chunks
        divides the bubble by ``v`` for ``v`` times the stage-to-stage sends; zero bubble (simulated from
        torch's table, ``cost_models/pipeline.py``) has about a third of 1F1B's bubble at equal ``v``, for
        the last chunk's activations held until its deferred weight gradients run. A count whose step
        could not beat ``best`` even with that bubble's whole saving at ``best``'s microbatch count, and
        no more sends, is not solved."""
        allowed = _runnable_counts(counts, schedule, mesh.stages)
        m, previous = best.problem.microbatches, math.inf
        bound = self._chunk_bound(mesh, best.staging, schedule, chunk_counts, per_m, pricer)
        for chunks in chunk_counts:
            if (schedule, chunks) == (best.staging.schedule, best.staging.chunks):
                previous = best.step_s  # solved (the first schedule ``_stagings`` searched)
                continue
            cutoff = min(cutoff_s or math.inf, best.step_s)
            staging = replace(best.staging, schedule=schedule, chunks=chunks)
            if (m in allowed or schedule not in SIMULATED) and best.step_s - best.bubble_s * (
                    1 - staging.least_bubble_fraction(m) / best.staging.bubble_fraction(m)) >= cutoff:
                continue
            first = self._first_fitting(allowed, staging, memory)
            if first is None:
                break
            bounded = bound is not None and chunks in bound.staging.among
            found = self._best_microbatching(mesh, staging, per_m, allowed[first:], pricer, cutoff,
                                             bound=bound if bounded else None)
            if isinstance(found, Candidate):
                if found.step_s >= previous:
                    break
                previous = found.step_s
                best = found if found.step_s < best.step_s else best
        return best

    def _chunk_bound(self, mesh: MeshChoice, solved: Staging, schedule: str, chunk_counts: list[int],
                     per_m: "_MicrobatchProblems", pricer: Pricer) -> "_ChunkBound | None":
        """The bound ``_more_chunks`` prunes ``schedule``'s microbatch counts by, over those of its
        ``chunk_counts`` not yet solved that hold as many layers a device as ``solved`` (its price is
        theirs); None where fewer than two are left (one LP each would then cost what it saves)."""
        among = tuple(v for v in chunk_counts if (schedule, v) != (solved.schedule, solved.chunks)
                      and replace(solved, schedule=schedule, chunks=v).layers_per_stage == solved.layers_per_stage)
        if len(among) < 2:
            return None
        staging = FewestHeld(solved.stages, solved.layers, schedule, min(among), solved.checkpointing, among)
        return _ChunkBound(self, mesh, staging, per_m, pricer)

    def _chunks_free(self) -> bool:
        """Whether the schedule is pinned to interleaved 1F1B with its chunks a device left free (the search
        starts at 2, ``Constraints.model_chunks``, and tries more as ``_more_chunks`` does)."""
        return self.constraints.schedule == "interleaved" and self.constraints.virtual_stages is None

    def _constraints(self, zero_stage: int | None, cp_attention: str | None = None) -> Constraints:
        """The constraints, with ``zero_stage`` and ``cp_attention`` (each when given) in place of theirs."""
        changes = {"zero_stage": zero_stage, "cp_attention": cp_attention}
        return replace(self.constraints, **{key: value for key, value in changes.items() if value is not None})

    def shards_parameters_over_data_dims(self, candidate: Candidate) -> bool:
        """Whether ``candidate`` splits any parameter over a dim whose ranks read the same weights, ``dp`` or
        ``cp`` (FSDP over either, as torchtitan shards over both): the dims ZeRO-1 splits the optimizer
        state over instead (``ZERO_AXES``)."""
        zero_dims = candidate.mesh.dims_of(*ZERO_AXES)
        params = set(self.captured.params)
        for key, decision in candidate.problem.decisions.items():
            if params.intersection(decision.nodes):
                placements = decision.options[candidate.solution.choice[key]].strategy.outputs[0]
                if any(not placements[i].is_replicate() for i in zero_dims):
                    return True
        return False

    def _note_shortfall(self, mesh: MeshChoice, staging: Staging, problem: Problem) -> None:
        """Keep the configuration that came closest to fitting memory (its most microbatches)."""
        need = least_memory(problem)
        if self.closest is None or need < self.closest.need_bytes:
            self.closest = MemoryShortfall(need, self.capacity, mesh.describe(), problem.microbatches,
                                           "/".join(staging.checkpointing))

    def refine_layer_modes(self, best: Candidate) -> Candidate:
        """``best`` (one checkpointing mode for every layer) with each layer's mode chosen between none and
        ``best``'s (``solver.py`` (5)-(8)), on its mesh, microbatch count and placements; the better of the
        two: some layers recompute as the winner does and the rest keep their activations (what
        Megatron-LM's ``--recompute-num-layers`` sets by hand).

        The mesh search prices whole-model modes, which keeps each of its ILPs small; this ILP holds every
        decision to the winner's option (``Problem.with_choice``), so what is left is a knapsack over the
        layers' modes that the solver settles at its root. Where we diverge from a per-layer ILP with the
        placements open as well (what this did until 2026-12-03): that one is a hard knapsack over
        thousands of placement variables, stopped by a node limit, and it found the same plan in every case
        measured (tiny GPT and Llama at 4-8 layers under 18 memory budgets, Llama 3 70B and 405B), at 20x
        the time on Llama 3 405B at 128k tokens (16 s against 0.8 s, the search's largest share)."""
        if self.constraints.checkpointing is not None or best.checkpointing == "none" \
                or best.staging.layers_per_stage < 2:
            return best
        staging = replace(best.staging, checkpointing=("none", best.checkpointing))
        pricer = best.pricer
        whole = problem_for(self.captured, best.mesh, pricer, self.capacity,
                            self._constraints(pricer.zero_stage or None))
        problem = self._staged(whole.with_microbatches(best.problem.microbatches, pricer), staging)
        choice = _same_options(best, problem)
        try:
            with self.progress.phase("refine"):
                solution = replace(solve(problem.with_choice(choice), self.node_limit), choice=choice)
        except NoFeasiblePlanError:
            return best  # the node limit stopped the solver before it found a plan
        found = with_pipeline_time(self.captured, best.mesh, staging, problem.with_layer_modes(solution.layer_modes),
                                    solution, pricer)
        return found if found.step_s < best.step_s else best

    def _stagings(self, mesh: MeshChoice) -> list[Staging]:
        layers = layer_count(self.captured)
        schedule, chunks = "none", 1
        if mesh.stages > 1:
            schedule, chunks = self.constraints.pipeline_schedule, self.constraints.model_chunks
        pinned = self.constraints.checkpointing
        modes = [pinned] if pinned is not None else list(CHECKPOINTING)
        return [Staging(mesh.stages, layers, schedule, chunks, (mode,)) for mode in modes]

    def _first_fitting(self, counts: list[int], staging: Staging, per_m: "_MicrobatchProblems") -> int | None:
        """The index in ``counts`` (ascending) of the fewest microbatches whose smallest placements fit
        memory, by bisection: activations shrink as the count grows, so what fits at ``m`` fits above."""
        fits = lambda i: least_memory(self._staged(per_m[counts[i]], staging)) <= self.capacity  # noqa: E731
        low, high = 0, len(counts)
        while low < high:
            middle = (low + high) // 2
            if fits(middle):
                high = middle
            else:
                low = middle + 1
        return low if low < len(counts) else None

    def _staged(self, problem: Problem, staging: Staging) -> Problem:
        """``stage_problem``, once per problem and stagings alike (``staged_alike``): the fitting search, the
        solves and the schedules that hold as many microbatches in flight share it."""
        key = (id(problem), staged_alike(staging, problem.microbatches))
        if key not in self._staged_problems:
            with self.progress.phase("build"):
                self._staged_problems[key] = (problem, stage_problem(problem, self.captured, staging))
        return self._staged_problems[key][1]

    def _best_microbatching(self, mesh: MeshChoice, staging: Staging, per_m: "_MicrobatchProblems", fitting: list[int],
                            pricer: Pricer, cutoff_s: float, least_bubble: float = math.inf,
                            bound: "_ChunkBound | None" = None) -> Candidate | MeshChoice | str:
        """Without a pipeline the fewest microbatches that fit win (more only add cost). With one,
        more microbatches shrink the bubble: larger counts are tried while the step time improves.
        ``bound``: the counts at which no chunk count of ``staging``'s schedule can beat the cutoff
        (skipped unsolved)."""
        best: Candidate | None = None
        reason = ""
        counts = fitting[:1] if mesh.stages == 1 else _pipeline_microbatch_counts(fitting, mesh.stages)
        if bound is None and self._counts_cannot_win(mesh, staging, per_m, counts, pricer, cutoff_s, least_bubble):
            return mesh
        for m in counts:
            if bound is not None and bound.cannot_win(m, cutoff_s):
                continue
            bubble = min(staging.bubble_fraction(m), least_bubble)  # what the cutoff stretches
            problem = self._staged(per_m[m], staging)
            try:
                solution = self._solved_before(per_m[m], staging, problem, cutoff_s)
                if solution is None:
                    sends = least_stage_transfers(self.captured, problem, staging, pricer, mesh)
                    with self.progress.phase("solve"):  # a step also pays its sends, stretched by the bubble
                        solution = solve(problem, self.node_limit, cutoff_s=cutoff_s - (1.0 + bubble) * sends,
                                         bubble_fraction=bubble)
                    self._solved[_solved_key(per_m[m], staging)] = (staging, solution)
                elif with_pipeline_time(self.captured, mesh, staging, problem, solution, pricer).step_s >= cutoff_s:
                    raise Pruned(f"mesh {problem.mesh_shape}: no plan faster than {cutoff_s:.6g} s")
            except Pruned:
                continue  # the cutoff counts this count's bubble; more microbatches shrink it
            except NoFeasiblePlanError as exc:
                reason = str(exc)
                continue
            found = with_pipeline_time(self.captured, mesh, staging, problem, solution, pricer)
            if best is not None and found.step_s >= best.step_s:
                break
            best = found
            cutoff_s = min(cutoff_s, found.step_s)
        return best if best is not None else (reason or mesh)  # mesh: pruned

    def _counts_cannot_win(self, mesh: MeshChoice, staging: Staging, per_m: "_MicrobatchProblems", counts: list[int],
                           pricer: Pricer, cutoff_s: float, least_bubble: float) -> bool:
        """Whether no count of ``counts`` (ascending) can beat ``cutoff_s`` under ``staging``, proven by one LP
        relaxation where there are two counts or more (``_best_microbatching`` would prune each at its own
        LP): the problem at the fewest count, whose prices are each count's least (``_cannot_win``: more
        microbatches only add to a price), without its memory rows, stretched by the least bubble any count
        has (the most microbatches', or a later schedule's, ``least_bubble``) and paying the fewest count's
        stage transfers, which grow with the count (a latency per microbatch). On a pinned Llama 3 70B
        pipeline (pp 4 x dp 4 x tp 8) the recomputing modes' 22 counts, each pruned at its own root, became 4
        LPs: 5 problems solved and 15 LPs, where 27 and 10 were."""
        if len(counts) < 2 or math.isinf(cutoff_s):
            return False
        fewest = with_fields(self._staged(per_m[counts[0]], staging), memory_capacity_bytes=math.inf)
        bubble = min(staging.least_bubble_fraction(counts[-1]), least_bubble)
        return self.cannot_beat_with_sends(mesh, fewest, staging, pricer, cutoff_s, bubble)

    def cannot_beat_with_sends(self, mesh: MeshChoice, problem: Problem, staging: Staging, pricer: Pricer,
                               cutoff_s: float, bubble: float) -> bool:
        """Whether ``problem`` (staged under ``staging``) cannot beat ``cutoff_s`` by its LP relaxation
        (``solver.cannot_beat``), stretched by ``bubble`` and paying the stage transfers every plan of it
        pays (``least_stage_transfers``): the bounds of ``_counts_cannot_win`` and ``_ChunkBound``."""
        sends = least_stage_transfers(self.captured, problem, staging, pricer, mesh)
        with self.progress.phase("solve"):
            return cannot_beat(problem, cutoff_s - (1.0 + bubble) * sends, bubble)

    def _solved_before(self, unstaged: Problem, staging: Staging, problem: Problem, cutoff_s: float
                       ) -> Solution | None:
        """The solution of ``unstaged`` under another schedule of the same checkpointing mode and layers a
        device, where it is ``problem``'s (``unstaged`` under ``staging``) too, else None; ``Pruned`` where
        that solution's bound shows ``problem`` cannot beat ``cutoff_s``.

        A schedule changes only how many microbatches' activations a device holds (``Staging.in_flight``,
        ``last_stage_in_flight``, ``last_chunk_in_flight``); the objective (a microbatch's work) is the same,
        and the bubble and the stage transfers are added after the solve (``assemble.with_pipeline_time``).
        Where ``staging`` holds at least as many as the schedule solved before, every plan that fits now
        fitted then, so the earlier optimum is still optimal if it fits ``problem``'s memory, and its bound
        still bounds ``problem``'s objective, which the step time only exceeds. Interleaved and zero-bubble
        schedules, tried after 1F1B on the winner's counts, are then priced or pruned without solving again."""
        earlier = self._solved.get(_solved_key(unstaged, staging))
        if earlier is None:
            return None
        before, solution = earlier
        m = unstaged.microbatches
        if any(now < then for now, then in ((staging.in_flight(m), before.in_flight(m)),
                                            (staging.last_stage_in_flight(m), before.last_stage_in_flight(m)),
                                            (staging.last_chunk_in_flight(m), before.last_chunk_in_flight(m)))):
            return None
        if solution.bound_s >= cutoff_s:
            raise Pruned(f"mesh {problem.mesh_shape}: its objective is at least {solution.bound_s:.6g} s")
        return solution if evaluate(problem, solution.choice)[1] <= problem.memory_capacity_bytes else None

def _same_options(best: Candidate, problem: Problem) -> dict[str, int]:
    """``best``'s choice as indices into ``problem``'s options: the option of each decision with the
    strategy ``best`` took (``problem`` is built again for the same mesh, so it offers the same ones)."""
    choice = {}
    for key, k in best.solution.choice.items():
        taken = best.problem.decisions[key].options[k].strategy
        choice[key] = next(i for i, o in enumerate(problem.decisions[key].options) if o.strategy == taken)
    return choice


def _solved_key(unstaged: Problem, staging: Staging) -> tuple[int, tuple[str, ...], int]:
    """What a solution of ``unstaged`` under ``staging`` is shared by (``_MeshSearch._solved_before``): the
    problem (one per microbatch count and pricer), the checkpointing mode and the layers a device holds."""
    return id(unstaged), staging.checkpointing, staging.layers_per_stage


class _ChunkBound:
    """Of one pipeline mesh, checkpointing mode and schedule, the microbatch counts at which no chunk count
    of ``staging.among`` can beat the cutoff, proven by one LP relaxation per count, where ``_more_chunks``
    would solve one ILP per (chunk count, count): on a pinned Llama 3 70B pipeline (pp 4), 2 LPs in place
    of 12 ILPs for zero bubble's 6 chunk counts, each of which its root proved unbeatable.

    The LP's problem is ``FewestHeld``'s: every chunk count's plans fit its memory rows and pay its
    prices; its cutoff row (``solver.py`` (10)) stretches them by the least bubble of any and takes the
    least stage transfers (those of the fewest chunks: ``least_stage_transfers`` grows with them). So
    where it admits no plan under a cutoff (``solver.cannot_beat``), no chunk count has one under it,
    nor under the lower cutoffs that follow as the search finds better plans (``pruned`` keeps it)."""

    def __init__(self, search: _MeshSearch, mesh: MeshChoice, staging: FewestHeld, per_m: "_MicrobatchProblems",
                 pricer: Pricer):
        self.search, self.mesh, self.staging, self.per_m, self.pricer = search, mesh, staging, per_m, pricer
        self.pruned: dict[int, bool] = {}

    def cannot_win(self, m: int, cutoff_s: float) -> bool:
        """Whether no chunk count can beat ``cutoff_s`` at ``m`` microbatches (checked once per count)."""
        if m not in self.pruned:
            search = self.search
            problem = search._staged(self.per_m[m], self.staging)
            self.pruned[m] = search.cannot_beat_with_sends(self.mesh, problem, self.staging, self.pricer, cutoff_s,
                                                           self.staging.least_bubble_fraction(m))
        return self.pruned[m]


def interleaving_chunks(layers: int, stages: int) -> list[int]:
    """Model chunks per device the free search tries under interleaved 1F1B, ascending: each ``v`` >= 2
    whose ``stages x v`` chunks each hold a layer and are priced at no more layers a device than one
    chunk per device (``Staging.layers_per_stage``). Chunks need not be equal (the plan's ranges differ
    by one layer at most, ``assemble._pipeline_section``): Llama 3 405B's 126 layers run interleaved on
    16 stages (Llama 3 paper, §3.3.2), e.g. as 32 chunks of 3 or 4 layers."""
    stages = max(1, stages)
    one_chunk = Staging(stages, layers).layers_per_stage
    return [v for v in range(2, layers // stages + 1)
            if Staging(stages, layers, "interleaved", v).layers_per_stage == one_chunk]


def _runnable_counts(counts: list[int], schedule: str, stages: int) -> list[int]:
    """The microbatch counts of ``counts`` that ``schedule`` runs on ``stages`` stages (``runs_interleaved``
    for the schedules with model chunks; every count for the others)."""
    if schedule not in MULTI_CHUNK_SCHEDULES:
        return counts
    return [m for m in counts if runs_interleaved(m, stages)]


def runs_interleaved(microbatches: int, stages: int) -> bool:
    """Whether torch's ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` take
    ``microbatches`` on ``stages``: they run them in ``max(1, m // p)`` rounds of equal size."""
    return microbatches % max(1, microbatches // stages) == 0


MAX_PIPELINE_MICROBATCH_TRIES = 6


class _MicrobatchProblems(dict):
    """``problem.with_microbatches(m)`` per microbatch count, priced on first use (re-pricing every
    option of a large model is the costly part of trying a count)."""

    def __init__(self, whole: Problem, pricer: Pricer, progress: SearchProgress):
        super().__init__()
        self.whole, self.pricer, self.progress = whole, pricer, progress

    def __missing__(self, m: int) -> Problem:
        with self.progress.phase("build"):
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


@dataclass(frozen=True)
class MeshOutcome:
    """What one mesh's search (``_MeshSearch.search_mesh``) sends back: the best candidate, the mesh itself
    when its bound could not win, or why nothing fit; the configuration there that came closest to fitting
    memory, whether the solver failed on one that should have fit, a worker's phase seconds, and whether
    activations fit there without recomputation (``_dominated_by_less_cp``)."""

    found: "Candidate | MeshChoice | str"
    closest: "MemoryShortfall | None"
    solver_failed: bool
    phases_s: Mapping[str, float]
    fits_whole: bool = False  # one stage, its smallest placements fit with no recomputation at some count


class _Shortfalls:
    """The closest miss over every mesh (their outcomes noted in mesh order), for a no-fit message."""

    def __init__(self) -> None:
        self.closest: MemoryShortfall | None = None
        self.solver_failed = False

    def note(self, outcome: MeshOutcome) -> None:
        self.solver_failed |= outcome.solver_failed
        miss = outcome.closest
        if miss is not None and (self.closest is None or miss.need_bytes < self.closest.need_bytes):
            self.closest = miss


@dataclass(frozen=True)
class MemoryShortfall:
    """The configuration that came closest to fitting memory, and the least its devices need."""

    need_bytes: float  # ``least_memory``: a lower bound of any plan's memory per device there
    capacity_bytes: float
    mesh: Mapping[str, int]
    microbatches: int
    checkpointing: str

    def message(self, constraints: Constraints) -> str:
        """What falls short per device, and what could make a plan fit (what the search did not try)."""
        memory = (f"memory_gb={_rounded_up(self.need_bytes / 1e9)} or more" if constraints.memory_gb is not None
                  else f"devices with {fmt_bytes(self.need_bytes)} or more of usable memory")
        remedies = [memory, "more devices"]
        pinned = [f"{k}={v}" for k, v in constraints.to_dict().items() if k in ("microbatches", "microbatch_size")]
        if pinned:
            remedies.append(f"more microbatches (drop {', '.join(pinned)})")
        if constraints.checkpointing not in (None, "full"):
            remedies.append("checkpointing=full")
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        return (f"no plan fits memory: the closest, {mesh} with {self.microbatches} microbatch(es) and "
                f"checkpointing {self.checkpointing}, needs at least {fmt_bytes(self.need_bytes)} per device, "
                f"{fmt_bytes(self.need_bytes - self.capacity_bytes)} more than the {fmt_bytes(self.capacity_bytes)} "
                f"there is; try {', or '.join(remedies)}")


def _rounded_up(x: float) -> str:
    """``x`` rounded up to three significant digits."""
    scale = 10.0 ** (math.floor(math.log10(x)) - 2)
    return f"{math.ceil(x / scale) * scale:.3g}"


def _shortfall(failures: list[str], closest: MemoryShortfall | None, constraints: Constraints) -> str:
    if not failures:
        return "no mesh shape satisfies the constraints"
    if all("cannot be cut into" in f for f in failures):
        raise BadInputError(failures[0])
    if closest is not None:
        return closest.message(constraints)
    return "no plan fits any mesh; closest: " + min((f for f in failures if "cannot be cut" not in f), key=len)


# ---- assembling the Plan ------------------------------------------------------------------------

