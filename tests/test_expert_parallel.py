"""Expert parallelism (issue 16): the built-in MoE family, Hugging Face's Mixtral, the ``ep`` mesh role,
the routing a plan states, and parity on gloo.

* The model: tiny-moe's token-permutation layer (rows gathered by index into ``[E, g x C, d]`` expert
  slots, batched-matmul experts, gathered back) equals a token-by-token top-k mixture when no token is
  dropped, and keeps at most ``C`` tokens per (group, expert) when tokens are dropped.
* The plan states the routing (``model.moe``: capacity, dropped-token policy, the router imbalance the
  all_to_alls' price holds), ``show`` and ``explain`` print it, and plans without it still load.
* The planner: expert weights are found by structure (the router's ``[E, d]`` weight is not one); a
  pinned ``ep`` splits them on their expert dim and prices the all_to_alls; a dense model never gets
  an ``ep`` dim; ``--fix ep=`` through the CLI, and ``show``; HF's Mixtral (``permuted_experts_forward``)
  captures on fake tensors and plans with ``ep``.
* Parity on gloo (SGD, 3 steps, no dropped tokens): gradients after the first backward, per-step
  losses and final parameters under ep=2, ep=4, dp=2 x ep=2, ep=2 x tp=2 and pp=2 x ep=2 equal
  single-process training; and under ep=2 with tokens dropped; HF's Mixtral under ep=2, ep=4 and
  dp=2 x ep=2. The forward's collectives (two all_to_alls a layer) are the plan's.
* Transformers' other mixture-of-experts families through a user's own factory (``tests/hf_moe_models.py``) and
  ``autopar.models.hf.use_permuted_experts``: Qwen2-MoE, DeepSeek-V3 and gpt-oss compute their own experts,
  plan with ep, and train under it like one process.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.cli import main
from autopar.core.errors import BadInputError
from autopar.ir.capture import capture
from autopar.models import build_model
from autopar.models.moe import capacity
from autopar.planning.roles import expert_count, expert_weights
from autopar.inspect.collectives import predicted_collectives
from autopar.testing.counters import counted_step
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import train_parallel_many, train_single
from test_collective_parity import as_run_on_gloo

NO_DROP = {"drop_tokens": False}
BATCH = 8
STEPS = 3


def _plan(name: str, cluster: str, constraints: dict | None = None, overrides: dict | None = None,
          batch: int = BATCH, seq: int | None = None) -> autopar.Plan:
    bundle = build_model(name, overrides=overrides, global_batch=batch, seq=seq)
    return autopar.plan(bundle.model, bundle.example_inputs, cluster=cluster, loss_fn=bundle.loss_fn,
                        example_targets=bundle.example_targets, constraints=constraints)


# ---- the model ---------------------------------------------------------------------------------------
def _token_by_token(ff: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The top-k mixture computed one token and one chosen expert at a time."""
    probs = ff.router(x).softmax(dim=-1)
    top, index = probs.topk(ff.config.top_k, dim=-1)
    gates = top / top.sum(dim=-1, keepdim=True)
    w = ff.experts
    out = torch.zeros_like(x)
    for g in range(x.shape[0]):
        for s in range(x.shape[1]):
            for j in range(ff.config.top_k):
                e, h = index[g, s, j], x[g, s]
                out[g, s] += gates[g, s, j] * ((F.silu(h @ w.w1[e]) * (h @ w.w3[e])) @ w.w2[e])
    return out


@pytest.mark.parametrize("group_size", [0, 4])
def test_moe_layer_without_drops_is_the_token_by_token_mixture(group_size: int) -> None:
    bundle = build_model("tiny-moe", overrides={**NO_DROP, "group_size": group_size}, global_batch=2, device="cpu")
    ff = bundle.model.blocks[0].moe
    x = torch.randn(2, bundle.config.seq, bundle.config.hidden)
    y, balance = ff(x)
    torch.testing.assert_close(y, _token_by_token(ff, x), rtol=1e-5, atol=1e-6)
    assert balance.item() >= 1.0 - 1e-5  # E * sum_e f_e p_e is 1 when perfectly balanced, more otherwise


