"""Plan assembly: from the winning candidate (mesh, staging, solved problem) to a ``Plan``.

``Candidate`` is one solved (mesh, staging, microbatch count) with its pipelined step time
(``with_pipeline_time``: bubble and stage-to-stage transfers); ``to_plan`` writes every section of
``autopar.plan/1``: mesh, degrees, pipeline, placements, per-op strategies with their collectives,
predictions, the solver's figures and the explanations.
"""

from __future__ import annotations
from autopar.core.axes import ZERO_AXES, MeshAxis
from autopar.core.placement import placements_to_strs
from autopar.core.plan import ALLGATHER, CONTIGUOUS, LOAD_BALANCED, MEMORY_PARTS, MIXED, RING, Plan, Precision
from autopar.cost_models import Cluster, adamw_step_time
from autopar.ir.layers import layer_count, layer_names, layer_period, output_vals, tensor_inputs
from autopar.ir.capture import FUSED_ATTENTION, CapturedGraph, module_path
from autopar.planning.explanations import collective_terms, explanations
from autopar.planning.meshes import MeshChoice, global_batch
from autopar.planning.pricing import Cost, Pricer, backward_ratio, global_flops, is_matmul
from autopar.planning.problem import Decision, Problem
from autopar.planning.sequence_parallel import norm_sites, sequence_sharded
from autopar.planning.solver import Solution, exposed_grad_sync
from autopar.planning.stages import Staging, assign_layer_modes, checkpointing_summary, device_layers, layer_roles
from autopar.planning.strategies import rings, runs_locally
from dataclasses import dataclass
from typing import Any, Mapping
import hashlib
import itertools
import torch
from torch import fx


@dataclass
class Candidate:
    """One solved (mesh, staging, microbatch count) and its pipelined step time."""

    mesh: MeshChoice
    staging: Staging
    problem: Problem
    solution: Solution
    pricer: Pricer  # what priced ``problem``: the plan's ops and predictions are priced by it (ZeRO stage included)
    step_s: float  # solution.objective_s plus pipeline bubble and stage-to-stage transfers
    bubble_s: float = 0.0
    p2p_s: float = 0.0
    tied_s: float = 0.0  # gradient sum of weights tied across the first and last stage, after the schedule

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


def with_pipeline_time(captured: CapturedGraph, mesh: MeshChoice, staging: Staging, problem: Problem,
                        solution: Solution, pricer: Pricer) -> Candidate:
    """Step time of a pipeline: each microbatch's work (the ILP's objective less the gradient sync
    exposed after the last microbatch, plus its transfers between stages) runs ``m + (p - 1) / v``
    times on the critical path (the bubble is ``(p - 1) / (v m)`` of the ideal time)."""
    if staging.stages == 1:
        return Candidate(mesh, staging, problem, solution, pricer, solution.objective_s)
    m = problem.microbatches
    transfer = sum(pricer.stage_transfer(nbytes / m, copies_dim)
                   for nbytes, copies_dim in _boundary_tensors(captured, problem, solution, pricer, mesh))
    p2p = 2 * staging.chunks * m * transfer  # activations forward, their gradients backward
    per_microbatch = (solution.objective_s - exposed_grad_sync(problem, solution.choice) + p2p) / m
    bubble = per_microbatch * m * staging.bubble_fraction(m)
    tied = sum(pricer.tied_gradient_sum(nbytes) for nbytes in _tied_across_stages(captured, problem, solution, pricer))
    return Candidate(mesh, staging, problem, solution, pricer, solution.objective_s + p2p + bubble + tied, bubble, p2p,
                     tied)


