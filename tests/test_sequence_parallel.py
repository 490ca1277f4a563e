"""Sequence parallelism (constraint ``sp``): which ops it splits, what the planner does with ``sp=0|1``,
the collectives it predicts, its errors, the CLI, and on gloo: numerical parity of TP+SP plans (3 SGD
steps at world 2 and 4: gradients after the first backward rtol 1e-4 / atol 1e-5, losses rtol 1e-4,
parameters atol 1e-5) and forward collective parity."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cli_runner import run_cli
from autopar import BadInputError
from autopar.ir.capture import capture
from autopar.cost_models import parse_cluster
from autopar.models import build_model
from autopar.testing.parity import train_parallel_many, train_single
from autopar.core.constraints import Constraints
from autopar.planning.search import make_plan
from autopar.planning.problem import source_of
from autopar.planning.sequence_parallel import norm_sites, sequence_region

MODELS = ("tiny-gpt", "tiny-llama")
STEPS = 3
BATCH = 8


@pytest.fixture(scope="module")
def captured():
    """tiny-gpt (LayerNorm) and tiny-llama (RMSNorm, decomposed into pow/mean/rsqrt/mul), batch 8."""
    out = {}
    for name in MODELS:
        bundle = build_model(name, global_batch=BATCH)
        out[name] = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    return out


@pytest.fixture(scope="module")
def plans(captured):
    """Per model, tp=4 plans on 1x4xcpu with sp pinned to 1 and to 0."""
    return {(name, sp): make_plan(captured[name], parse_cluster("1x4xcpu"), model_name=name,
                                  constraints=Constraints(tp=4, sp=sp))
            for name in MODELS for sp in (1, 0)}


class Block(nn.Module):
    def __init__(self, hidden: int, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Norms(nn.Module):
    """Torch's RMSNorm and LayerNorm modules, then a functional layer norm outside any norm module."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.a = Block(hidden, nn.RMSNorm(hidden))
        self.b = Block(hidden, nn.LayerNorm(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(self.a(x))
        return F.layer_norm(y, (y.shape[-1],))


def _tp_dim(plan) -> int:
    return plan.mesh["dim_names"].index("tp")


def _out(plan, name: str) -> list[str]:
    return plan.ops[name]["outputs"][0]


def _fed_partial(captured, plan) -> list[str]:
    """Residual-stream ops (not norms) reading a value the plan leaves partial on tp: a row-parallel output."""
    norms = {n for site in norm_sites(captured) for n in site.nodes}
    tp = _tp_dim(plan)
    fed = []
    for name in sequence_region(captured, norm_sites(captured)):
        if name in norms:
            continue
        sources = [source_of(a) for a in captured.node(name).all_input_nodes]
        if any(src.name in plan.ops and plan.ops[src.name]["outputs"][i][tp] == "P" for src, i in sources):
            fed.append(name)
    return fed


def _region_comm(captured, plan, kind: str) -> float:
    """Predicted seconds of collective ``kind`` on the ops of the norms and the residual stream."""
    region = sequence_region(captured, norm_sites(captured))
    return sum(plan.ops[n]["cost"]["comm_s"].get(kind, 0.0) for n in region if n in plan.ops)


# ---- which ops ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, size", [("tiny-gpt", 2), ("tiny-llama", 6)])
def test_every_norm_is_found_with_its_sequence_dim(captured, name: str, size: int) -> None:
    """Two norms per layer and a final one; a decomposed RMSNorm is six ops, a LayerNorm one (and getitem)."""
    sites = norm_sites(captured[name])
    assert len(sites) == 2 * 2 + 1
    assert all(site.seq_dim == 1 and site.ndim == 3 and site.seq_len == 32 for site in sites)
    assert all(len(site.nodes) == size for site in sites)
    region = sequence_region(captured[name], sites)
    residual_adds = [n for n in region if captured[name].node(n).target == torch.ops.aten.add.Tensor
                     and not any(n in site.nodes for site in sites)]
    assert len(residual_adds) >= 2 * 2  # the two residual adds of every layer


def test_torch_norm_modules_and_functional_norms_are_found() -> None:
    x = torch.randn(4, 8, 16)
    graph = capture(Norms(), (x,), torch.randn(4, 8, 16), F.mse_loss)
    sites = norm_sites(graph)
    assert [len(site.nodes) for site in sites] == [6, 2, 1]  # nn.RMSNorm decomposed, nn.LayerNorm, F.layer_norm
    assert all(site.seq_dim == 1 for site in sites)
    stream = set(sequence_region(graph, sites)) - {n for site in sites for n in site.nodes}
    assert stream == {"add_1", "add_2"}  # the two residual adds


def test_a_norm_without_a_sequence_dim_is_left_alone() -> None:
    graph = capture(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)), (torch.randn(4, 16),),
                    torch.randn(4, 16), F.mse_loss)
    assert norm_sites(graph) == []