def test_groups_must_divide_the_sequence() -> None:
    bundle = build_model("tiny-moe", overrides={"group_size": 5}, global_batch=2, device="cpu")
    with pytest.raises(BadInputError, match="group_size 5 must divide the sequence length 16"):
        bundle.model(*bundle.example_inputs)


def test_tokens_past_the_capacity_are_dropped() -> None:
    overrides = {"capacity_factor": 0.5}
    bundle = build_model("tiny-moe", overrides=overrides, global_batch=2, device="cpu")
    cfg, ff = bundle.config, bundle.model.blocks[0].moe
    slots = capacity(cfg, cfg.seq)
    assert slots == math.ceil(0.5 * cfg.top_k * cfg.seq / cfg.experts) < cfg.seq
    x = torch.randn(2, cfg.seq, cfg.hidden)
    routed = []
    ff.experts.register_forward_hook(lambda module, args, out: routed.append(args[0]))
    y, _ = ff(x)
    per_expert = routed[0].reshape(cfg.experts, 2, slots, cfg.hidden)  # [E, g, C, d]
    assert per_expert.shape[2] == slots
    assert not torch.allclose(y, _token_by_token(ff, x))  # some token lost an expert
    assert capacity(build_model("tiny-moe", overrides=NO_DROP).config, cfg.seq) == cfg.seq


def test_mixtral_preset_has_mixtrals_size() -> None:
    bundle = build_model("mixtral-8x7b")
    assert 46.6e9 < bundle.num_params() < 46.8e9  # Mixtral 8x7B: 46.7B parameters
    assert bundle.config.experts == 8 and bundle.config.top_k == 2


# ---- the planner -------------------------------------------------------------------------------------
def test_expert_weights_are_found_by_structure() -> None:
    bundle = build_model("tiny-moe")
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    found = {captured.params[name]: dim for name, dim in expert_weights(captured).items()}
    assert found == {f"blocks.{i}.moe.experts.{w}": 0 for i in range(2) for w in ("w1", "w2", "w3")}
    assert expert_count(captured) == 4  # the router's [E, d] weight is dense
    dense = build_model("tiny-llama")
    assert expert_count(capture(dense.model, dense.example_inputs, dense.example_targets, dense.loss_fn)) == 0


def test_pinned_ep_splits_the_experts_and_prices_the_all_to_alls() -> None:
    plan = _plan("tiny-moe", "1x4xcpu", {"ep": 2}, NO_DROP).to_dict()
    assert plan["mesh"]["dim_names"][-1] == "ep" and plan["degrees"]["ep"] == 2 and plan["degrees"]["dp"] == 4
    ep = plan["mesh"]["dim_names"].index("ep")
    for fqn, placements in plan["placements"].items():
        assert placements[ep] == ("S(0)" if ".experts." in fqn else "R"), fqn
    assert all(spec["placements"][ep] == "S(0)" for spec in plan["inputs"].values())  # the batch split over ep
    assert plan["predicted"]["comm_s"]["all_to_all"] > 0
    moves = [c for op in plan["ops"].values() for c in op.get("collectives", []) if c["kind"] == "all_to_all"]
    assert moves and all(c["mesh_dim"] == ep for c in moves)
    for c in moves:  # priced on the per-rank buffer (collective_time's convention), split on dp and ep alike
        assert c["sharded_on"] == [0, 1] and c["nbytes"] == math.prod(c["shape"]) * c["element_bytes"] / 4, c


def test_a_dense_model_never_gets_an_ep_dim() -> None:
    plan = _plan("tiny-llama", "1x4xcpu").to_dict()
    meshes = [plan["mesh"]] + [c["mesh"] for c in plan.get("candidates", [])]
    assert all("ep" not in mesh["dim_names"] for mesh in meshes)
    assert plan["degrees"]["ep"] == 1
    with pytest.raises(BadInputError, match="constraint ep=2 needs a model with experts"):
        _plan("tiny-llama", "1x4xcpu", {"ep": 2})