def _tied_across_stages(captured: CapturedGraph, problem: Problem, solution: Solution, pricer: Pricer) -> list[float]:
    """Gradient bytes per device (in the reduction dtype) of each parameter read both before the repeated layers and after them (an input
    embedding tied to the output layer): under a pipeline the first and the last stage each hold a copy,
    whose gradients are summed after the schedule."""
    roles = layer_roles(captured, problem)
    key_of = {n: key for key, d in problem.decisions.items() for n in d.nodes}
    out = []
    for name in captured.params:
        sides = {"after" if key_of.get(u.name) in roles.after_layers else
                 "layer" if key_of.get(u.name) in roles.in_layer else "before" for u in captured.node(name).users}
        if {"before", "after"} <= sides:
            d = problem.decisions[key_of[name]]
            placements = d.options[solution.choice[key_of[name]]].strategy.outputs[0]
            out.append(pricer.reduced_gradient_bytes(captured.node(name).meta["val"], placements))
    return out


def _boundary_tensors(captured: CapturedGraph, problem: Problem, solution: Solution, pricer: Pricer,
                      mesh: MeshChoice) -> list[tuple[float, int | None]]:
    """Per tensor one stage hands the next: (bytes per device for the whole batch, the tp mesh dim if
    every rank of it holds the same copy, else None), as the solution places it."""
    out = []
    for key, share in _handed_keys(captured, problem):
        handed = _handed_over(captured, problem.decisions[key], solution.choice[key], share, pricer, mesh)
        if handed is not None:
            out.append(handed)
    return out


def _handed_keys(captured: CapturedGraph, problem: Problem) -> list[tuple[str, float]]:
    """The decisions whose values cross a stage boundary, each with how many of its occurrences do: a unit's
    output (``LayerRoles.stage_boundary``: one unit's of the ``layer_count``) and the values made before the
    layers that later units read (``LayerRoles.carried``)."""
    roles, units = layer_roles(captured, problem), max(1, layer_count(captured))
    return ([(key, problem.decisions[key].occurrences / units) for key in sorted(roles.stage_boundary)]
            + list(roles.carried))


def least_stage_transfers(captured: CapturedGraph, problem: Problem, staging: Staging, pricer: Pricer,
                          mesh: MeshChoice) -> float:
    """A lower bound of the seconds a step spends handing tensors between stages (``with_pipeline_time``'s
    ``p2p``): each boundary tensor at the placement of its decision that is cheapest to send. The search
    adds it to the cutoff row of a pipeline's ILP (a plan whose sends alone lose is pruned at once)."""
    if staging.stages == 1:
        return 0.0
    m, least = problem.microbatches, 0.0
    for key, share in _handed_keys(captured, problem):
        d = problem.decisions[key]
        sends = [pricer.stage_transfer(handed[0] / m, handed[1]) for k in range(len(d.options))
                 if (handed := _handed_over(captured, d, k, share, pricer, mesh)) is not None]
        least += min(sends, default=0.0)
    return 2 * staging.chunks * m * least


def _handed_over(captured: CapturedGraph, decision: Decision, k: int, share: float, pricer: Pricer,
                 mesh: MeshChoice) -> tuple[float, int | None] | None:
    """(bytes per device for the whole batch, the tp mesh dim whose ranks all hold the same copy, else None)
    of the tensors a crossing ``decision`` hands the next stage under its option ``k`` (``share``: how many of
    its occurrences cross): its first output (a post-norm layer's ``native_layer_norm`` hands its normalized
    values, not its statistics); None where it hands no tensor."""
    placements = decision.options[k].strategy.outputs[0]
    val = output_vals(captured.node(decision.nodes[0]))[0]
    if placements is None or not isinstance(val, torch.Tensor):
        return None
    copies = next((i for i, n in enumerate(mesh.names)
                   if n == MeshAxis.TP and placements[i].is_replicate() and mesh.shape[i] > 1), None)
    return pricer.local_bytes(val, placements) * share, copies


