"""The public entry points: ``plan`` (offline), ``autoparallelize`` (under torchrun), ``compare``.

``plan`` needs no process group and no GPU: a model on the meta device is captured on fake tensors
and planned for any cluster spec. ``autoparallelize`` runs in every rank of a job: it plans for the
world it runs in (or takes a given plan), then returns that rank's ``ParallelModule`` (a
``PipelineParallelModule`` for plans with pipeline stages).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autopar.ir.capture import TRACED_LAYERS, CapturedGraph, capture
from autopar.cost_models import Cluster, ClusterSpecError, parse_cluster
from autopar.core.batch import batch_carriers
from autopar.core.constraints import Constraints
from autopar.core.errors import BadInputError, PlanFormatError
from autopar.core.files import check_writable
from autopar.core.axes import ZERO_AXES
from autopar.core.placement import str_to_placement
from autopar.core.plan import LOWERED, RING, Plan
from autopar.cost_models.pipeline import SIMULATED as ZERO_BUBBLE_SCHEDULES
from autopar.models.hf import unpermuted_experts
from autopar.models.moe import routing_facts
from autopar.planning import whatif
from autopar.planning.assemble import fingerprint, model_dims
from autopar.planning.progress import SearchProgress
from autopar.planning.search import make_plan
from autopar.ir.problem_file import SavedProblem, save_problem as write_problem_file
from autopar.cost_models.hardware import preset_for_cuda_name

if TYPE_CHECKING:  # the runtimes import the rewrite passes, AOT autograd and pipelining: only autoparallelize
    # needs them, so planning, inspecting and re-solving a saved problem start without them
    from autopar.runtime.parallel_module import ParallelModule
    from autopar.runtime.pipeline import PipelineParallelModule


def plan(
    model: nn.Module | SavedProblem,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor | None = None,
    cluster: str | Cluster = "1x8xH100",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    constraints: Constraints | Mapping[str, Any] | None = None,
    *,
    example_targets: torch.Tensor | None = None,
    name: str | None = None,
    save_problem: str | Path | None = None,
    progress: Callable[[SearchProgress], None] | None = None,
) -> Plan:
    """Plan the training step ``loss_fn(model(*example_inputs), example_targets)`` on ``cluster``.

    ``example_inputs`` carry the global batch's shapes on dim 0 (meta tensors are fine; an input whose dim 0
    is not the batch size, such as a 0-dim scale or positions ``[seq]``, is read whole). Without
    ``example_targets`` the step is ``loss_fn(model(*example_inputs))`` (a one-argument loss); without
    ``loss_fn`` the model itself must return the scalar loss (``model(*example_inputs, example_targets)``
    when targets are given). A model or loss that cannot take these arguments raises BadInputError. ``model`` may instead be a saved planning problem
    (``autopar.load_problem(path)``): planning then skips the capture, and the problem already fixes
    inputs, targets and loss. ``save_problem`` writes the captured problem to that file (before
    solving) for re-solving and re-pricing later (``autopar.reprice``). ``constraints`` pin degrees and
    options (``{"dp": 2, "fsdp": 0}``; keys and values: ``autopar.core.constraints.Constraints``); they
    and the cluster are checked before the capture. ``progress`` is called with the search's
    ``SearchProgress`` at every step (phase, candidates solved and pruned, best plan so far).
    """
    pinned, target = as_constraints(constraints), resolve_cluster(cluster)
    if save_problem is not None:
        check_writable(save_problem, "save_problem")
    search = SearchProgress(progress)
    with search.phase("capture"):
        captured, default_name = _captured_step(model, example_inputs, loss_fn, example_targets)
    model_name = name or default_name
    _warn_of_unpermuted_experts(model)
    facts = _model_facts(model, example_inputs)
    if save_problem is not None:
        write_problem_file(captured, save_problem, model_name=model_name, facts=facts)
    return _planned(captured, target, model_name, pinned, facts, search)


def _warn_of_unpermuted_experts(model: nn.Module | SavedProblem) -> None:
    """Warn where a transformers mixture-of-experts model runs its experts as transformers does
    (``models.hf.unpermuted_experts``): every rank would run them whole, and ``ep`` could split nothing."""
    found = unpermuted_experts(model) if isinstance(model, nn.Module) else []
    if found:
        warnings.warn(f"autopar: {', '.join(found)} run{'s' if len(found) == 1 else ''} transformers' own experts "
                      "implementation, whose ops no mesh dim splits (every rank runs them whole); call "
                      "autopar.models.hf.use_permuted_experts(model, seq) first, so that expert parallelism splits "
                      "the experts (with capacity_factor=..., tokens past each expert's capacity are dropped and the "
                      "experts run on that capacity; without, on a slot per token)", stacklevel=3)


def _model_facts(model: nn.Module | SavedProblem, example_inputs: Any) -> dict[str, Any]:
    """What a plan states about the model that its graph does not show, read from the model's code (a
    saved problem's, as saved with it): its config's named sizes (``dims``) and a mixture-of-experts
    model's routing, capacity, dropped-token policy and router imbalance assumption (``moe``,
    ``models/moe.routing_facts``)."""
    if isinstance(model, SavedProblem):
        return dict(model.facts)
    config, first = getattr(model, "config", None), _as_tuple(example_inputs)[0]
    facts = {"dims": model_dims(config) if config is not None else None,
             "moe": routing_facts(model, int(first.shape[1])) if first.ndim > 1 else None}
    return {key: value for key, value in facts.items() if value}


def _planned(captured: CapturedGraph, cluster: Cluster, name: str, constraints: Constraints,
             facts: Mapping[str, Any], progress: SearchProgress | None = None) -> Plan:
    """The best plan for ``captured`` on ``cluster``, stating the model's ``facts`` (``_model_facts``)."""
    made = make_plan(captured, cluster, model_name=name, constraints=constraints, model_dims=facts.get("dims"),
                     progress=progress)
    return replace(made, model={**made.model, "moe": facts["moe"]}) if "moe" in facts else made