def test_ep_must_divide_the_experts() -> None:
    with pytest.raises(BadInputError, match=r"ep dividing the number of experts \(4\)"):
        _plan("tiny-moe", "1x8xcpu", {"ep": 8})


def test_fix_ep_on_the_command_line_and_show(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", "tiny-moe", "--set", "experts=8", "--cluster", "1x8xcpu", "--global-batch", "8",
                 "--fix", "ep=8", "-o", str(out)])
    assert code == 0
    assert json.loads(out.read_text())["degrees"]["ep"] == 8
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "mesh      ep=8" in shown and "ep=8  pp=1" in shown
    assert "blocks.*.moe.experts.w1      [S(0)]" in shown


def test_the_plan_states_capacity_dropped_tokens_and_the_router_assumption(tmp_path, capsys) -> None:
    """``model.moe`` records the routing: capacity, dropped-token policy, and the router imbalance the
    all_to_alls' price holds; ``show`` prints it, ``explain`` of an expert weight or op prints it, a plan
    without it (older plans, dense models) loads and shows no experts line."""
    dropping, dropless = tmp_path / "dropping.json", tmp_path / "dropless.json"
    base = ["plan", "tiny-moe", "--cluster", "1x2xcpu", "--global-batch", "4", "--fix", "ep=2"]
    assert main([*base, "-o", str(dropping)]) == 0
    assert main([*base, "--set", "drop_tokens=false", "-o", str(dropless)]) == 0
    moe = json.loads(dropping.read_text())["model"]["moe"]
    assert moe["capacity_factor"] == 1.25 and moe["group_tokens"] == 16 and moe["modules"] == ["blocks.*.moe"]
    assert moe["slots_per_expert"] == math.ceil(1.25 * 2 * 16 / 4) == 10 and moe["router_imbalance_held"] == 1.25
    assert moe["dropped_tokens"].startswith("past capacity")
    free = json.loads(dropless.read_text())["model"]["moe"]
    assert free["capacity_factor"] is None and free["slots_per_expert"] == 16
    assert free["dropped_tokens"] == "none dropped" and free["router_imbalance_held"] == 2.0
    capsys.readouterr()
    assert main(["show", str(dropping)]) == 0
    shown = capsys.readouterr().out
    assert "experts   4 x top-2, 10 slots per expert per 16-token group (capacity factor 1.25)" in shown
    assert "assumes   a router balanced within 1.25x" in shown
    assert main(["show", str(dropless)]) == 0
    assert "(dropless); dropped tokens: none dropped" in capsys.readouterr().out
    plan = json.loads(dropping.read_text())
    routed_op = next(name for name, op in plan["ops"].items() if op["op"].startswith("aten.gather"))
    for name in ("blocks.1.moe.experts.w2", routed_op):
        assert main(["explain", str(dropping), name]) == 0
        assert "assumes   a router balanced within 1.25x" in capsys.readouterr().out, name
    assert main(["explain", str(dropping), "blocks.0.attn.q_proj.weight"]) == 0
    assert "assumes" not in capsys.readouterr().out
    del plan["model"]["moe"]
    dropping.write_text(json.dumps(plan))
    assert main(["show", str(dropping)]) == 0
    assert "experts " not in capsys.readouterr().out


def test_a_plan_from_a_saved_problem_states_the_routing(tmp_path, capsys) -> None:
    """``autopar plan --problem``, with no model code to read, states the routing saved with the problem."""
    first, again, problem = tmp_path / "first.json", tmp_path / "again.json", tmp_path / "problem.json"
    fix = ["--cluster", "1x2xcpu", "--fix", "ep=2"]
    assert main(["plan", "tiny-moe", "--global-batch", "4", *fix, "-o", str(first),
                 "--save-problem", str(problem)]) == 0
    assert main(["plan", "--problem", str(problem), *fix, "-o", str(again)]) == 0
    moe = json.loads(first.read_text())["model"]["moe"]
    assert moe["slots_per_expert"] == 10 and json.loads(again.read_text())["model"]["moe"] == moe
    saved = json.loads(problem.read_text())
    saved["model"]["facts"]["moe"]["slots_per_expert"] = "ten"
    problem.write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(["plan", "--problem", str(problem), *fix]) == 2
    assert "model.facts.moe.slots_per_expert: expected an integer" in capsys.readouterr().err


