"""Context parallelism (issue 16): the ``cp`` mesh role, pinned with ``--fix cp=N``, and parity on gloo,
with keys and values all-gathered (``cp_attention=allgather``, pinned here; the ring:
``tests/test_ring_attention.py``).

* The free search adds meshes with a ``cp`` dim where activation memory shaped the best plan without
  one: Llama 3 405B on 16,384 H100s chooses cp at 128k tokens, and does not search it at 4k.
* The planner: a pinned ``cp`` gets a ``cp`` mesh dim over which the inputs are split on the sequence,
  parameters stay whole (or, under FSDP, sharded over dp x cp), fused attention reads its queries split and its keys and values gathered, and
  the views that flatten the sequence into rows keep it split (run locally); through the CLI, and
  ``show``; with pipeline stages; with HSDP (parameters sharded over dp x cp in a replica group). Refused: a model without fused attention, a ``2 cp`` that does not
  divide the sequence. With expert parallelism: ``tests/test_cp_ep.py``.
* The load-balanced layout (``passes/sequence_layout.py``): rank r holds chunks r and 2cp-1-r of 2cp,
  so causal attention is priced as an even share of its work (as under dp); the plan says so
  (``cp_layout``), and a plan without the key (made before it) reads, and runs, as contiguous chunks.
* Parity on gloo (SGD, 3 steps, tiny-llama at 256 tokens; tiny-gpt at 32): gradients after the first
  backward, per-step losses and final parameters under cp=2, cp=4 (FSDP over cp) and dp=2 x cp=2 equal single-process
  training (the causal mask of each rank's two chunks of queries by their true positions, the rotary
  tables' and tiny-gpt's position embeddings' rows picked for the rank's chunks, the gathered keys in
  true order and their reduce-scattered gradients, the loss averaged over every token); and cp=2 x tp=2
  (with and without sequence parallelism over tp), cp=2 x pp=2 (1F1B; each stage's program reorders
  its own rotary rows), and HSDP: dp_replicate=2 x cp=2 (parameters sharded over cp, replicated across
  the replica groups).
  The collectives a cp=2 step runs are exactly the plan's, forward and backward (the rotary tables'
  slices, which have no gradient, gather nothing in backward, and are priced so).
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.cli import main
from autopar.core.errors import BadInputError, PlanFormatError
from autopar.models import build_model
from autopar.inspect.collectives import predicted_collectives
from autopar.testing.counters import counted_step
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import train_parallel_many, train_single

BATCH = 8
STEPS = 3
LONG = {"seq": 256}
"""tiny-llama at a few hundred tokens: its preset's 32 raised (the rotary tables follow)."""
ALLGATHER = {"cp_attention": "allgather"}
"""Pinned in this file's runs: they gather keys and values (the ring: ``tests/test_ring_attention.py``)."""


def _run(name: str, overrides: dict | None, constraints: dict) -> dict:
    return dict(name=name, overrides=overrides, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                constraints=constraints)


def _plan(name: str, constraints: dict, cluster: str, overrides: dict | None = None) -> dict:
    bundle = build_model(name, overrides=overrides, global_batch=BATCH)
    return autopar.plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn, constraints,
                        example_targets=bundle.example_targets).to_dict()


