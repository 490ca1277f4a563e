"""What-if without re-capturing: re-price a plan's exact strategies on another cluster.

``reprice(plan, problem, cluster)`` keeps every decision of ``plan`` (mesh, microbatches, each
parameter's and input's placement, each op's strategy) and prices them on ``cluster`` from the saved
planning problem (``problem_file``): the planner builds its problem for the plan's mesh on the new
cluster, the plan's choices are looked up among each decision's options, ``solver.evaluate`` gives
their step time by the ILP's own formulas, and the planner assembles the Plan, so every predicted field
(compute, each collective, exposed communication, memory) is consistent with a solved plan.

The new cluster must have the plan's number of devices (a re-priced plan runs the same program); to
search again on a cluster of another size, re-solve: ``autopar plan --problem FILE --cluster SPEC``.
The compute dtype stays the plan's, and memory is checked against the new device's capacity.
"""

from __future__ import annotations

import time
from dataclasses import replace

from autopar.core.axes import MeshAxis
from autopar.core.constraints import Constraints
from autopar.ir.bind import bind_ops
from autopar.ir.layers import layer_count, layer_period
from autopar.ir.capture import CapturedGraph
from autopar.cost_models import Cluster, usable_bytes
from autopar.core.errors import BadInputError
from autopar.core.placement import strs_to_placements
from autopar.core.plan import Plan
from autopar.planning.assemble import fingerprint, to_plan, with_pipeline_time
from autopar.planning.meshes import MeshChoice
from autopar.planning.roles import pricer_for, problem_for
from autopar.planning.problem import OUTPUT_KEY, Decision, Problem
from autopar.ir.problem_file import SavedProblem
from autopar.planning.solver import Solution, evaluate
from autopar.planning.stages import Staging, count_layer_modes, device_layers, stage_problem
from autopar.planning.strategies import Strategy


def reprice(plan: Plan, problem: SavedProblem | CapturedGraph, target: Cluster) -> Plan:
    """``plan``'s strategies, unchanged, priced on ``target`` (same number of devices); its sequence
    layout over cp too (``cp_layout``: a plan made before load balancing keeps its contiguous chunks)."""
    start = time.perf_counter()
    captured = problem.captured if isinstance(problem, SavedProblem) else problem
    check_same_model(plan, captured)
    check_same_world(plan, target)
    mesh = _plan_mesh(plan)
    (staging, layer_modes), dtype = _staging(plan, captured), plan.model_dtype
    constraints = _pricing_constraints(plan)
    priced = _planner_problem(captured, target, mesh, staging, dtype, plan.pipeline.microbatches,
                              constraints).with_layer_modes(layer_modes)
    choice = plan_choice(plan, captured, priced)
    objective_s, _ = evaluate(priced, choice)
    solution = Solution(choice=choice, status="repriced", objective_s=objective_s, bound_s=objective_s,
                        wall_s=time.perf_counter() - start, variables=0, constraints=0, layer_modes=layer_modes)
    repriced = _planner_plan(captured, target, plan.model["name"], dtype, mesh, staging, priced, solution,
                             time.perf_counter() - start, constraints)
    return replace(repriced, model={**repriced.model, **_model_facts(plan)}, cp_layout=plan.cp_layout)


def _model_facts(plan: Plan) -> dict:
    """What the plan's model section says that the captured graph does not: named sizes (``dims``) and a
    mixture-of-experts model's routing (``moe``), both read from the model's code when it was planned."""
    return {key: plan.model[key] for key in ("dims", "moe") if key in plan.model}


def check_same_model(plan: Plan, captured: CapturedGraph) -> None:
    if plan.model.get("graph_fingerprint") != fingerprint(captured):
        raise BadInputError(f"the plan (model {plan.model.get('name')!r}) was made for other parameters or "
                            "input shapes than the saved problem: save the problem of the same model and batch")


def check_same_world(plan: Plan, cluster: Cluster) -> None:
    devices = int(plan.cluster["devices"])
    if cluster.world_size != devices:
        raise BadInputError(f"the plan runs on {devices} devices (mesh {plan.mesh.shape}) but {cluster.spec} "
                            f"has {cluster.world_size}: re-pricing keeps the plan's mesh; to plan for another "
                            f"size, re-solve with `autopar plan --problem FILE --cluster {cluster.spec}`")


def plan_choice(plan: Plan, captured: CapturedGraph, problem: Problem) -> dict[str, int]:
    """Per decision of ``problem``, the index of the option ``plan`` took."""
    wanted = _plan_strategies(plan, captured)
    choice = {}
    for key, decision in problem.decisions.items():
        if key == OUTPUT_KEY:
            choice[key] = 0
            continue
        strategy = next((wanted[n] for n in decision.nodes if n in wanted), None)
        choice[key] = _option_index(decision, strategy, plan)
    return choice