# ---- planning -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_sp1_splits_norms_and_residual_stream_on_the_sequence(captured, plans, name: str) -> None:
    plan, graph = plans[(name, 1)], captured[name]
    assert plan.degrees["tp"] == 4 and plan.degrees["sp"] == 4
    tp = _tp_dim(plan)
    sites = norm_sites(graph)
    for op, seq_dim in sequence_region(graph, sites).items():
        if op in plan.ops:
            assert _out(plan, op)[tp] == f"S({seq_dim})", (op, _out(plan, op))
    for site in sites:
        assert _out(plan, site.output)[tp] == "S(1)"


@pytest.mark.parametrize("name", MODELS)
def test_sp1_reduce_scatters_row_parallel_outputs(captured, plans, name: str) -> None:
    sp, no_sp = plans[(name, 1)], plans[(name, 0)]
    assert no_sp.degrees["sp"] == 1
    assert all(_out(no_sp, site.output)[_tp_dim(no_sp)] != "S(1)" for site in norm_sites(captured[name]))
    fed = _fed_partial(captured[name], sp)
    assert fed, "a TP+SP plan feeds row-parallel outputs into the residual stream"
    for op in fed:
        comm = sp.ops[op]["cost"]["comm_s"]
        assert comm.get("reduce_scatter", 0) > 0 and not comm.get("all_reduce"), (op, comm)
    assert _region_comm(captured[name], sp, "all_reduce") == 0
    assert sp.predicted["comm_s"]["reduce_scatter"] > 0 and sp.predicted["comm_s"]["all_gather"] > 0


def test_tp_all_reduces_what_tp_sp_reduce_scatters_and_all_gathers(plans) -> None:
    """tiny-gpt: its best sp=0 plan is Megatron's TP (replicated norms, all_reduce after row-parallel)."""
    sp, no_sp = plans[("tiny-gpt", 1)].predicted["comm_s"], plans[("tiny-gpt", 0)].predicted["comm_s"]
    assert no_sp["reduce_scatter"] == 0 and no_sp["all_reduce"] > 0
    assert sp["reduce_scatter"] > 0 and sp["all_gather"] > no_sp["all_gather"]
    assert sp["all_reduce"] < no_sp["all_reduce"]


def test_sp1_with_dp_keeps_the_batch_on_dp(captured) -> None:
    plan = make_plan(captured["tiny-llama"], parse_cluster("1x4xcpu"), model_name="tiny-llama",
                     constraints=Constraints(dp=2, tp=2, sp=1))
    assert plan.mesh["dim_names"] == ["dp", "tp"]
    assert plan.degrees["sp"] == 2
    assert all(_out(plan, site.output) == ["S(0)", "S(1)"] for site in norm_sites(captured["tiny-llama"]))


def test_sp1_searches_only_meshes_with_tp(captured) -> None:
    plan = make_plan(captured["tiny-gpt"], parse_cluster("1x4xcpu"), model_name="tiny-gpt",
                     constraints=Constraints(sp=1))
    assert plan.degrees["tp"] > 1 and plan.degrees["sp"] == plan.degrees["tp"]
    assert all(c["degrees"]["tp"] > 1 for c in plan.candidates)


