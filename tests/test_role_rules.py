"""The roles' rules asked once per key (``problem.Roles.allowed``): on meshes that give every rule of
``roles.problem_for`` something to check (dp, tp with and without sequence parallelism, cp, ep, HSDP), each
op is allowed exactly the strategies that asking the rule of its own strategies one by one allows, so each
rule's key holds all that its ``allow`` reads of an op; and ops alike (a layer's elementwise ops of one
shape and split) share a key, so the rule is asked fewer times than there are ops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.core.axes import MeshAxis
from autopar.core.constraints import Constraints
from autopar.cost_models import parse_cluster
from autopar.ir.capture import capture
from autopar.ir.loss_reduction import _ancestors
from autopar.models import build_model
from autopar.planning import problem as problem_module
from autopar.planning.meshes import MeshChoice
from autopar.planning.roles import pricer_for, problem_for

DP, TP, CP, EP, REPLICATE = MeshAxis.DP_SHARD, MeshAxis.TP, MeshAxis.CP, MeshAxis.EP, MeshAxis.DP_REPLICATE
MESHES = [
    ("tiny-gpt", ((DP, 2), (TP, 4)), "sp=1"),
    ("tiny-gpt", ((DP, 4), (TP, 2)), "sp=0"),
    ("tiny-llama", ((DP, 2), (CP, 2), (TP, 2)), ""),
    ("tiny-moe", ((DP, 2), (EP, 2), (TP, 2)), ""),
    ("tiny-gpt", ((REPLICATE, 2), (DP, 4)), "fsdp=3"),
]


class _SquareTwice(nn.Module):
    """Reads its square ``[16, 16]`` input twice through matmuls of one signature: as it is (the batch on dim
    0) and transposed (the batch on dim 1), so the two ops share their strategies but not what the
    data-parallel rule requires of them."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 16))
        self.w2 = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w1 + (x.t() @ self.w2).t()


def test_ops_of_one_signature_that_the_rules_tell_apart_are_asked_apart(monkeypatch):
    x, target = torch.randn(16, 16), torch.randn(16, 16)
    captured = capture(_SquareTwice(), (x,), target, lambda out, y: ((out - y) ** 2).mean())
    mesh = MeshChoice(((DP, 4),), 1)  # the data-parallel rule alone
    pricer = pricer_for(parse_cluster("1x4xH100"), mesh, "bf16", Constraints())
    matmuls: dict[str, list] = {}
    remembered = problem_module.Roles.allowed

    def recording(roles, node, strategies):
        allowed = remembered(roles, node, strategies)
        if node.target is torch.ops.aten.mm.default and node.args[1].name in captured.params:
            matmuls[node.name] = allowed
        return allowed

    monkeypatch.setattr(problem_module.Roles, "allowed", recording)
    problem_for(captured, mesh, pricer, 80e9, Constraints(), edges=False)
    first, second = matmuls.values()
    assert {s.inputs[0][0] for s in first} != {s.inputs[0][0] for s in second}, (first, second)


@pytest.mark.parametrize("name, dims, constraints", MESHES, ids=[f"{m}-{'x'.join(f'{a.value}{s}' for a, s in d)}"
                                                                  for m, d, _ in MESHES])
def test_rules_asked_once_per_key_allow_what_each_op_asked_alone_allows(monkeypatch, name, dims, constraints):
    bundle = build_model(name, global_batch=16)
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    mesh = MeshChoice(dims, 1)
    pinned = Constraints.parse(constraints)
    pricer = pricer_for(parse_cluster("1x8xH100"), mesh, "bf16", pinned)
    remembered = problem_module.Roles.allowed
    asked: list[problem_module.Roles] = []

    def checked(roles, node, strategies):
        alone = [s for s in strategies if roles.rule.allow(node, s)] or strategies
        allowed = remembered(roles, node, strategies)
        assert allowed == alone, node.name
        asked.append(roles)
        return allowed

    monkeypatch.setattr(problem_module.Roles, "allowed", checked)
    problem_for(captured, mesh, pricer, 80e9, pinned, edges=False)
    roles = asked[0]
    assert all(r is roles for r in asked) and len(asked) > 50 and roles.rule is not problem_module.ALLOW_ANY
    assert len(roles._allowed) < len(asked), (len(roles._allowed), len(asked))  # ops alike asked once


def test_ops_made_from_neither_data_nor_parameters_stay_whole_on_data_parallel_dims():
    """The rotary tables and positions a model makes from ``arange`` and its buffers are read whole by every
    rank beside its share of the batch: on dp and ep they are offered whole only (they had every placement
    there, each a decision's worth of options and edge pairs), while on tp the solver still places them."""
    bundle = build_model("tiny-moe", global_batch=16)
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    mesh = MeshChoice(((DP, 2), (EP, 2), (TP, 2)), 1)
    pricer = pricer_for(parse_cluster("1x8xH100"), mesh, "bf16", Constraints())
    problem = problem_for(captured, mesh, pricer, 80e9, Constraints(), edges=False)
    made = {node.name for node in captured.graph.nodes if node.op == "call_function"
            and not any(a.name in captured.params or a.name in captured.user_inputs
                        for a in _ancestors(node))}
    constant = [d for d in problem.decisions.values() if set(d.nodes) <= made]
    assert constant, "tiny-moe makes its rotary tables in its step"
    for decision in constant:
        for option in decision.options:
            placed = [p for p in option.strategy.outputs if p is not None]
            assert all(p[0].is_replicate() and p[1].is_replicate() for p in placed), (decision.key, option.strategy)
    assert any(len({p[2] for o in d.options for p in o.strategy.outputs if p is not None}) > 1 for d in constant)