# ---- the planner ------------------------------------------------------------------------------------
def test_pinned_cp_splits_the_sequence_and_gathers_keys_and_values() -> None:
    plan = _plan("tiny-llama", {"cp": 2, **ALLGATHER}, "1x2xcpu", LONG)
    assert plan["mesh"] == {"shape": [2], "dim_names": ["cp"]}
    assert plan["degrees"]["cp"] == 2 and plan["degrees"]["dp"] == 1
    assert all(spec["placements"] == ["S(1)"] for spec in plan["inputs"].values())
    assert all(p == ["R"] for p in plan["placements"].values())
    attention = [op for op in plan["ops"].values() if "scaled_dot_product_attention" in op["op"]]
    assert attention and all(op["inputs"] == [["S(2)"], ["R"], ["R"]] and op["outputs"] == [["S(2)"]]
                             and op["local"] for op in attention)
    flattening = [op for op in plan["ops"].values() if op["op"] == "aten.view.default" and op.get("local")]
    assert flattening and all({op["inputs"][0][0], op["outputs"][0][0]} == {"S(0)", "S(1)"} for op in flattening)
    assert plan["cp_layout"] == "load_balanced" and plan["cp_attention"] == "allgather"
    # each layer's keys and values are gathered again in backward, not held whole (``moved_again``)
    again = predicted_collectives(plan)["all_gather"] - predicted_collectives(plan, ["forward"])["all_gather"]
    assert again == 2 * plan["model"]["layers"]


def _attention_compute_s(constraints: dict) -> list[float]:
    bundle = build_model("llama3-8b", overrides={"layers": 2, "seq": 16384}, global_batch=2)
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xH100", bundle.loss_fn, constraints,
                        example_targets=bundle.example_targets)
    return [op["cost"]["compute_s"] for op in plan.ops.values() if "scaled_dot_product_attention" in op["op"]]


def test_load_balanced_causal_attention_is_priced_as_an_even_share() -> None:
    """Two chunks per rank even out causal attention's work: at cp=2 each rank's attention costs what
    it does under dp=2 (the same tokens per rank), not the 3/2 of it the last contiguous chunk would."""
    balanced, data_parallel = _attention_compute_s({"cp": 2}), _attention_compute_s({"dp": 2})
    assert balanced and balanced == pytest.approx(data_parallel, rel=1e-9)


def test_a_plan_without_cp_layout_reads_as_contiguous() -> None:
    plan = _plan("tiny-llama", {"cp": 2}, "1x2xcpu", LONG)
    del plan["cp_layout"]
    assert autopar.Plan.from_dict(plan).cp_layout == "contiguous"
    with pytest.raises(PlanFormatError, match="cp_layout must be one of contiguous, load_balanced, got 'striped'"):
        autopar.Plan.from_dict({**plan, "cp_layout": "striped"})


def test_fix_cp_on_the_command_line_and_show(tmp_path, capsys) -> None:
    """Llama 3 8B at 32k tokens on one node under cp=4 x tp=2: its parameters and AdamW state fit only
    sharded over cp. ZeRO-1 over cp (the optimizer state split over dp x cp, as Megatron-Core's distributed
    optimizer splits it): 4.67 s a step, 57 GB a device, where FSDP over cp (as torchtitan shards), which
    the search chose before it tried ZeRO-1 on meshes whose fewest microbatches do not fit, takes 4.92 s."""
    out = tmp_path / "plan.json"
    code = main(["plan", "llama3-8b", "--cluster", "1x8xH100", "--global-batch", "8", "--set", "seq=32768",
                 "--fix", "cp=4,tp=2", "--json", "-o", str(out)])
    assert code == 0
    plan = json.loads(out.read_text())
    assert plan["degrees"]["cp"] == 4 and plan["degrees"]["tp"] == 2 and plan["degrees"]["zero"] == 1
    assert plan["mesh"]["dim_names"] == ["cp", "tp"]
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "cp=4" in shown and "cp, tp" in shown