def _plan_strategies(plan: Plan, captured: CapturedGraph) -> dict[str, Strategy]:
    """Node name -> the strategy the plan gives it: ops from ``plan.ops``, placeholders from the
    placements of parameters, inputs and buffers; lifted constants are replicated (the runtime's rule)."""
    ndim = plan.mesh.ndim
    plan = bind_ops(plan, captured)
    out = {name: Strategy(tuple(strs_to_placements(p) for p in op["inputs"]),
                          tuple(strs_to_placements(p) if p is not None else None for p in op["outputs"]))
           for name, op in plan.ops.items()}
    for name, fqn in captured.params.items():
        out[name] = _placeholder(plan.placements.get(fqn))
    for name, fqn in captured.buffers.items():
        out[name] = _placeholder(plan.buffers.get(fqn))
    for name in captured.user_inputs:
        out[name] = _placeholder(plan.inputs.get(name, {}).get("placements"))
    for name in captured.constants:
        out[name] = _placeholder(["R"] * ndim)
    return out


def _placeholder(placements: list[str] | None) -> Strategy | None:
    return None if placements is None else Strategy((), (strs_to_placements(placements),))


def _option_index(decision: Decision, strategy: Strategy | None, plan: Plan) -> int:
    if strategy is None:
        raise BadInputError(f"the plan (model {plan.model.get('name')!r}) says nothing about "
                            f"{decision.nodes[0]!r}: it was made for another graph than the saved problem")
    for k, option in enumerate(decision.options):
        if option.strategy == strategy:
            return k
    raise BadInputError(f"the plan's strategy for {decision.nodes[0]!r} ({strategy.describe()}) is not one the "
                        "planner offers on this mesh: was the plan made by another autopar or torch version?")


# ---- the planner's internals, in one place ------------------------------------------------------

def _plan_mesh(plan: Plan) -> MeshChoice:
    axes = {axis.value: axis for axis in MeshAxis}
    unknown = [name for name in plan.mesh.dim_names if name not in axes]
    if unknown:
        raise BadInputError(f"the plan's mesh has dims {', '.join(map(repr, unknown))}, which this autopar does not "
                            f"plan (it knows {', '.join(axes)}): was the plan made by another version?")
    return MeshChoice(tuple((axes[name], size) for name, size in zip(plan.mesh.dim_names, plan.mesh.shape)),
                      plan.degrees.pp)


def _staging(plan: Plan, captured: CapturedGraph) -> tuple[Staging, dict[str, int]]:
    """The plan's pipeline schedule, and how many of a device's layers run in each checkpointing mode
    (those of the first stage, which pricing holds for every device)."""
    pipeline = plan.pipeline
    staging = Staging(plan.degrees.pp, layer_count(captured), pipeline.schedule, pipeline.virtual_stages or 1)
    first_stage = device_layers(captured, pipeline.stages, staging.stages)[0]
    counts = count_layer_modes(first_stage, plan.checkpointing_of, staging.layers_per_stage, layer_period(captured))
    return replace(staging, checkpointing=tuple(counts) or ("none",)), counts


def _pricing_constraints(plan: Plan) -> Constraints:
    """What the planner's pricing needs beyond the placements: a ZeRO-1/2 stage (sharded optimizer
    state of replicated parameters), the gradient reductions' and the master weights' dtypes. Nothing else
    is pinned, so every strategy the plan took, under whatever constraints it was made, is among the
    options. The runtime the plan's prices assume is kept too (``predicted.runtime``; DTensor in plans
    without it)."""
    zero = plan.degrees.zero or 0
    return Constraints(zero_stage=zero if zero in (1, 2) else None, reduce_dtype=plan.precision.reduce,
                       master_dtype=plan.precision.master, runtime=plan.predicted.get("runtime"),
                       fp8=plan.precision.fp8)


def _planner_problem(captured: CapturedGraph, cluster: Cluster, mesh: MeshChoice, staging: Staging, dtype: str,
                     microbatches: int, constraints: Constraints) -> Problem:
    """The problem the planner solves for ``mesh`` and ``staging`` on ``cluster``, priced for ``microbatches``."""
    pricer = pricer_for(cluster, mesh, dtype, constraints, captured)
    whole = problem_for(captured, mesh, pricer, usable_bytes(cluster.device), constraints)
    return stage_problem(whole.with_microbatches(microbatches, pricer), captured, staging)


def _planner_plan(captured: CapturedGraph, cluster: Cluster, model_name: str, dtype: str, mesh: MeshChoice,
                  staging: Staging, problem: Problem, solution: Solution, wall_s: float,
                  constraints: Constraints) -> Plan:
    """The planner's Plan of this one priced candidate (with its pipeline bubble and transfers)."""
    pricer = pricer_for(cluster, mesh, dtype, constraints, captured)
    best = with_pipeline_time(captured, mesh, staging, problem, solution, pricer)
    return to_plan(captured, cluster, model_name, dtype, best, [best], [], wall_s)
