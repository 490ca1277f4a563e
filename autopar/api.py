"""The public entry points: ``plan`` (offline), ``autoparallelize`` (under torchrun), ``compare``.

``plan`` needs no process group and no GPU: a model on the meta device is captured on fake tensors
and planned for any cluster spec. ``autoparallelize`` runs in every rank of a job: it plans for the
world it runs in (or takes a given plan), then returns that rank's ``ParallelModule``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .capture import CapturedGraph, capture
from .cost_models import Cluster, ClusterSpecError, parse_cluster
from .errors import BadInputError, PlanFormatError
from .plan import Plan
from .planner import fingerprint, make_plan
from .runtime import ParallelModule, mesh_for_plan

_CUDA_PRESETS = (("H200", "H200"), ("H100", "H100"), ("A100-SXM4-40GB", "A100-40GB"), ("A100", "A100-80GB"),
                 ("B200", "B200"))


def plan(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    cluster: str | Cluster = "1x8xH100",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    constraints: Mapping[str, Any] | None = None,
    *,
    example_targets: torch.Tensor | None = None,
    name: str | None = None,
) -> Plan:
    """Plan the training step ``loss_fn(model(*example_inputs), example_targets)`` on ``cluster``.

    ``example_inputs`` carry the global batch's shapes (meta tensors are fine). Without ``loss_fn``
    the model itself must return the scalar loss.
    """
    captured = capture(model, _as_tuple(example_inputs), example_targets, loss_fn)
    return make_plan(captured, resolve_cluster(cluster), model_name=name or type(model).__name__,
                     constraints=constraints)


def autoparallelize(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    plan: Plan | str | None = None,
    cluster: str | Cluster | None = None,
    constraints: Mapping[str, Any] | None = None,
    *,
    example_targets: torch.Tensor | None = None,
) -> ParallelModule:
    """This rank's parallel module. Call in every rank of an initialized process group.

    ``plan`` may be a Plan or a plan file; without one, rank 0 plans for ``cluster`` (default: the
    world this job runs in) and every rank receives the same plan.
    """
    if not dist.is_initialized():
        raise BadInputError("autoparallelize needs an initialized process group: launch with torchrun "
                            "(or call torch.distributed.init_process_group) first")
    inputs = _as_tuple(example_inputs)
    captured = capture(model, inputs, example_targets, loss_fn)
    the_plan = _plan_for_job(captured, plan, cluster, constraints, type(model).__name__)
    if the_plan.model.get("graph_fingerprint") != fingerprint(captured):
        raise PlanFormatError("the plan was made for a different model or input shapes "
                              f"(plan model {the_plan.model.get('name')!r}); re-plan for this model")
    m = int(the_plan.pipeline.get("microbatches", 1))
    if m > 1:  # the program runs one microbatch at a time: capture it at that shape
        captured = capture(model, tuple(_first_rows(t, m) for t in inputs),
                           _first_rows(example_targets, m) if example_targets is not None else None, loss_fn)
    return ParallelModule(model, captured, the_plan, mesh_for_plan(the_plan))


def compare(*plans: Plan) -> str:
    """Side-by-side table of plans: degrees, placements that differ, cost terms and their deltas."""
    from .report import compare_plans

    return compare_plans(list(plans))


def resolve_cluster(cluster: str | Cluster | None) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    if cluster is None:
        return parse_cluster(local_cluster_spec())
    try:
        return parse_cluster(cluster)
    except ClusterSpecError as exc:
        raise BadInputError(str(exc)) from None


def local_cluster_spec() -> str:
    """``1xWxTYPE`` for the job this process belongs to (the whole world on one node's links)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        device = next((preset for key, preset in _CUDA_PRESETS if key in name), "H100")
        per_node = min(world, torch.cuda.device_count())
        return f"{world // per_node}x{per_node}x{device}"
    return f"1x{world}xcpu"


def _plan_for_job(captured: CapturedGraph, plan_: Plan | str | None, cluster: Any,
                  constraints: Mapping[str, Any] | None, name: str) -> Plan:
    if isinstance(plan_, Plan):
        return plan_
    if isinstance(plan_, str):
        return Plan.load(plan_)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box[0] = make_plan(captured, resolve_cluster(cluster), model_name=name, constraints=constraints).to_dict()
    dist.broadcast_object_list(box, src=0)
    return Plan.from_dict(box[0])


def _first_rows(t: torch.Tensor, microbatches: int) -> torch.Tensor:
    return t[: t.shape[0] // microbatches]


def _as_tuple(x: Sequence[torch.Tensor] | torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)