def _cli_plan(tmp_path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    assert main(["plan", *args, "--json", "-o", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.extended
@pytest.mark.slow
def test_free_search_chooses_cp_for_a_long_sequence(tmp_path, capsys) -> None:
    """Llama 3 405B at 128k tokens on 16,384 H100s: the best plan without cp is a 1-microbatch pipeline,
    its bubble most of the step (41.5 s, 32.8 of them bubble), so meshes with a cp dim are searched too, and
    one wins (one stage, cp=16: 21.2 s; ``search.BUBBLE_DOMINATES``)."""
    plan = _cli_plan(tmp_path, "llama3-405b", "--cluster", "2048x8xH100", "--global-batch", "128",
                     "--set", "seq=131072")
    assert plan["degrees"]["cp"] > 1 and "cp" in plan["mesh"]["dim_names"]
    assert plan["predicted"]["peak_memory_bytes"] <= plan["predicted"]["memory_capacity_bytes"]


@pytest.mark.extended
@pytest.mark.slow
def test_free_search_leaves_cp_out_at_a_short_sequence(tmp_path, capsys) -> None:
    """The same model at 4k tokens: activations nearly fit whole (the best plan, a 64-stage zero-bubble
    pipeline, recomputes selectively, on 2026-12-02), and splitting the sequence would only add the
    gathers of keys and values: cp is not chosen."""
    plan = _cli_plan(tmp_path, "llama3-405b", "--cluster", "2048x8xH100", "--global-batch", "2048",
                     "--seq", "4096")
    assert plan["degrees"]["cp"] == 1 and "cp" not in plan["mesh"]["dim_names"]
    assert plan["checkpointing"] != "full"


def test_cp_refuses_a_model_without_fused_attention() -> None:
    with pytest.raises(BadInputError, match="cp=2 splits attention on the sequence, and this model has no fused"):
        _plan("tiny-gpt", {"cp": 2}, "1x2xcpu", {"attention": "eager"})


def test_cp_must_divide_the_sequence() -> None:
    with pytest.raises(BadInputError, match=r"cp=4 cuts the sequence into 2 x cp = 8 chunks .* does not divide the "
                                            "sequence length 30"):
        _plan("tiny-llama", {"cp": 4}, "1x4xcpu", {"seq": 30})


def test_cp_composes_with_pipeline_stages() -> None:
    """Each stage's mesh has the cp dim: the stages send their sequence chunks to their cp peers."""
    plan = _plan("tiny-llama", {"cp": 2, "pp": 2}, "1x4xcpu", LONG)
    assert plan["mesh"] == {"shape": [2], "dim_names": ["cp"]} and plan["degrees"]["pp"] == 2
    assert plan["cp_layout"] == "load_balanced" and len(plan["pipeline"]["stages"]) == 2


def test_cp_composes_with_expert_parallelism() -> None:
    """The expert dim beside cp, carved from the data-parallel ranks (Megatron-Core's way): the batch and
    the experts split over ep, the sequence over cp (parity and counts: ``tests/test_cp_ep.py``)."""
    plan = _plan("tiny-moe", {"cp": 2, "ep": 2}, "1x4xcpu", {"seq": 32, "group_size": 4})
    assert plan["mesh"] == {"shape": [2, 2], "dim_names": ["cp", "ep"]} and plan["degrees"]["ep"] == 2
    assert plan["cp_layout"] == "load_balanced"


def test_cp_composes_with_hsdp() -> None:
    """HSDP beside cp: parameters sharded over dp x cp inside a replica group, replicated across them."""
    plan = _plan("tiny-llama", {"cp": 2, "dp": 4, "dp_shard": 2, **ALLGATHER}, "1x8xcpu", LONG)
    assert plan["mesh"] == {"shape": [2, 2, 2], "dim_names": ["dp_replicate", "dp", "cp"]}
    assert plan["degrees"]["dp_replicate"] == 2 and plan["degrees"]["fsdp"] == 4
    matrices = [p for name, p in plan["placements"].items() if name.endswith("proj.weight")]
    assert matrices and all(p[0] == "R" and p[1] == p[2] and p[1].startswith("S(") for p in matrices)


# ---- parity on gloo ---------------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.slow
def test_cp_on_2_ranks_matches_single_process() -> None:
    """The load-balanced layout for tiny-llama (rotary tables) and tiny-gpt (learned position
    embeddings), and tiny-llama's plan with contiguous chunks, as a plan made before load balancing."""
    gather = {"cp": 2, **ALLGATHER}
    contiguous = {**_plan("tiny-llama", gather, "1x2xcpu", LONG), "cp_layout": "contiguous"}
    results = train_parallel_many(2, [_run("tiny-llama", LONG, gather), _run("tiny-gpt", None, gather),
                                      {**_run("tiny-llama", LONG, {}), "plan": contiguous}])
    llama = train_single("tiny-llama", LONG, BATCH, None, STEPS)
    references = [llama, train_single("tiny-gpt", None, BATCH, None, STEPS), llama]
    assert [r.plan["cp_layout"] for r in results] == ["load_balanced", "load_balanced", "contiguous"]
    for result, reference in zip(results, references):
        assert result.plan["degrees"]["cp"] == 2
        result.assert_matches(reference)


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_cp_with_data_tensor_and_pipeline_parallelism_on_4_ranks_matches_single_process() -> None:
    runs = [{"cp": 2, "dp": 2}, {"cp": 4, "fsdp": 3}, {"cp": 2, "tp": 2}, {"cp": 2, "pp": 2},
            {"cp": 2, "tp": 2, "sp": 1}, {"cp": 2, "dp": 2, "dp_shard": 1}]
    results = train_parallel_many(4, [_run("tiny-llama", LONG, {**c, **ALLGATHER}) for c in runs])
    reference = train_single("tiny-llama", LONG, BATCH, None, STEPS)
    assert [r.plan["mesh"]["dim_names"] for r in results] == [["dp", "cp"], ["cp"], ["cp", "tp"], ["cp"], ["cp", "tp"],
                                                              ["dp_replicate", "cp"]]
    assert results[5].plan["degrees"]["fsdp"] == 2  # HSDP: sharded over cp, replicated across the 2 replicas
    assert results[3].plan["degrees"]["pp"] == 2 and results[4].plan["degrees"]["sp"] == 2
    assert results[1].plan["degrees"]["fsdp"] == 4  # parameters sharded over cp, gathered before use
    for result in results:
        result.assert_matches(reference)


def _counted_step(rank: int, world: int) -> dict:
    """One forward, then one step, of tiny-llama under cp=2, counting their collectives."""
    return counted_step("tiny-llama", LONG, BATCH, {"cp": 2, **ALLGATHER})


@pytest.mark.dist
@pytest.mark.slow
def test_cp_runs_the_predicted_collectives() -> None:
    """The forward's all_gathers (keys and values of each layer, and the per-token losses the loss sums)
    are the plan's; backward reduce-scatters the keys' and values' gradients and the gradient sync
    all-reduces the parameters' (one bucket), as predicted; the rotary tables' slices gather nothing."""
    counted = run_on_ranks(_counted_step, 2)
    plan = counted[0]["plan"]
    forward, step = predicted_collectives(plan, ["forward"]), predicted_collectives(plan)
    assert forward["all_gather"] >= 2 * plan["model"]["layers"] and step["reduce_scatter"] == 2 * plan["model"]["layers"]
    for c in counted:
        assert c["forward"] == forward, (c["forward"], forward)
        assert c["step"] == step, (c["step"], step)


def _counted_hsdp_step(rank: int, world: int) -> dict:
    """One forward, then one step, of tiny-llama under HSDP with cp: dp_replicate=2 x cp=2."""
    return counted_step("tiny-llama", LONG, BATCH, {"cp": 2, "dp": 2, "dp_shard": 1, **ALLGATHER})


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_cp_with_hsdp_runs_the_predicted_collectives() -> None:
    """The parameters' gathers over cp and their gradients' reduce-scatters there and all-reduces across
    the replica groups, beside the keys' and values' gathers, are the plan's."""
    counted = run_on_ranks(_counted_hsdp_step, 4)
    plan = counted[0]["plan"]
    assert plan["mesh"]["dim_names"] == ["dp_replicate", "cp"]
    forward, step = predicted_collectives(plan, ["forward"]), predicted_collectives(plan)
    for c in counted:
        assert c["forward"] == forward, (c["forward"], forward)
        assert c["step"] == step, (c["step"], step)