def _captured_step(model: nn.Module | SavedProblem, example_inputs: Any, loss_fn: Any,
                   example_targets: Any) -> tuple[CapturedGraph, str]:
    """The training step's graph (captured now, or read from a saved problem) and the model's name."""
    if isinstance(model, SavedProblem):
        if example_inputs is not None or loss_fn is not None or example_targets is not None:
            raise BadInputError("a saved problem already fixes the inputs, targets and loss: pass only "
                                "cluster and constraints (re-capture the model to change them)")
        return model.captured, model.model_name
    if example_inputs is None:
        raise BadInputError("plan(model, example_inputs, ...) needs example inputs (or a saved problem "
                            "from autopar.load_problem in place of the model)")
    return (capture(model, _as_tuple(example_inputs), example_targets, loss_fn, traced_layers=TRACED_LAYERS),
            type(model).__name__)


def autoparallelize(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    plan: Plan | str | None = None,
    cluster: str | Cluster | None = None,
    constraints: Constraints | Mapping[str, Any] | None = None,
    *,
    example_targets: torch.Tensor | None = None,
    check_memory: bool = True,
    lowered: bool | None = None,
    compile: bool = False,
    init_weights: Callable[[nn.Module], None] | None = None,
) -> ParallelModule | PipelineParallelModule:
    """This rank's parallel module. Call in every rank of an initialized process group.

    Every rank starts from rank 0's parameters and buffers (broadcast first, as DDP does), so ranks that
    built or seeded the model differently still train one model. A model built on the meta device (too large
    for a host) is not built whole anywhere: each rank allocates its own shards and initializes them with
    ``init_weights(model)``, or by default each module's ``reset_parameters()`` (and ``reset_buffers()``),
    children first; a tensor the initialization leaves unset is refused (``runtime/deferred_init.py``). The
    model is left on the meta device. ``init_weights`` is only for such a model.
    ``plan`` may be a Plan or a plan file; without one, rank 0 plans for ``cluster`` (default: the
    world this job runs in) under ``constraints`` and every rank receives the same plan. A plan whose
    predicted per-device peak memory exceeds this rank's device (a GPU's memory; on CPU the host's
    memory divided among its ranks) is refused with ``NoFeasiblePlanError`` before anything is built
    (``runtime/fits.py``); ``check_memory=False`` runs it anyway. The step is
    ``loss_fn(model(*example_inputs), example_targets)``, or ``loss_fn(model(*example_inputs))`` without
    targets, as in ``plan``; ``step`` takes the inputs, then the targets if any.

    The runtime: ``lowered=True`` runs the rank's program as forward and backward graphs of local tensor
    ops with explicit collectives, traced once at the first step (``passes/lower.py``); ``lowered=False``
    runs it on DTensor, op by op; ``compile=True`` lowers it and compiles the graphs with inductor. Under
    a pipeline each of the rank's chunks is lowered so (zero-bubble schedules, which split each chunk's
    backward, run on DTensor whatever these say, with a warning). By default (``lowered=None``) the
    program runs lowered wherever the lowered runtime runs the plan (``lowered_by_default``), as it
    measures faster than DTensor on every configuration benchmarked.
    """
    pinned = as_constraints(constraints)
    if not dist.is_initialized():
        raise BadInputError("autoparallelize needs an initialized process group: launch with torchrun "
                            "(or call torch.distributed.init_process_group) first")
    from autopar.runtime.mesh import start_from_rank_zero

    deferred = _deferred_initialization(model, init_weights)
    start_from_rank_zero(model)  # every rank shards rank 0's weights, however each rank built or seeded its own
    inputs = _as_tuple(example_inputs)
    captured = capture(model, _on_meta(inputs, deferred), _on_meta(example_targets, deferred), loss_fn)
    _warn_of_unpermuted_experts(model)
    the_plan = _plan_for_job(captured, plan, cluster, pinned, type(model).__name__, _model_facts(model, inputs))
    if the_plan.model.get("graph_fingerprint") != fingerprint(captured):
        raise PlanFormatError("the plan was made for a different model or input shapes "
                              f"(plan model {the_plan.model.get('name')!r}); re-plan for this model")
    from autopar.passes.mixed_precision import program_dtype
    from autopar.runtime.parallel_module import ParallelModule, mesh_for_plan

    m, dtype = the_plan.pipeline.microbatches, program_dtype(the_plan.precision)
    if m > 1 or dtype is not None:  # the program runs one microbatch at a time, in the compute dtype: capture that
        first = _first_microbatch(inputs + ((example_targets,) if example_targets is not None else ()), m)
        captured = capture(model, _on_meta(first[:len(inputs)], deferred),
                           _on_meta(first[len(inputs)] if example_targets is not None else None, deferred),
                           loss_fn, dtype=dtype)
    if lowered is None:
        lowered = lowered_by_default(the_plan)
    if the_plan.degrees.pp > 1:
        from autopar.runtime.pipeline import PipelineParallelModule

        return PipelineParallelModule(model, captured, the_plan, check_memory=check_memory, lowered=lowered,
                                      compile=compile, init_weights=init_weights)
    priced_lowered = the_plan.predicted.get("runtime") == LOWERED
    if priced_lowered and shards_parameters_over_data(the_plan) and not (lowered or compile):
        warnings.warn("autopar: the plan was priced for the lowered runtime and runs on DTensor (lowered=False): its "
                      "FSDP gradient reductions and backward regathers will not overlap backward as priced; pass "
                      "lowered=True or plan with constraint runtime=dtensor", stacklevel=2)
    return ParallelModule(model, captured, the_plan, mesh_for_plan(the_plan), check_memory=check_memory,
                          lowered=lowered, compile=compile, init_weights=init_weights)


