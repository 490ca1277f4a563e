"""Context parallelism (issue 16): the ``cp`` mesh role, pinned with ``--fix cp=N``, and parity on gloo.

* The planner: a pinned ``cp`` gets a ``cp`` mesh dim over which the inputs are split on the sequence,
  parameters stay whole, fused attention reads its queries split and its keys and values gathered, and
  the views that flatten the sequence into rows keep it split (run locally); through the CLI, and
  ``show``. Refused: a model without fused attention, a ``cp`` that does not divide the sequence,
  ``cp`` with pipeline stages.
* Parity on gloo (SGD, 3 steps, tiny-llama at 256 tokens; tiny-gpt at 32): gradients after the first
  backward, per-step losses and final parameters under cp=2, cp=4 and dp=2 x cp=2 equal single-process
  training (the causal mask of each rank's chunk of queries, the gathered keys' reduce-scattered
  gradients, the loss averaged over every token).
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.cli import main
from autopar.core.constraints import Constraints
from autopar.core.errors import BadInputError
from autopar.models import build_model
from autopar.testing.parity import train_parallel_many, train_single

BATCH = 8
STEPS = 3
LONG = {"seq": 256}
"""tiny-llama at a few hundred tokens: its preset's 32 raised (the rotary tables follow)."""


def _run(name: str, overrides: dict | None, constraints: dict) -> dict:
    return dict(name=name, overrides=overrides, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                constraints=constraints)


def _plan(name: str, constraints: dict, cluster: str, overrides: dict | None = None) -> dict:
    bundle = build_model(name, overrides=overrides, global_batch=BATCH)
    return autopar.plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn, constraints,
                        example_targets=bundle.example_targets).to_dict()


# ---- the planner ------------------------------------------------------------------------------------
def test_pinned_cp_splits_the_sequence_and_gathers_keys_and_values() -> None:
    plan = _plan("tiny-llama", {"cp": 2}, "1x2xcpu", LONG)
    assert plan["mesh"] == {"shape": [2], "dim_names": ["cp"]}
    assert plan["degrees"]["cp"] == 2 and plan["degrees"]["dp"] == 1
    assert all(spec["placements"] == ["S(1)"] for spec in plan["inputs"].values())
    assert all(p == ["R"] for p in plan["placements"].values())
    attention = [op for op in plan["ops"].values() if "scaled_dot_product_attention" in op["op"]]
    assert attention and all(op["inputs"] == [["S(2)"], ["R"], ["R"]] and op["outputs"] == [["S(2)"]]
                             and op["local"] for op in attention)
    flattening = [op for op in plan["ops"].values() if op["op"] == "aten.view.default" and op.get("local")]
    assert flattening and all({op["inputs"][0][0], op["outputs"][0][0]} == {"S(0)", "S(1)"} for op in flattening)


def test_fix_cp_on_the_command_line_and_show(tmp_path, capsys) -> None:
    """Llama 3 8B at 32k tokens under cp=4 x tp=2 (on 16 H100s: dp=2 leaves ZeRO room for the AdamW
    state, which one node's 8 cannot hold with parameters whole on cp)."""
    out = tmp_path / "plan.json"
    code = main(["plan", "llama3-8b", "--cluster", "2x8xH100", "--global-batch", "8", "--set", "seq=32768",
                 "--fix", "cp=4,tp=2", "--json", "-o", str(out)])
    assert code == 0
    plan = json.loads(out.read_text())
    assert plan["degrees"]["cp"] == 4 and plan["degrees"]["tp"] == 2
    assert plan["mesh"]["dim_names"] == ["dp", "cp", "tp"]
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "cp=4" in shown and "dp, cp, tp" in shown


def test_cp_refuses_a_model_without_fused_attention() -> None:
    with pytest.raises(BadInputError, match="cp=2 splits attention on the sequence, and this model has no fused"):
        _plan("tiny-gpt", {"cp": 2}, "1x2xcpu", {"attention": "eager"})


def test_cp_must_divide_the_sequence() -> None:
    with pytest.raises(BadInputError, match="cp=4 does not divide the sequence length 30"):
        _plan("tiny-llama", {"cp": 4}, "1x4xcpu", {"seq": 30})


def test_cp_is_not_combined_with_pipeline_stages() -> None:
    with pytest.raises(BadInputError, match="cp=2 and pp=2: context parallelism is not combined with pp"):
        Constraints.parse("cp=2,pp=2")


# ---- parity on gloo ---------------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.slow
def test_cp_on_2_ranks_matches_single_process() -> None:
    results = train_parallel_many(2, [_run("tiny-llama", LONG, {"cp": 2}), _run("tiny-gpt", None, {"cp": 2})])
    references = [train_single("tiny-llama", LONG, BATCH, None, STEPS), train_single("tiny-gpt", None, BATCH, None, STEPS)]
    for result, reference in zip(results, references):
        assert result.plan["degrees"]["cp"] == 2
        result.assert_matches(reference)


@pytest.mark.dist
@pytest.mark.slow
def test_cp_with_data_parallelism_on_4_ranks_matches_single_process() -> None:
    results = train_parallel_many(4, [_run("tiny-llama", LONG, {"cp": 2, "dp": 2}), _run("tiny-llama", LONG, {"cp": 4})])
    reference = train_single("tiny-llama", LONG, BATCH, None, STEPS)
    assert results[0].plan["mesh"]["dim_names"] == ["dp", "cp"]
    assert results[1].plan["degrees"]["cp"] == 4
    for result in results:
        result.assert_matches(reference)