@pytest.mark.parametrize("value, expected", [(1, 1), (0, 0), ("true", 1), ("False", 0), (True, 1), ("1", 1)])
def test_sp_accepts_0_1_true_false(value, expected) -> None:
    assert Constraints.from_mapping({"sp": value}).sp == expected


@pytest.mark.parametrize("constraints, cluster, mentions", [
    ({"sp": 2}, "1x4xcpu", "sp must be 0 or 1 (or false/true), got 2"),
    ({"sp": "yes"}, "1x4xcpu", "got 'yes'"),
    ({"sp": 1, "tp": 1}, "1x4xcpu", "tp=1"),
    ({"sp": 1}, "1x1xcpu", "tp > 1"),
    ({"sp": 1, "tp": 64}, "8x8xH100", "sequence length 32"),
])
def test_bad_sp_is_refused_naming_it(captured, constraints, cluster, mentions) -> None:
    with pytest.raises(BadInputError, match="sp") as err:
        make_plan(captured["tiny-gpt"], parse_cluster(cluster), model_name="tiny-gpt",
                  constraints=Constraints.from_mapping(constraints))
    assert mentions in str(err.value)


def test_sp1_on_a_model_without_sequence_norms_is_refused() -> None:
    bundle = build_model("mlp", global_batch=8)
    graph = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    with pytest.raises(BadInputError, match="sp=1: the model has no LayerNorm or RMSNorm"):
        make_plan(graph, parse_cluster("1x4xcpu"), model_name="mlp", constraints=Constraints(sp=1))


def test_cli_fix_sp() -> None:
    run = run_cli("plan", "tiny-gpt", "--cluster", "1x4xcpu", "--fix", "tp=4,sp=1", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["degrees"]["sp"] == 4
    bad = run_cli("plan", "tiny-gpt", "--cluster", "1x4xcpu", "--fix", "tp=4,sp=on")
    assert bad.returncode == 2 and "sp must be 0 or 1 (or false/true), got 'on'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


# ---- numerical parity on gloo ---------------------------------------------------------------------

@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world, constraints", [(2, {"tp": 2, "sp": 1}),
                                                 pytest.param(4, {"dp": 2, "tp": 2, "sp": 1}, marks=pytest.mark.extended)])
def test_tp_sp_matches_single_process(world: int, constraints: dict) -> None:
    """3 SGD steps under TP+SP (norms and residual adds split on the sequence over tp) == one process."""
    runs = [dict(name=name, overrides=None, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                 constraints=constraints) for name in MODELS]
    results = train_parallel_many(world, runs)
    for name, result in zip(MODELS, results):
        assert result.plan["degrees"]["sp"] == 2, name
        result.assert_matches(train_single(name, None, BATCH, None, STEPS))


def _counted_sp_steps(rank: int, world: int) -> list[dict]:
    from test_collective_parity import _counted_step

    return [_counted_step(rank, world, name, {"tp": 2, "sp": 1}) for name in MODELS]


@pytest.mark.dist
@pytest.mark.slow
def test_tp_sp_forward_runs_exactly_the_predicted_collectives() -> None:
    """Forward collective parity of TP+SP: the all_gathers before column-parallel matmuls and the
    reduce_scatters after row-parallel ones are the ones the plan prices (backward: see
    ``test_collective_parity``, "gathered, then partial")."""
    from autopar.testing.counters import as_run_on_gloo

    from autopar.inspect.collectives import predicted_collectives
    from autopar.testing.launch import run_on_ranks

    for result in run_on_ranks(_counted_sp_steps, 2)[0]:
        assert result["forward"] == as_run_on_gloo(predicted_collectives(result["plan"], ["forward"]))
        assert result["forward"].get("reduce_scatter", 0) > 0
        # the layers reduce-scatter their outputs (an all_reduce may be chosen after them, for the head)
        assert not [name for name, op in result["plan"]["ops"].items() if op["module"].startswith("blocks.")
                    for c in op.get("collectives", []) if c["phase"] == "forward" and c["kind"] == "all_reduce"]