def lowered_by_default(plan: Plan) -> bool:
    """Whether ``autoparallelize`` runs ``plan`` lowered when not told (``lowered=None``): yes but where the
    lowered runtime would run it on DTensor anyway: a zero-bubble pipeline schedule (torch splits each
    chunk's backward at its parameters, inside what a lowered chunk runs as one graph) and ring attention
    (its exchanges, and which blocks each query sees, run eagerly). Measured (``benchmarks/runtime_overhead.py``,
    benchmarks/README.md): the lowered step takes 0.44-0.76x the DTensor step on every parallelism there, on 2
    and 4 ranks; Hugging Face models, expert and context parallelism train to the same numbers lowered."""
    zero_bubble = plan.degrees.pp > 1 and plan.pipeline.schedule in ZERO_BUBBLE_SCHEDULES
    ring = plan.degrees.cp > 1 and plan.cp_attention == RING
    return not (zero_bubble or ring)


def shards_parameters_over_data(plan: Plan) -> bool:
    """Whether some parameter of ``plan`` is sharded over a dim whose ranks read the same parameters (``dp``,
    ``cp``: FSDP), where the lowered runtime overlaps its backward regathers and gradient reduce_scatters
    with backward and DTensor does not (``planning/pricing.py``); elsewhere both runtimes price alike."""
    zero_axes = {axis.value for axis in ZERO_AXES}
    dims = [i for i, name in enumerate(plan.mesh.dim_names) if name in zero_axes]
    return any(str_to_placement(placements[i]).is_shard() for placements in plan.placements.values() for i in dims)


def float8_eager(model: nn.Module, example_inputs: Sequence[torch.Tensor] | torch.Tensor,
                 loss_fn: Callable[..., torch.Tensor] | None = None, *,
                 example_targets: torch.Tensor | None = None) -> list[str]:
    """Make ``model``'s linear layers that a float8 plan (``fp8=tensorwise``) runs in float8 run so in eager
    PyTorch too, in place: one process training as the plan's ranks do together (the parity tests'
    reference), or a float8 model to try before planning. The layers are those the planner takes in the step
    ``loss_fn(model(*example_inputs), example_targets)`` (``autopar/ir/float8.py``); their ``forward``
    becomes ``passes.float8.float8_linear``. Returns their module names."""
    from autopar.ir.float8 import float8_weights
    from autopar.passes.float8 import float8_eager as run_linears_in_float8

    captured = capture(model, _as_tuple(example_inputs), example_targets, loss_fn)
    return run_linears_in_float8(model, float8_weights(captured))


