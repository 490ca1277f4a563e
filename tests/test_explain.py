"""``autopar explain`` / ``Plan.explain``: alternatives of a decision priced against the solution."""

from __future__ import annotations


import pytest

from cli_runner import run_cli
import autopar
from contracts import assert_alternatives_priced_exactly
from autopar.models import build_model


@pytest.fixture(scope="module")
def plan() -> autopar.Plan:
    b = build_model("tiny-gpt", global_batch=8, device="meta")
    return autopar.plan(b.model, b.example_inputs, "1x4xH100", b.loss_fn, {"tp": 4},
                        example_targets=b.example_targets)


def test_no_single_change_beats_the_optimum(plan: autopar.Plan) -> None:
    """The solution is optimal and memory is far from binding here, so switching any one decision
    alone can only cost time: every alternative's delta is >= 0, the chosen one's is 0."""
    assert plan.solver["status"] == "optimal"
    decisions = plan.explanations["decisions"]
    assert decisions
    for entry in decisions.values():
        chosen = [r for r in entry["alternatives"] if r["chosen"]]
        assert len(chosen) == 1 and chosen[0]["delta_s"] == 0
        assert all(r["delta_s"] >= -1e-12 for r in entry["alternatives"])


def test_explain_by_parameter_and_by_node(plan: autopar.Plan) -> None:
    text = plan.explain("blocks.0.mlp.fc_in.weight")
    assert "param:blocks.*.mlp.fc_in.weight" in text and "chosen" in text
    node = next(n for n, op in plan.ops.items() if op["op"] == "aten.addmm.default")
    text = plan.explain(node)
    assert text.startswith(node) and "chosen" in text and "more per step" in text


def test_explain_unknown_name_is_a_clear_error(plan: autopar.Plan) -> None:
    with pytest.raises(KeyError, match="not an op or parameter"):
        plan.explain("no.such.weight")


def test_explain_cli(plan: autopar.Plan, tmp_path) -> None:
    path = tmp_path / "plan.json"
    plan.save(path)
    run = run_cli("explain", str(path), "lm_head.weight")
    assert run.returncode == 0, run.stderr
    assert "lm_head" in run.stdout and "chosen" in run.stdout
    bad = run_cli("explain", str(path), "nope")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_an_alternative_placement_of_a_parameter_is_priced_with_its_readers_gradient_reduction() -> None:
    """Each alternative's ``delta_s`` is exactly the step-time change of taking it alone, also for a
    parameter whose placement changes how the op reading it reduces its gradient (``RootSharding``):
    sharded, the gradient sync is replaced by the gather's reduce_scatter."""
    from torch.distributed.tensor import Replicate, Shard

    from autopar.planning.pricing import Cost
    from autopar.planning.problem import Decision, Edge, Option, Problem, RootSharding
    from autopar.planning.solver import evaluate
    from autopar.planning.strategies import Strategy

    r, s0 = (Replicate(),), (Shard(0),)
    w = Decision("w", ["w"], [Option(Strategy((), (r,)), Cost(memory_bytes=4.0)),
                              Option(Strategy((), (s0,)), Cost(memory_bytes=1.0))])
    mm = Decision("mm", ["mm"], [Option(Strategy((r,), (s0,)), Cost(compute_s=2e-3, backward_compute_s=1e-3,
                                                                       grad_sync_s=1e-3))])
    edge = Edge("w", 0, "mm", 0, 1, {(r, (r, ())): Cost(), (s0, (r, ())): Cost(comm_s={"all_gather": 4e-4})})
    term = RootSharding("mm", frozenset({0}), 0, "w", frozenset({1}), 1.0,
                        Cost(comm_s={"reduce_scatter": 5e-4}, grad_sync_s=-1e-3))
    problem = Problem((4,), {"w": w, "mm": mm}, [edge], 1e30, 0.5, root_terms=[term])
    assert_alternatives_priced_exactly(problem, "w", {"mm": 0})
    assert evaluate(problem, {"w": 1, "mm": 0})[0] == pytest.approx(2e-3 + 4e-4 + 5e-4)
    assert evaluate(problem, {"w": 0, "mm": 0})[0] == pytest.approx(2e-3 + 1e-3 - 0.5 * 1e-3)


def test_a_plan_file_without_the_optional_prices_of_an_alternative_is_explained(plan: autopar.Plan, tmp_path) -> None:
    """An alternative's own compute and communication are optional in a plan file (``core/plan.py``'s schema):
    one without them is explained with a dash, not a traceback (the heavy tier's fuzzing deleted them)."""
    data = plan.to_dict()
    entry = data["explanations"]["decisions"][data["explanations"]["index"]["blocks.0.mlp.fc_in.weight"]]
    for row in entry["alternatives"]:
        row.pop("compute_s", None)
        row.pop("comm_s", None)
    path = tmp_path / "plan.json"
    autopar.Plan.from_dict(data).save(path)
    shown = run_cli("explain", str(path), "blocks.0.mlp.fc_in.weight")
    assert shown.returncode == 0 and "chosen" in shown.stdout, shown.stderr