def test_reprice_keeps_the_routing_and_the_expert_split(tmp_path) -> None:
    bundle = build_model("tiny-moe", global_batch=BATCH)
    problem = tmp_path / "problem.json"
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x4xcpu", bundle.loss_fn, {"ep": 2},
                        example_targets=bundle.example_targets, save_problem=problem)
    again = autopar.reprice(plan, autopar.load_problem(problem), "1x4xH100")
    assert again.model["moe"] == plan.model["moe"] and again.placements == plan.placements
    assert 0 < again.predicted["comm_s"]["all_to_all"] < plan.predicted["comm_s"]["all_to_all"]  # NVLink


def test_a_malformed_routing_record_is_refused(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    plan = _plan("tiny-moe", "1x2xcpu", {"ep": 2}, batch=4).to_dict()
    plan["model"]["moe"]["slots_per_expert"] = "ten"
    path.write_text(json.dumps(plan))
    assert main(["show", str(path)]) == 2
    assert "model.moe.slots_per_expert: expected an integer" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_hugging_face_mixtral_plans_with_ep() -> None:
    """HF's Mixtral built by the factory runs ``permuted_experts_forward``: it captures on fake tensors,
    its stacked expert weights are found and split over ep, and its plan states its dropless routing."""
    pytest.importorskip("transformers")
    plan = _plan(HF_MIXTRAL, "1x2xcpu", {"ep": 2}, HF_MASK, batch=4).to_dict()
    for fqn, placements in plan["placements"].items():
        assert placements == (["S(0)"] if ".mlp.experts." in fqn else ["R"]), fqn
    assert plan["predicted"]["comm_s"]["all_to_all"] > 0
    moe = plan["model"]["moe"]
    assert moe["capacity_factor"] is None and moe["slots_per_expert"] == moe["group_tokens"] == 16
    assert moe["modules"] == ["hf.model.layers.*.mlp.experts"]


HF_MOE_FAMILIES = ["qwen2_moe", "deepseek_v3", "gpt_oss"]  # tests/hf_moe_models.py: a user's own factories


@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
@pytest.mark.parametrize("family", HF_MOE_FAMILIES)
def test_permuted_experts_compute_each_familys_own_experts_and_plan_with_ep(family: str) -> None:
    """``use_permuted_experts`` on a transformers family autopar has no factory for: the permuted experts give
    transformers' own eager experts' logits (gpt-oss: weights stored transposed, biases, its own clamped
    gate), the plan states the routing, and a pinned ep splits every expert weight on its expert dim."""
    pytest.importorskip("transformers")
    bundle = build_model(f"hf_moe_models:{family}", global_batch=2, seq=16, device="cpu")
    with torch.no_grad():
        for p in bundle.model.parameters():  # transformers leaves some weights at zero: every one random
            p.normal_(std=0.2)
        permuted = bundle.model(*bundle.example_inputs)
        bundle.model.hf.set_experts_implementation("eager")
        eager = bundle.model(*bundle.example_inputs)
    torch.testing.assert_close(permuted, eager, rtol=1e-5, atol=1e-5)
    plan = _plan(f"hf_moe_models:{family}", "1x2xcpu", {"ep": 2}, batch=4).to_dict()
    moe = plan["model"]["moe"]
    assert (moe["experts"], moe["top_k"], moe["group_tokens"]) == (4, 2, 16)
    split = sorted(fqn.rsplit(".", 1)[-1] for fqn, placements in plan["placements"].items() if placements == ["S(0)"])
    layers = 1 if family == "deepseek_v3" else 2  # DeepSeek-V3's first layer is dense
    assert split == sorted(["down_proj", "gate_up_proj"] * layers)


def test_a_pipeline_of_unalike_layers_is_refused_naming_two_that_differ() -> None:
    """DeepSeek-V3 of two layers, its first dense and its second mixture-of-experts: stages, cut between alike
    layers after any leading ones that are not, cannot hold them (no two layers repeat); the message names the
    layers, not a count of one."""
    pytest.importorskip("transformers")
    with pytest.raises(BadInputError, match=r"pp=2: pipeline stages are cut between alike layers, and no two of "
                                            r"this model's last layers repeat alike: hf.model.layers.0 and "
                                            r"hf.model.layers.1 differ"):
        _plan("hf_moe_models:deepseek_v3", "1x2xcpu", {"pp": 2}, batch=4)


@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_a_transformers_moe_left_on_its_own_experts_is_planned_with_a_warning_naming_the_fix() -> None:
    """A transformers mixture-of-experts model planned as transformers runs its experts (no
    ``use_permuted_experts``) has nothing ``ep`` can split: ``plan`` says so and names the call that fixes it;
    the same model set up with it plans without that warning."""
    pytest.importorskip("transformers")
    bundle = build_model("hf_moe_models:qwen2_moe", global_batch=4, seq=16, device="meta")
    args = (bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autopar.plan(*args, example_targets=bundle.example_targets)
        bundle.model.hf.set_experts_implementation("grouped_mm")
        autopar.plan(*args, example_targets=bundle.example_targets)
    said = [str(w.message) for w in caught if "use_permuted_experts" in str(w.message)]
    assert said == ["autopar: Qwen2MoeExperts runs transformers' own experts implementation, whose ops no mesh dim "
                    "splits (every rank runs them whole); call autopar.models.hf.use_permuted_experts(model, seq) "
                    "first, so that expert parallelism splits the experts (with capacity_factor=..., tokens past "
                    "each expert's capacity are dropped and the experts run on that capacity; without, on a slot per "
                    "token)"]
    assert all(w.filename == __file__ for w in caught if "use_permuted_experts" in str(w.message))


@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_permuted_experts_with_a_capacity_drop_choices_past_it_and_the_plan_prices_that_capacity() -> None:
    """``use_permuted_experts(..., capacity_factor=f)``: ``ceil(f * k * s / E)`` slots per expert and sequence,
    as autopar's own layer; at ``f = E / k`` a slot per token (transformers' own logits), below it some choices
    dropped; the plan states the capacity and prices the experts' matmuls at it, not at a slot per token."""
    pytest.importorskip("transformers")

    def logits(factor: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        bundle = build_model("hf_moe_models:qwen2_moe", overrides={"capacity_factor": factor}, global_batch=2,
                             seq=16, device="cpu")
        torch.manual_seed(1)
        with torch.no_grad():
            for p in bundle.model.parameters():
                p.normal_(std=0.2)
            permuted = bundle.model(*bundle.example_inputs)
            bundle.model.hf.set_experts_implementation("eager")
            return permuted, bundle.model(*bundle.example_inputs)

    permuted, eager = logits(2.0)  # 4 experts, 2 a token: 16 slots for a sequence of 16, none dropped
    torch.testing.assert_close(permuted, eager, rtol=1e-5, atol=1e-5)
    permuted, eager = logits(0.5)  # 4 slots an expert: choices past them dropped
    assert not torch.allclose(permuted, eager, rtol=1e-3, atol=1e-3)
    with pytest.raises(BadInputError, match="capacity_factor must be > 0"):
        build_model("hf_moe_models:qwen2_moe", overrides={"capacity_factor": 0.0}, global_batch=2, seq=16)

    dropless = _plan("hf_moe_models:qwen2_moe", "1x2xcpu", {"ep": 2}, batch=4).to_dict()
    capped = _plan("hf_moe_models:qwen2_moe", "1x2xcpu", {"ep": 2}, {"capacity_factor": 1.0}, batch=4).to_dict()
    assert (dropless["model"]["moe"]["slots_per_expert"], dropless["model"]["moe"]["capacity_factor"]) == (16, None)
    moe = capped["model"]["moe"]
    assert (moe["slots_per_expert"], moe["capacity_factor"]) == (math.ceil(1.0 * 2 * 16 / 4), 1.0)
    assert moe["dropped_tokens"].startswith("past capacity")
    assert capped["predicted"]["compute_s"] < dropless["predicted"]["compute_s"]


@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_permuted_experts_read_the_experts_a_token_under_the_configs_own_name() -> None:
    """Aria's config calls the experts a token ``moe_topk`` (``hf.TOP_K_NAMES``): its experts permute without a
    ``top_k`` given, to transformers' own eager experts' logits, and ep splits them."""
    pytest.importorskip("transformers")
    import transformers

    from autopar.models.hf import HFModel, token_loss, use_permuted_experts

    config = transformers.AriaTextConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                         max_position_embeddings=32, moe_num_experts=4, moe_topk=2,
                                         moe_num_shared_experts=1, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    model = HFModel(transformers.AutoModelForCausalLM.from_config(config), ["input_ids"], "logits", 128)
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2)
        model.hf.set_experts_implementation("eager")
        eager = model(ids)
        permuted = use_permuted_experts(model, 16)(ids)
    torch.testing.assert_close(permuted, eager, rtol=1e-5, atol=1e-5)
    plan = autopar.plan(model, (ids,), "1x2xcpu", token_loss, {"ep": 2}, example_targets=ids)
    assert plan.to_dict()["model"]["moe"]["top_k"] == 2
    assert sum(placements == ["S(0)"] for placements in plan.placements.values()) == 4  # 2 layers x 2 weights


def test_use_permuted_experts_refuses_a_model_without_experts() -> None:
    pytest.importorskip("transformers")
    from autopar.models.hf import use_permuted_experts

    bundle = build_model("autopar.models.hf:llama", global_batch=2, device="meta")
    with pytest.raises(BadInputError, match="LlamaForCausalLM has no experts module of transformers' ExpertsInterface"):
        use_permuted_experts(bundle.model, 16)


@pytest.mark.dist
@pytest.mark.extended
@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_jambas_alternating_layers_train_in_pipeline_stages_of_pairs() -> None:
    """Jamba's layers alternate a Mamba mixer with attention and experts: a pipeline cuts between pairs of layers
    (``ir/layers.layer_period``; they were refused as unalike), on both runtimes."""
    pytest.importorskip("transformers")
    runs = [dict(name="hf_moe_models:jamba", overrides=None, global_batch=4, seq=16, steps=STEPS, plan=None,
                 constraints={"pp": 2, "microbatches": 2}, lowered=lowered) for lowered in (False, True)]
    reference = train_single("hf_moe_models:jamba", None, 4, 16, STEPS)
    for run, result in zip(runs, train_parallel_many(2, runs)):
        assert result.plan["pipeline"]["stages"] == [[0, 2], [2, 4]]
        result.assert_matches(reference, f"Jamba under pp=2, lowered={run['lowered']}")


@pytest.mark.dist
@pytest.mark.extended
@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_deepseek_v3s_dense_first_layer_runs_on_the_first_pipeline_stage() -> None:
    """DeepSeek-V3's dense first layer before two mixture-of-experts layers: the pipeline is cut between the
    mixture-of-experts layers, the first stage holding the dense one too (refused as unalike layers before), on
    both runtimes; the lowered last stage runs the latent attention's ``aten.copy`` with its derivative."""
    pytest.importorskip("transformers")
    runs = [dict(name="hf_moe_models:deepseek_v3", overrides={"layers": 3}, global_batch=4, seq=16, steps=STEPS,
                 plan=None, constraints={"pp": 2, "microbatches": 2}, lowered=lowered) for lowered in (False, True)]
    reference = train_single("hf_moe_models:deepseek_v3", {"layers": 3}, 4, 16, STEPS)
    for run, result in zip(runs, train_parallel_many(2, runs)):
        assert result.plan["pipeline"]["stages"] == [[0, 2], [2, 3]]
        result.assert_matches(reference, f"DeepSeek-V3 under pp=2, lowered={run['lowered']}")


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_hugging_face_moe_families_train_under_ep_like_one_process() -> None:
    """DeepSeek-V3's attention writes its queries and keys into buffers slice by slice, captured as ``copy``
    and ``slice_scatter``, whose derivatives the program could not run (``passes/dtensor_backward.py``);
    gpt-oss's experts hold biases beside the weights ep splits; Qwen2-MoE's experts with a capacity drop the same
    choices on every rank as in one process."""
    pytest.importorskip("transformers")
    runs = [dict(name=f"hf_moe_models:{family}", overrides=overrides, global_batch=4, seq=16, steps=STEPS, plan=None,
                 constraints=constraints, lowered=None)
            for family, constraints, overrides in (("deepseek_v3", {"ep": 2}, None), ("gpt_oss", {"ep": 2}, None),
                                                   ("qwen2_moe", {"tp": 2}, None),
                                                   ("qwen2_moe", {"ep": 2}, {"capacity_factor": 1.0}))]
    for run, result in zip(runs, train_parallel_many(2, runs)):
        reference = train_single(run["name"], run["overrides"], 4, 16, STEPS)
        result.assert_matches(reference, f"{run['name']} under {run['constraints']}, {run['overrides']}")


@pytest.mark.slow
def test_mixtral_on_64_gpus_splits_its_data_parallel_group_for_experts() -> None:
    """Pipeline and tensor parallelism pinned off, the search over the data-parallel splits of 64 H100s
    (dp=64, dp=32 x ep=2, dp=16 x ep=4, dp=8 x ep=8) puts the experts on an ep dim: each rank gathers a
    smaller share of the expert weights (10 to 30 s)."""
    plan = _plan("mixtral-8x7b", "8x8xH100", {"pp": 1, "tp": 1}, batch=256, seq=4096)
    assert plan.degrees.ep > 1 and plan.degrees.dp == 64
    assert plan.candidates[0]["mesh"]["dim_names"][-1] == "ep"


@pytest.mark.slow
def test_a_mesh_whose_fewest_microbatches_do_not_fit_is_searched_under_zero_one_too(monkeypatch) -> None:
    """Mixtral 8x7B on 64 H100s at pp4 x dp2 x ep4 x tp2 in 60 GB a device (the ZeRO stage free): without ZeRO
    the fewest microbatch counts do not fit, and the plan runs 32 microbatches of one sample; the state ZeRO-1
    frees lets 16 of two run, with more chunks a device, 4.4% faster. The mesh was not searched under ZeRO-1
    before (its plan neither recomputes nor shards parameters: ``_distributed_optimizer_may_help``)."""
    from autopar.planning import search

    pinned = {"pp": 4, "dp": 8, "ep": 4, "tp": 2, "memory_gb": 60}
    plan = _plan("mixtral-8x7b", "8x8xH100", pinned, batch=256, seq=4096)
    monkeypatch.setattr(search._MeshSearch, "run", _fewest_microbatches_ignored(search._MeshSearch.run))
    monkeypatch.setattr(search._MeshSearch, "fewest_count_refused", lambda self, mesh: False)
    without = _plan("mixtral-8x7b", "8x8xH100", pinned, batch=256, seq=4096)
    assert without.degrees.zero in (0, None) and without.pipeline.microbatches == 32
    assert plan.degrees.zero == 1 and plan.pipeline.microbatches == 16
    assert plan.predicted["step_time_s"] < 0.96 * without.predicted["step_time_s"]


def _fewest_microbatches_ignored(run):
    """``_MeshSearch.run`` with ``microbatches_raised`` cleared after it (and ``fewest_count_refused`` never
    true, so ZeRO-1 is not searched first): the search as it was before."""
    def cleared(self, *args, **kwargs):
        found = run(self, *args, **kwargs)
        self.microbatches_raised = False
        return found
    return cleared


@pytest.mark.slow
@pytest.mark.heavy
def test_mixtral_on_64_gpus_chooses_expert_parallelism() -> None:
    """The free search over every mesh of 64 H100s (4 minutes on 2 busy cores) puts the experts on an ep dim."""
    plan = _plan("mixtral-8x7b", "8x8xH100", batch=256, seq=4096)
    assert plan.degrees.ep > 1
    assert plan.predicted["comm_s"]["all_to_all"] > 0


# ---- parity on gloo ----------------------------------------------------------------------------------
def _runs(constraint_sets: list[dict], overrides: dict | None = NO_DROP, name: str = "tiny-moe") -> list[dict]:
    return [dict(name=name, overrides=overrides, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                 constraints=c) for c in constraint_sets]


HF_MIXTRAL = "autopar.models.hf:mixtral"
HF_MASK = {"mask": True}


def _hf_runs(constraint_sets: list[dict]) -> list[dict]:
    pytest.importorskip("transformers")
    return _runs(constraint_sets, HF_MASK, HF_MIXTRAL)


@pytest.fixture(scope="module")
def moe_single():
    return train_single("tiny-moe", NO_DROP, BATCH, None, STEPS)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_ep2_matches_single_process(moe_single) -> None:
    """And with tokens dropped (the default capacity, in groups of 8 tokens: 5 slots for 8 tokens x 2
    choices over 4 experts): the capacity is per group, inside a sequence, so each rank drops what one
    process drops. The plans ``autoparallelize`` made state that routing (``model.moe``)."""
    groups = {"group_size": 8}
    result, dropping, hf = train_parallel_many(2, _runs([{"ep": 2}]) + _runs([{"ep": 2}], overrides=groups)
                                               + _hf_runs([{"ep": 2}]))
    assert result.plan["mesh"] == {"shape": [2], "dim_names": ["ep"]}
    assert result.plan["model"]["moe"]["dropped_tokens"] == "none dropped"
    assert dropping.plan["model"]["moe"]["slots_per_expert"] == 5 and dropping.plan["model"]["moe"]["group_tokens"] == 8
    result.assert_matches(moe_single)
    dropping.assert_matches(train_single("tiny-moe", groups, BATCH, None, STEPS))
    assert hf.plan["mesh"] == {"shape": [2], "dim_names": ["ep"]}
    hf.assert_matches(train_single(HF_MIXTRAL, HF_MASK, BATCH, None, STEPS))


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_ep4_dp2_by_ep2_ep2_by_tp2_and_pp2_by_ep2_match_single_process(moe_single) -> None:
    """And Hugging Face's Mixtral under ep=4 and dp=2 x ep=2."""
    results = train_parallel_many(4, _runs([{"ep": 4}, {"dp": 4, "ep": 2}, {"ep": 2, "tp": 2}, {"pp": 2, "ep": 2}])
                                  + _hf_runs([{"ep": 4}, {"dp": 4, "ep": 2}]))
    assert results[0].plan["mesh"] == {"shape": [4], "dim_names": ["ep"]}
    assert results[1].plan["mesh"] == {"shape": [2, 2], "dim_names": ["dp", "ep"]}
    assert results[2].plan["mesh"] == {"shape": [2, 2], "dim_names": ["ep", "tp"]}
    assert results[3].plan["mesh"] == {"shape": [2], "dim_names": ["ep"]} and results[3].plan["degrees"]["pp"] == 2
    for result in results[:4]:
        result.assert_matches(moe_single)
    hf_single = train_single(HF_MIXTRAL, HF_MASK, BATCH, None, STEPS)
    assert results[4].plan["mesh"] == {"shape": [4], "dim_names": ["ep"]}
    assert results[5].plan["mesh"] == {"shape": [2, 2], "dim_names": ["dp", "ep"]}
    for result in results[4:]:
        result.assert_matches(hf_single)


def _counted_forward(rank: int, world: int) -> dict:
    return counted_step("tiny-moe", NO_DROP, BATCH, {"ep": 2}, step=False)


@pytest.mark.dist
@pytest.mark.slow
def test_ep2_forward_runs_the_predicted_all_to_alls() -> None:
    """Two all_to_alls a layer (dispatch, combine), and the rest of the forward's collectives, as the
    plan predicts them; on gloo DTensor runs each all_to_all as an all_gather and a chunk."""
    counted = run_on_ranks(_counted_forward, 2)
    plan = counted[0]["plan"]
    predicted = predicted_collectives(plan, ["forward"])
    assert predicted["all_to_all"] == 2 * plan["model"]["layers"]
    assert all(c["forward"] == as_run_on_gloo(predicted) for c in counted), (counted[0]["forward"], predicted)