def compare(*plans: Plan) -> str:
    """Side-by-side table of plans: degrees, placements that differ, cost terms and their deltas."""
    from autopar.inspect.show import compare_plans

    return compare_plans(list(plans))


def reprice(plan: Plan, problem: SavedProblem | CapturedGraph, cluster: str | Cluster) -> Plan:
    """``plan``'s strategies, unchanged, priced on ``cluster`` (same number of devices): what-if
    without re-capturing (``problem`` from ``autopar.load_problem``)."""
    return whatif.reprice(plan, problem, resolve_cluster(cluster))


def as_constraints(constraints: Constraints | Mapping[str, Any] | None) -> Constraints:
    """The API's ``constraints=``, checked: a ``Constraints`` as it is, a mapping (or None) converted."""
    if isinstance(constraints, Constraints):
        return constraints
    if constraints is not None and not isinstance(constraints, Mapping):
        raise BadInputError(f"constraints must be a mapping such as {{'dp': 2, 'fsdp': 0}} or a Constraints, got "
                            f"{type(constraints).__name__}")
    return Constraints.from_mapping(constraints or {})


def resolve_cluster(cluster: str | Cluster | None) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    try:
        return parse_cluster(local_cluster_spec() if cluster is None else cluster)
    except ClusterSpecError as exc:  # cost_models imports nothing of autopar: its error becomes autopar's here
        raise BadInputError(str(exc)) from None


def local_cluster_spec() -> str:
    """``1xWxTYPE`` for the job this process belongs to (the whole world on one node's links); on CPU with
    ``mem=`` this rank's share of the host's memory (``runtime/fits.py``), the memory the runtime checks
    the plan against, so a plan made here is one the runtime accepts."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        device = preset_for_cuda_name(name)
        per_node = min(world, torch.cuda.device_count())
        return f"{world // per_node}x{per_node}x{device}"
    from autopar.runtime.fits import device_memory_bytes

    share, _ = device_memory_bytes("cpu")
    return f"1x{world}xcpu,mem={share // 10**6 / 1000}GB"  # rounded down to a megabyte


def _plan_for_job(captured: CapturedGraph, plan_: Plan | str | None, cluster: Any,
                  constraints: Constraints, name: str, facts: Mapping[str, Any]) -> Plan:
    if isinstance(plan_, Plan):
        return plan_
    if isinstance(plan_, str):
        return Plan.load(plan_)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box[0] = _planned(captured, resolve_cluster(cluster), name, constraints, facts).to_dict()
    dist.broadcast_object_list(box, src=0)
    return Plan.from_dict(box[0])


def _deferred_initialization(model: nn.Module, init_weights: Callable[[nn.Module], None] | None) -> bool:
    """Whether ``model`` was built on the meta device, its shards to be made and initialized by the runtime;
    ``init_weights`` given for a model that has its weights is refused (it would not run)."""
    from autopar.runtime.deferred_init import holds_meta_tensors

    deferred = holds_meta_tensors(model)
    if init_weights is not None and not deferred:
        raise BadInputError("init_weights initializes a model built on the meta device, and this model has its "
                            "weights: initialize it before autoparallelize, or build it under "
                            "torch.device('meta')")
    return deferred


def _on_meta(tensors: Any, deferred: bool) -> Any:
    """The example inputs (a tensor, a tuple of them or None) on the meta device where the model is, to be
    captured with it; as given otherwise."""
    if not deferred or tensors is None:
        return tensors
    return tensors.to("meta") if isinstance(tensors, torch.Tensor) else tuple(t.to("meta") for t in tensors)


def _first_microbatch(tensors: tuple[torch.Tensor, ...], microbatches: int) -> tuple[torch.Tensor, ...]:
    """The first of ``microbatches`` microbatches of a step's inputs and targets: the rows of those that carry
    the batch (``core/batch.batch_carriers``, as ``runtime/inputs.microbatch_shape`` cuts them), the others whole."""
    carriers = batch_carriers([t.shape for t in tensors])
    return tuple(t[: t.shape[0] // microbatches] if carries else t for t, carries in zip(tensors, carriers))


def _as_tuple(x: Sequence[torch.Tensor] | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The example inputs as a tuple of tensors; anything else (a dict of tensors, say) refused, naming it."""
    inputs = (x,) if isinstance(x, torch.Tensor) else tuple(x)
    for i, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor):
            raise BadInputError(f"example input {i} is a {type(value).__name__}, not a tensor: autopar plans and "
                                "runs models whose forward takes positional tensors (wrap one that takes a "
                                f"{type(value).__name__}, as autopar.models.hf.HFModel wraps keyword inputs)")
    return inputs