def to_plan(captured: CapturedGraph, cluster: Cluster, model_name: str, dtype: str, best: Candidate,
             results: list[Candidate], pruned: list[MeshChoice], search_wall_s: float,
             phases_s: dict[str, float] | None = None) -> Plan:
    mesh, solution, pricer = best.mesh, best.solution, best.pricer
    problem = best.problem.settled(solution.choice)  # prices as the chosen parameter placements make them
    chosen = {key: problem.decisions[key].options[k] for key, k in solution.choice.items()}
    by_node = {n: (key, opt) for key, opt in chosen.items() for n in problem.decisions[key].nodes}
    placed = lambda name: placements_to_strs(by_node[name][1].strategy.outputs[0])  # noqa: E731
    placements = {real: placed(name) for name, fqn in captured.params.items() for real in captured.real_fqns(fqn)}
    return Plan(
        model={"name": model_name, "params": captured.num_params(), "layers": len(layer_names(captured)),
               "flops_per_step": model_flops(captured), "graph_fingerprint": fingerprint(captured),
               "dtype": dtype},
        precision=Precision.of(dtype, pricer.reduce_dtype, pricer.master_dtype, pricer.fp8),
        cluster={**cluster.to_dict(), "spec": cluster.spec, "devices": cluster.world_size},
        mesh=mesh.to_dict(),
        degrees=_degrees(mesh, captured, by_node, pricer.zero_stage),
        pipeline=_pipeline_section(captured, best),
        checkpointing=best.checkpointing,
        recomputed_layers=_recomputed_layers(captured, best),
        cp_layout=LOAD_BALANCED if mesh.size(MeshAxis.CP) > 1 else CONTIGUOUS,
        cp_attention=_cp_attention(captured, mesh, by_node),
        placements=placements,
        inputs={name: {"placements": placed(name),
                       "shape": list(captured.node(name).meta["val"].shape),
                       "dtype": str(captured.node(name).meta["val"].dtype).replace("torch.", "")}
                for name in captured.user_inputs},
        buffers={real: placed(name) for name, fqn in captured.buffers.items() for real in captured.real_fqns(fqn)},
        ops=_ops(captured, problem, solution, by_node, pricer),
        predicted=_predicted(captured, cluster, best, problem, chosen, pricer),
        solver={"status": solution.status, "objective": solution.objective_s, "bound": solution.bound_s,
                "gap": solution.gap, "wall_s": solution.wall_s, "search_wall_s": search_wall_s,
                "nodes": solution.nodes, "limit_hit": any(c.solution.limit_hit for c in results),
                "phases_s": dict(phases_s or {}),
                "variables": solution.variables, "constraints": solution.constraints,
                "decisions": len(problem.decisions), "meshes_tried": len(results) + len(pruned),
                "pruned_meshes": [m.describe() for m in pruned]},
        explanations=explanations(best.problem, solution.choice, _explanation_index(captured, problem)),
        candidates=[{"mesh": c.mesh.to_dict(),
                     "degrees": {"pp": c.mesh.stages, "dp": c.mesh.data_parallel_size, "tp": c.mesh.size(MeshAxis.TP),
                                 **({"zero": c.pricer.zero_stage} if c.pricer.zero_stage else {})},
                     "microbatches": c.problem.microbatches, "schedule": c.staging.schedule,
                     "checkpointing": c.checkpointing, "layer_modes": c.layer_modes,
                     "step_time_s": c.step_s, "status": c.solution.status} for c in results],
    )


