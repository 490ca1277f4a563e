"""The planner: capture once, then for every candidate mesh build the ILP, solve it, keep the best.

The mesh search enumerates factorizations of the world into a data-parallel and a tensor-parallel
dimension (``dp x tp``), with ``tp`` kept inside a node (tensor parallelism all-reduces on the critical
path, so it belongs on NVLink; Narayanan et al., SC21). Each mesh dimension has a role that the
placeholders' candidate placements encode:

* ``dp``: example inputs are split on their batch dimension (``S(0)``), parameters and buffers are
  replicated, and every op downstream of the inputs keeps its output split (or partial) on this dim:
  each rank works on its own share of the batch, never on a gathered copy. The gradient all_reduce
  follows from the strategies (see ``pricing.py``).
* ``tp``: example inputs are replicated and every weight matrix (parameter of 2+ dims) is split on
  this dim; the ILP picks which dim (column/row, heads, vocabulary) and how activations flow
  between them (sharded, partial, or split on the sequence) from DTensor's strategies.

A size-1 dimension is dropped. Constraints (``{"dp": 2, "tp": 2}``) pin degrees; the rest is searched.
Meshes are solved in order (1-D first) with the best step time so far as a cutoff: the solver stops on
a mesh as soon as its bound shows it cannot win, and the plan lists it under ``solver.pruned_meshes``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import fx

from .capture import CapturedGraph, module_path
from .explain import explanations
from .cost_models import Cluster, usable_bytes
from .errors import BadInputError, NoFeasiblePlanError
from .placement import is_sharded
from .plan import Plan
from .pricing import Pricer, global_flops, is_matmul
from .problem import OUTPUT_KEY, Problem, Roles, build_problem, placeholder_candidates
from .solver import Pruned, Solution, infeasible_reason, least_memory, solve
from .strategies import LOCAL_RULES, StrategyFinder, tensor_inputs

KNOWN_CONSTRAINTS = {"dp", "tp", "pp", "fsdp", "cp", "ep", "microbatches", "memory_gb", "time_limit_s", "dtype"}
OVERLAP_FRACTION = 0.8
"""Share of backward compute behind which bucketed gradient all_reduce can hide (the last bucket and
the first layers' gradients cannot overlap; PyTorch DDP, Li et al., VLDB 2020)."""


@dataclass(frozen=True)
class MeshChoice:
    dims: tuple[tuple[str, int], ...]  # (name, size) per mesh dim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    def degree(self, name: str) -> int:
        return dict(self.dims).get(name, 1)


def make_plan(
    captured: CapturedGraph, cluster: Cluster, *, model_name: str, constraints: Mapping[str, Any] | None = None,
) -> Plan:
    constraints = validate_constraints(constraints or {})
    dtype = constraints.get("dtype") or ("fp32" if cluster.device.name == "cpu" else "bf16")
    capacity = constraints["memory_gb"] * 1e9 if "memory_gb" in constraints else usable_bytes(cluster.device)
    batch = _global_batch(captured)
    results: list[tuple[MeshChoice, Problem, Solution]] = []
    failures: list[str] = []
    pruned: list[MeshChoice] = []
    start = time.perf_counter()
    for mesh in mesh_candidates(cluster, constraints, batch):
        best = min((r[2].objective_s for r in results), default=None)
        found = _solve_smallest_microbatch_count(captured, cluster, mesh, dtype, capacity, batch, constraints, best)
        if isinstance(found, MeshChoice):
            pruned.append(found)
        elif isinstance(found, str):
            failures.append(found)
        else:
            results.append(found)
    if not results:
        raise NoFeasiblePlanError(_shortfall(failures))
    results.sort(key=lambda r: r[2].objective_s)
    mesh, problem, solution = results[0]
    return _to_plan(captured, cluster, model_name, dtype, mesh, problem, solution, results, pruned,
                    time.perf_counter() - start)


def _solve_smallest_microbatch_count(captured, cluster, mesh, dtype, capacity, batch, constraints, cutoff_s):
    """Gradient accumulation: the fewest microbatches whose activations fit (more only add cost:
    smaller kernels and, with sharded parameters, one all_gather per microbatch). Returns the
    (mesh, problem, solution), the reason nothing fit, or the mesh itself when its bound shows it
    cannot beat ``cutoff_s`` (the best step time of the meshes solved before it)."""
    reason = ""
    counts = microbatch_counts(batch, mesh.degree("dp"), constraints.get("microbatches"))
    if not counts:
        return f"global batch {batch} cannot be cut into microbatches={constraints['microbatches']} x dp={mesh.degree('dp')}"
    pricer = Pricer(cluster, mesh.shape, dtype)
    whole = _problem_for(captured, mesh, pricer, capacity, constraints)
    for m in counts:
        problem = whole.with_microbatches(m, pricer)
        if least_memory(problem) > capacity:
            reason = infeasible_reason(problem)
            continue
        try:
            return mesh, problem, solve(problem, constraints.get("time_limit_s", 30.0), cutoff_s=cutoff_s)
        except Pruned:
            return mesh  # more microbatches only cost more
        except NoFeasiblePlanError as exc:
            reason = str(exc)
    return reason


def microbatch_counts(batch: int | None, dp: int, fixed: int | None) -> list[int]:
    """Microbatch counts m with every microbatch still split evenly over dp (batch % (m * dp) == 0)."""
    if batch is None:
        return [1]
    if fixed is not None:
        return [] if batch % (fixed * dp) else [fixed]
    return [m for m in _divisors(batch // dp) if (batch // m) % dp == 0]


def _shortfall(failures: list[str]) -> str:
    if not failures:
        return "no mesh shape satisfies the constraints"
    if all("cannot be cut into" in f for f in failures):
        raise BadInputError(failures[0])
    return "no plan fits any mesh; closest: " + min((f for f in failures if "cannot be cut" not in f), key=len)


NOT_YET = {"sp": "sequence parallelism is chosen by the solver and cannot be pinned yet",
           "schedule": "pipeline schedules are not implemented yet",
           "checkpointing": "activation checkpointing is not implemented yet",
           "microbatch_size": "pin microbatches instead"}


def validate_constraints(constraints: Mapping[str, Any]) -> dict[str, Any]:
    for key, why in NOT_YET.items():
        if key in constraints:
            raise BadInputError(f"constraint {key}={constraints[key]!r}: {why}")
    unknown = set(constraints) - KNOWN_CONSTRAINTS
    if unknown:
        raise BadInputError(f"unknown constraint(s) {', '.join(sorted(unknown))}: "
                            f"known are {', '.join(sorted(KNOWN_CONSTRAINTS))}")
    out = dict(constraints)
    for key in ("pp", "cp", "ep"):
        if int(out.get(key, 1)) != 1:
            raise BadInputError(f"constraint {key}={out[key]}: this version plans {key}=1 only "
                                "(pipeline, context and expert parallelism are not implemented yet)")
    if "fsdp" in out:
        if str(out["fsdp"]) not in ("0", "3"):
            raise BadInputError(f"constraint fsdp={out['fsdp']}: this version plans fsdp=0 (replicated "
                                "parameters) or fsdp=3 (parameters sharded on dp); ZeRO-1/2 are not implemented")
        out["fsdp"] = int(out["fsdp"])
    for key in ("dp", "tp", "microbatches"):
        if key in out:
            out[key] = _positive(key, out[key], int)
    for key in ("memory_gb", "time_limit_s"):
        if key in out:
            out[key] = _positive(key, out[key], float)
    if out.get("dtype") not in (None, "fp32", "bf16", "fp16"):
        raise BadInputError(f"constraint dtype={out['dtype']!r}: expected fp32, bf16 or fp16")
    return out


def _positive(key: str, value: Any, kind: type) -> Any:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = 0
    if number <= 0 or (kind is int and str(value).strip() != str(number)):
        raise BadInputError(f"constraint {key}={value!r}: expected a positive {'integer' if kind is int else 'number'}")
    return number


def mesh_candidates(cluster: Cluster, constraints: Mapping[str, Any], batch: int | None) -> list[MeshChoice]:
    world = cluster.world_size
    fixed_dp, fixed_tp = constraints.get("dp"), constraints.get("tp")
    if fixed_dp and fixed_tp and fixed_dp * fixed_tp != world:
        raise BadInputError(f"dp={fixed_dp} x tp={fixed_tp} = {fixed_dp * fixed_tp}, but the cluster "
                            f"{cluster.spec} has {world} devices")
    for key, value in (("dp", fixed_dp), ("tp", fixed_tp)):
        if value and world % value:
            raise BadInputError(f"{key}={value} does not divide the {world} devices of {cluster.spec}")
    out = []
    for tp in _divisors(world):
        dp = world // tp
        if (fixed_tp and tp != fixed_tp) or (fixed_dp and dp != fixed_dp):
            continue
        if not fixed_tp and tp > cluster.devices_per_node:
            continue  # keep tensor parallelism on NVLink unless asked otherwise
        if batch is not None and batch % dp:
            if fixed_dp:
                raise BadInputError(f"global batch {batch} is not divisible by dp={dp}")
            continue
        dims = tuple((n, s) for n, s in (("dp", dp), ("tp", tp)) if s > 1) or (("dp", 1),)
        out.append(MeshChoice(dims))
    if not out:
        raise BadInputError(f"global batch {batch} cannot be split over any data-parallel degree of "
                            f"{world} devices with tp <= {cluster.devices_per_node}: use a batch divisible "
                            f"by {world // min(world, cluster.devices_per_node)}")
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _global_batch(captured: CapturedGraph) -> int | None:
    if not captured.user_inputs:
        return None
    val = captured.node(captured.user_inputs[0]).meta["val"]
    return int(val.shape[0]) if val.ndim else None


def _problem_for(captured: CapturedGraph, mesh: MeshChoice, pricer: Pricer, capacity: float,
                 constraints: Mapping[str, Any]) -> Problem:
    shape = mesh.shape
    dp_dims = [i for i, n in enumerate(mesh.names) if n == "dp" and shape[i] > 1]
    tp_dims = [i for i, n in enumerate(mesh.names) if n == "tp"]
    pins_buffers = {i: "R" for i in dp_dims}
    fsdp = constraints.get("fsdp")
    pins_params = {i: "R" for i in dp_dims} if fsdp == 0 else {}
    sharded_on_dp = dp_dims if fsdp == 3 else []
    pins_inputs = {i: ("S(0)" if n == "dp" else "R") for i, n in enumerate(mesh.names)}
    param_candidates = placeholder_candidates(shape, pins_params)
    roles = Roles(
        param=lambda val: _split_matrices(param_candidates(val), val, tp_dims + sharded_on_dp),
        user_input=placeholder_candidates(shape, pins_inputs),
        buffer=placeholder_candidates(shape, pins_buffers),
        allow=_both(_batch_stays_split(captured, dp_dims), _weights_stay_split(captured, tp_dims)),
    )
    return build_problem(captured, StrategyFinder(shape), pricer, roles,
                         capacity, OVERLAP_FRACTION)


def _split_matrices(cands: list, val: torch.Tensor, dims: list[int]) -> list:
    """A weight matrix is split on each of ``dims`` (tp dims; dp dims under fsdp=3) when it can be."""
    if val.ndim < 2 or not dims:
        return cands
    split = [c for c in cands if all(c[d] != "R" for d in dims)]
    return split or cands


def _batch_stays_split(captured: CapturedGraph, dp_dims: list[int]):
    """Data-parallel role: ops that depend on the inputs keep their (non-scalar) output split on dp."""
    on_data = _downstream_of(captured.graph, set(captured.user_inputs))

    def allow(node: fx.Node, strategy) -> bool:
        if node.name not in on_data or not dp_dims:
            return True
        out, val = strategy.outputs[0], node.meta.get("val")
        if out is None or not isinstance(val, torch.Tensor) or val.ndim == 0:
            return True
        return all(out[d] != "R" for d in dp_dims)

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


def _both(first, second):
    return lambda node, strategy: first(node, strategy) and second(node, strategy)


def _downstream_of(graph: fx.Graph, sources: set[str]) -> set[str]:
    seen = set(sources)
    for node in graph.nodes:
        if any(a.name in seen for a in node.all_input_nodes):
            seen.add(node.name)
    return seen


# ---- assembling the Plan ------------------------------------------------------------------------

def _to_plan(captured: CapturedGraph, cluster: Cluster, model_name: str, dtype: str, mesh: MeshChoice,
             problem: Problem, solution: Solution, results: list, pruned: list[MeshChoice],
             search_wall_s: float) -> Plan:
    chosen = {key: problem.decisions[key].options[k] for key, k in solution.choice.items()}
    by_node = {n: (key, opt) for key, opt in chosen.items() for n in problem.decisions[key].nodes}
    pricer = Pricer(cluster, mesh.shape, dtype)
    placements = {fqn: list(by_node[name][1].strategy.outputs[0]) for name, fqn in captured.params.items()}
    predicted = _predicted(captured, cluster, mesh, problem, solution, chosen, by_node, pricer)
    return Plan(
        model={"name": model_name, "params": captured.num_params(), "layers": captured.layer_count(),
               "flops_per_step": model_flops(captured), "graph_fingerprint": fingerprint(captured),
               "dtype": dtype},
        cluster={**cluster.to_dict(), "spec": cluster.spec, "devices": cluster.world_size},
        mesh={"shape": list(mesh.shape), "dim_names": list(mesh.names)},
        degrees=_degrees(mesh, captured, by_node),
        pipeline={"stages": [[0, captured.layer_count()]], "schedule": "none",
                  "microbatches": problem.microbatches,
                  "microbatch_size": (_global_batch(captured) or 1) // (problem.microbatches * mesh.degree("dp"))},
        checkpointing="none",
        placements=placements,
        inputs={name: {"placements": list(by_node[name][1].strategy.outputs[0]),
                       "shape": list(captured.node(name).meta["val"].shape),
                       "dtype": str(captured.node(name).meta["val"].dtype).replace("torch.", "")}
                for name in captured.user_inputs},
        buffers={fqn: list(by_node[name][1].strategy.outputs[0]) for name, fqn in captured.buffers.items()},
        ops=_ops(captured, problem, solution, by_node),
        predicted=predicted,
        solver={"status": solution.status, "objective": solution.objective_s, "bound": solution.bound_s,
                "gap": solution.gap, "wall_s": solution.wall_s, "search_wall_s": search_wall_s,
                "variables": solution.variables, "constraints": solution.constraints,
                "decisions": len(problem.decisions), "meshes_tried": len(results) + len(pruned),
                "pruned_meshes": [dict(m.dims) for m in pruned]},
        explanations=explanations(problem, solution.choice, _explanation_index(captured, problem)),
        candidates=[{"mesh": {"shape": list(m.shape), "dim_names": list(m.names)},
                     "degrees": {"dp": m.degree("dp"), "tp": m.degree("tp")}, "microbatches": pr.microbatches,
                     "step_time_s": s.objective_s, "status": s.status} for m, pr, s in results],
    )


def _ops(captured: CapturedGraph, problem: Problem, solution: Solution, by_node: dict) -> dict[str, dict[str, Any]]:
    """Each op's strategy and, per occurrence, its predicted cost (own + resharding of its inputs)."""
    reshard = _incoming_reshard(problem, solution)
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
    return ops


def _incoming_reshard(problem: Problem, solution: Solution) -> dict[str, dict[str, float]]:
    """Per consumer decision, the resharding seconds of its inputs, per occurrence of the decision."""
    out: dict[str, dict[str, float]] = {}
    for edge in problem.edges:
        p = problem.decisions[edge.src].options[solution.choice[edge.src]].strategy.outputs[edge.src_out]
        q = problem.decisions[edge.dst].options[solution.choice[edge.dst]].strategy.inputs[edge.slot]
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


def _degrees(mesh: MeshChoice, captured: CapturedGraph, by_node: dict) -> dict[str, int]:
    tp, dp = mesh.degree("tp"), mesh.degree("dp")
    fsdp = 1
    if dp > 1:  # fsdp = dp when most parameter bytes are sharded on the dp dim
        dp_dim = mesh.names.index("dp")
        numel = {n: captured.node(n).meta["val"].numel() for n in captured.params}
        sharded = sum(numel[n] for n in captured.params if is_sharded(by_node[n][1].strategy.outputs[0][dp_dim]))
        if sharded * 2 > sum(numel.values()):
            fsdp = dp
    sp = 1
    if tp > 1:
        tp_dim = mesh.names.index("tp")
        for node in captured.graph.nodes:
            if "layer_norm" in str(node.target) and node.name in by_node:
                out = by_node[node.name][1].strategy.outputs[0]
                if out is not None and is_sharded(out[tp_dim]) and out[tp_dim] != f"S({node.meta['val'][0].ndim - 1})":
                    sp = tp
    return {"dp": dp, "fsdp": fsdp, "tp": tp, "sp": sp, "cp": 1, "ep": 1, "pp": 1}


def _predicted(captured, cluster, mesh, problem, solution, chosen, by_node, pricer) -> dict[str, Any]:
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
        q = chosen[edge.dst].strategy.inputs[edge.slot]
        for kind, s in edge.price[(p, q)].comm_s.items():
            comm[kind] = comm.get(kind, 0.0) + edge.count * s
    exposed = sum(comm.values()) + max(0.0, sync - hide)
    comm["all_reduce"] = comm.get("all_reduce", 0.0) + sync
    step = solution.objective_s
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
        "bubble_s": 0.0,
        "peak_memory_bytes": int(sum(memory.values())),
        "memory_bytes": {k: int(v) for k, v in memory.items()},
        "memory_capacity_bytes": problem.memory_capacity_bytes,
    }


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