def _pipeline_section(captured: CapturedGraph, best: Candidate) -> dict[str, Any]:
    """Stages as layer ranges ``[first, last + 1)``: ``p`` of them, or ``p v`` model chunks (chunk
    ``i`` on stage ``i mod p``) when interleaved; the layers of a 1-stage plan are one range. Chunks
    differ by at most one unit of ``layer_period`` layers (one layer where the layers are alike), the
    first ones longer (no device holds more than the ``ceil(L / (p v))`` units a chunk is priced at, and
    the last stage, which also runs the head and the loss, holds the fewest); the first also holds the
    leading layers that do not repeat (``ir.layers.repeating_layers``), as it holds the embedding."""
    staging, m = best.staging, best.problem.microbatches
    units, period = layer_count(captured), layer_period(captured)
    chunks = staging.stages * staging.chunks
    sizes = [period * (units // chunks + (i < units % chunks)) for i in range(chunks)]
    sizes[0] += len(captured.leading_layers)
    ends = list(itertools.accumulate(sizes))
    ranges = [[end - size, end] for size, end in zip(sizes, ends)]
    return {"stages": ranges, "schedule": staging.schedule, "virtual_stages": staging.chunks,
            "microbatches": m,
            "microbatch_size": _microbatch_size(global_batch(captured), m, best.mesh.data_parallel_size),
            **({"leading_layers": len(captured.leading_layers)} if captured.leading_layers else {})}


def _microbatch_size(batch: int | None, microbatches: int, dp: int) -> int:
    """Samples per microbatch on each data-parallel rank; 1 for a step whose inputs have no batch dim
    (``meshes.global_batch`` None: every rank reads them whole)."""
    return batch // (microbatches * dp) if batch is not None else 1


def _recomputed_layers(captured: CapturedGraph, best: Candidate) -> dict[str, str]:
    """Under mixed checkpointing, each recomputed layer's mode: on every device (stage), its first
    layers get the most recomputation (``stages.assign_layer_modes``)."""
    if best.checkpointing != MIXED:
        return {}
    layers = device_layers(captured, _pipeline_section(captured, best)["stages"], best.staging.stages)
    modes = assign_layer_modes(layers, best.layer_modes, layer_period(captured))
    return {layer: mode for layer, mode in modes.items() if mode != "none"}


def _cp_attention(captured: CapturedGraph, mesh: MeshChoice, by_node: dict) -> str:
    """``ring`` where the solver ran fused attention as ring attention over the cp dim (its keys split
    there, ``strategies.rings``), else ``allgather`` (``core/plan.CP_ATTENTIONS``)."""
    cp_dims = mesh.dims_of(MeshAxis.CP)
    ringed = any(rings(node, by_node[node.name][1].strategy, d) for node in captured.graph.nodes
                 if node.target is FUSED_ATTENTION and node.name in by_node for d in cp_dims)
    return RING if ringed else ALLGATHER


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
            incoming = reshard.get(key, Cost())
            for kind, sec in incoming.comm_s.items():
                comm[kind] = comm.get(kind, 0.0) + sec
            ops[node.name] = {"op": str(node.target), "module": module_path(node), "decision": key,
                              "inputs": [placements_to_strs(p) for p in s.inputs],
                              "outputs": [placements_to_strs(p) if p is not None else None for p in s.outputs],
                              "cost": {"compute_s": c.compute_s, "comm_s": comm,
                                       "grad_sync_s": c.grad_sync_s + incoming.grad_sync_s,
                                       **({"prefetched_s": incoming.prefetched_s} if incoming.prefetched_s else {}),
                                       "memory_bytes": int(c.memory_bytes)}}
            if str(node.target) in problem.unsupported_ops or runs_locally(node, s):
                ops[node.name]["local"] = True
            if captured.weight(node.name) != 1.0:  # a traced layer's op stands for the untraced layers' too
                ops[node.name]["count"] = captured.weight(node.name)
            collectives = collective_terms(node, captured, strategy_of, pricer)
            if collectives:
                ops[node.name]["collectives"] = collectives
    return ops


def _incoming_reshard(problem: Problem, solution: Solution) -> dict[str, Cost]:
    """Per consumer decision, what the resharding of its inputs costs per occurrence of the decision: its
    collectives by kind, and the parameter gathers that run beside compute (the lowered runtime's
    prefetched gathers, in the gradient sync and ``prefetched_s``)."""
    out: dict[str, Cost] = {}
    for edge in problem.edges:
        p = problem.decisions[edge.src].options[solution.choice[edge.src]].strategy.outputs[edge.src_out]
        q = problem.decisions[edge.dst].options[solution.choice[edge.dst]].edge_key(edge.slot)
        price, into = edge.price[(p, q)], out.setdefault(edge.dst, Cost())
        share = edge.count / problem.decisions[edge.dst].count
        for kind, sec in price.comm_s.items():
            into.comm_s[kind] = into.comm_s.get(kind, 0.0) + share * sec
        into.grad_sync_s += share * price.grad_sync_s
        into.prefetched_s += share * price.prefetched_s
    for g in problem.shared:  # a shared move: each of its k readers is charged 1/k, as explanations record it
        for member in g.edges:
            dst = problem.edges[member].dst
            share = g.count(problem.edges) / problem.decisions[dst].count / len(g.edges)
            for cost in g.taken(problem, solution.choice):
                into = out.setdefault(dst, Cost())
                for kind, sec in cost.comm_s.items():
                    into.comm_s[kind] = into.comm_s.get(kind, 0.0) + share * sec
                into.grad_sync_s += share * cost.grad_sync_s  # a regather launched ahead
    return out


def _explanation_index(captured: CapturedGraph, problem: Problem) -> dict[str, str]:
    index = {}
    for key, d in problem.decisions.items():
        for name in d.nodes:
            index[name] = key
            if name in captured.params:
                index.update(dict.fromkeys(captured.real_fqns(captured.params[name]), key))
    return index


def _degrees(mesh: MeshChoice, captured: CapturedGraph, by_node: dict, zero_stage: int) -> dict[str, int]:
    """Degrees of docs/architecture.md "Plan JSON" (what each key means: ``Plan.degrees`` in ``core/plan.py``).
    ``sp`` is the tp degree when a norm's result is split on its sequence dim over tp
    (``sequence_parallel.norm_sites``); ``fsdp`` the product of the sizes of the dims (dp, cp) most parameter
    bytes are sharded on; ``zero``, when anything is sharded over data parallelism, the ZeRO stage (1-2
    optimizer state and gradients sharded, 3 parameters too), absent for DDP and without a ``dp`` or
    ``cp`` dim (``ZERO_AXES``: ZeRO-1/2 pinned there shard nothing: a pipeline runs such a plan as it is;
    an ``ep`` dim alone shards only the experts)."""
    tp = mesh.size(MeshAxis.TP)
    fsdp = 1
    numel = {n: captured.node(n).meta["val"].numel() * captured.weight(n) for n in captured.params}
    for shard_dim in mesh.dims_of(MeshAxis.DP_SHARD, MeshAxis.CP):
        sharded = sum(numel[n] for n in captured.params if by_node[n][1].strategy.outputs[0][shard_dim].is_shard())
        if sharded * 2 > sum(numel.values()):
            fsdp *= mesh.shape[shard_dim]
    outputs = lambda name: by_node[name][1].strategy.outputs[0] if name in by_node else None  # noqa: E731
    sp = tp if tp > 1 and sequence_sharded(norm_sites(captured), outputs, mesh.names.index(MeshAxis.TP)) else 1
    zero = 3 if fsdp > 1 else zero_stage if mesh.dims_of(*ZERO_AXES) else 0
    return {"dp": mesh.data_parallel_size, "fsdp": fsdp, "tp": tp, "sp": sp, "cp": mesh.size(MeshAxis.CP), "ep": mesh.size(MeshAxis.EP),
            "pp": mesh.stages, "dp_replicate": mesh.size(MeshAxis.DP_REPLICATE), **({"zero": zero} if zero else {})}


def _predicted(captured: CapturedGraph, cluster: Cluster, best: Candidate, problem: Problem, chosen: dict,
               pricer: Pricer) -> dict[str, Any]:
    compute = sync = prefetched = 0.0
    comm: dict[str, float] = {}
    for key, opt in chosen.items():
        d = problem.decisions[key]
        compute += d.count * opt.cost.compute_s
        sync += d.count * opt.cost.grad_sync_s
        for kind, s in opt.cost.comm_s.items():
            comm[kind] = comm.get(kind, 0.0) + d.count * s
    for edge in problem.edges:
        p = chosen[edge.src].strategy.outputs[edge.src_out]
        q = chosen[edge.dst].edge_key(edge.slot)
        for kind, s in edge.price[(p, q)].comm_s.items():
            comm[kind] = comm.get(kind, 0.0) + edge.count * s
        sync += edge.count * edge.price[(p, q)].grad_sync_s  # a regather overlapped with backward
        prefetched += edge.count * edge.price[(p, q)].prefetched_s  # a gather overlapped with forward
    for g in problem.shared:
        carried = [problem.edges[e] for e in g.edges]
        pairs = [(chosen[e.src].strategy.outputs[e.src_out], chosen[e.dst].edge_key(e.slot)) for e in carried]
        for cost in g.moves(pairs):
            for kind, s in cost.comm_s.items():
                comm[kind] = comm.get(kind, 0.0) + g.count(problem.edges) * s
            sync += g.count(problem.edges) * cost.grad_sync_s  # an activation's regather overlapped with backward
    comm["p2p"] = comm.get("p2p", 0.0) + best.p2p_s
    comm["all_reduce"] = comm.get("all_reduce", 0.0) + best.tied_s
    exposed = sum(comm.values()) + exposed_grad_sync(problem, best.solution.choice)
    comm["all_reduce"] = comm.get("all_reduce", 0.0) + sync
    comm["all_gather"] = comm.get("all_gather", 0.0) + prefetched
    step = best.step_s
    flops = model_flops(captured)
    peak = cluster.device.peak(pricer.dtype)
    tokens = _tokens_per_step(captured)
    by_stage = {stage: _memory_parts(captured, problem, chosen, pricer, stage) for stage in problem.memory_rows}
    binding = max(by_stage, key=lambda stage: sum(by_stage[stage].values()))
    memory = by_stage[binding]
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
        **({"memory_stage": binding,
            "stage_peak_memory_bytes": {stage: int(sum(parts.values())) for stage, parts in by_stage.items()}}
           if problem.stage_rows is not None else {}),
        "optimizer_s": _optimizer_s(captured, problem, chosen, pricer),
        "runtime": pricer.runtime,  # what the prices assume runs the plan (core.plan.RUNTIMES)
    }


def _optimizer_s(captured: CapturedGraph, problem: Problem, chosen: dict, pricer: Pricer) -> float:
    """Seconds of the AdamW update after a step, on one device: every parameter tensor it holds, over the
    elements whose optimizer state it keeps (its shard; under ZeRO-1/2 the share of that). Apart from
    ``step_time_s``, which prices ``pm.step`` (docs/architecture.md "Public API": the optimizer is the caller's)."""
    seconds = 0.0
    for key, opt in chosen.items():
        d = problem.decisions[key]
        name = d.nodes[0]
        if name not in captured.params or not captured.has_node(name):
            continue
        val, placements = captured.node(name).meta["val"], opt.strategy.outputs[0]
        updated = pricer.local_numel(val, placements) / pricer.optimizer_shards(val, placements)
        seconds += d.count * adamw_step_time([updated], pricer.cluster.device, pricer.dtype, pricer.master_dtype)
    return seconds


def _memory_parts(captured: CapturedGraph, problem: Problem, chosen: dict, pricer: Pricer, stage: str
                  ) -> dict[str, float]:
    """Bytes per part of what the device of memory row ``stage`` (``Problem.memory_rows``: a pipeline's
    first or last stage) holds: the solver's rows (4) and (12), split into parameters, gradients, optimizer
    state, activations and, where the plan shards parameters over data parallelism, the largest unit of
    them gathered (``gathered``: FSDP's working set, ``problem.gathered_units``)."""
    memory = {part: 0.0 for part in MEMORY_PARTS if part != "gathered"}
    gathered = problem.gathered_bytes(stage, chosen)
    if gathered:
        memory["gathered"] = gathered
    for key, opt in chosen.items():
        d = problem.decisions[key]
        if not problem.holds(stage, key):
            continue
        first = captured.node(d.nodes[0]) if captured.has_node(d.nodes[0]) else None
        if first is not None and first.op == "placeholder" and first.name in captured.params:
            frozen = first.name in captured.frozen_parameters()
            float8 = first.name in pricer.float8_weights
            for part, b in pricer.parameter_memory(first.meta["val"], opt.strategy.outputs[0], frozen, float8).items():
                memory[part] += d.count * b
        else:
            memory["activations"] += d.count * problem.held_bytes(stage, key, opt.cost, opt.working_set_bytes)
    return memory


def _tokens_per_step(captured: CapturedGraph) -> float:
    if not captured.user_inputs:
        return 0.0
    val = captured.node(captured.user_inputs[0]).meta["val"]
    if val.dtype in (torch.int64, torch.int32) and val.ndim >= 2:
        return float(val.shape[0] * val.shape[1])
    return float(val.shape[0]) if val.ndim else 1.0


def model_flops(captured: CapturedGraph) -> float:
    """Matmul FLOPs of forward + backward (3x forward), the convention of MFU (PaLM, Megatron-LM); a matmul
    whose backward computes fewer gradient products (a frozen weight's, ``pricing.backward_ratio``) counts
    those it computes."""
    kinds = captured.gradient_kinds()
    return sum(global_flops(n) * captured.weight(n.name) * (1.0 + 2.0 * _trained_share(n, kinds))
               for n in captured.graph.nodes if n.op == "call_function" and is_matmul(n))


def _trained_share(node: fx.Node, kinds: Mapping[str, str]) -> float:
    """The share of ``node``'s backward products that run: 1 where all its inputs get gradients."""
    graded = ["activation"] * len(tensor_inputs(node))
    return backward_ratio(node, [kinds[a.name] for a in tensor_inputs(node)]) / backward_ratio(node, graded)


def fingerprint(captured: CapturedGraph) -> str:
    """Identity of what a plan applies to: parameter names and shapes, the frozen ones (priced without gradient
    or state: a plan for them would under-price the model trained whole), input shapes and dtypes.

    Not the node list: captures on different devices differ in layout ops (a ``clone`` the meta kernels
    need and the CPU kernels do not), and the runtime follows its own graph, taking each op's placements
    from the plan by node name and letting ops the plan does not name follow their inputs.
    """
    parts = [f"{fqn}:{tuple(shape)}" for fqn, shape in sorted(captured.param_shapes().items())]
    for name in captured.user_inputs:
        val = captured.node(name).meta["val"]
        parts.append(f"{name}:{tuple(val.shape)}:{val.dtype}")
    frozen = sorted(captured.params[name] for name in captured.frozen_parameters())
    if frozen:
        parts.append(f"frozen:{','.join(frozen)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def model_dims(config: Any) -> dict[str, int]:
    """Named sizes of a model config (``h``, ``heads``, ``head_dim``, ``kv_heads``, ``ffn``, ``vocab``)
    for ``Plan.model["dims"]``; attributes a config lacks are left out."""
    hidden, heads = getattr(config, "hidden", None), getattr(config, "heads", None)
    ffn = getattr(config, "ffn_hidden", None) or (
        hidden * config.mlp_ratio if hidden and getattr(config, "mlp_ratio", None) else None)
    dims = {"h": hidden, "ffn": ffn, "vocab": getattr(config, "vocab", None), "heads": heads,
            "kv_heads": getattr(config, "kv_heads", None),
            "head_dim": hidden // heads if hidden and heads else None}
    return {k: int(v) for k, v in dims.items() if isinstance(v, int) and not isinstance(v, bool)}
