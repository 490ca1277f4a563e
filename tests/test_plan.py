"""The Plan contract (docs/architecture.md "Plan JSON"): JSON keys, round trips, malformed files, summary, placement strings.
One real plan (tiny-gpt on 1x4xcpu) is made once for the module; no processes."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar import Plan, PlanFormatError
from autopar.models import build_model
from autopar.core.placement import (
    optimizer_shard_dim,
    placement_to_str,
    placements_to_strs,
    str_to_placement,
    strs_to_placements,
)
from autopar.core.plan import SCHEMA

PLACEMENT = re.compile(r"^(R|S\(\d+\)|P(\(\w+\))?)$")
from contracts import MEMORY_KEYS as MEMORY_KINDS, SECTION_KEYS
TOP_KEYS = {"schema", "checkpointing", "placements", "ops", *SECTION_KEYS}
COMM_KINDS = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
BATCH, SEQ = 8, 32


@pytest.fixture(scope="module")
def bundle():
    return build_model("tiny-gpt", global_batch=BATCH)


@pytest.fixture(scope="module")
def plan(bundle) -> Plan:
    return autopar.plan(bundle.model, bundle.example_inputs, "1x4xcpu", bundle.loss_fn,
                        example_targets=bundle.example_targets, name="tiny-gpt")


@pytest.fixture
def plan_dict(plan) -> dict:
    return json.loads(plan.to_json())


def _write(tmp_path, data, name="plan.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# ---- round trips ----------------------------------------------------------------------------------

def test_save_load_round_trip_is_equal(plan, tmp_path):
    path = tmp_path / "tiny.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.to_dict() == plan.to_dict()
    assert Plan.load(str(path)) == plan  # str paths too


def test_from_dict_round_trip(plan, plan_dict):
    assert Plan.from_dict(plan_dict) == plan
    assert Plan.from_dict(plan.to_dict()).to_json() == plan.to_json()


def test_json_is_strict_and_has_no_torch_objects(plan):
    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    data = json.loads(plan.to_json(), parse_constant=no_constants)  # NaN / Infinity are not JSON
    assert isinstance(data, dict)
    assert "torch" not in json.dumps(data["placements"])


def test_plan_is_frozen(plan):
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.checkpointing = "full"  # type: ignore[misc]


def test_unknown_extra_keys_are_tolerated(plan_dict, tmp_path):
    plan_dict["notes"] = {"written_by": "a newer autopar"}
    assert Plan.load(_write(tmp_path, plan_dict)).degrees == plan_dict["degrees"]


# ---- keys and values of docs/architecture.md "Plan JSON" ----------------------------------------------

def test_json_has_the_keys_of_the_design(plan_dict):
    assert TOP_KEYS <= set(plan_dict)
    assert plan_dict["schema"] == SCHEMA == "autopar.plan/1"
    for section, keys in SECTION_KEYS.items():
        assert keys <= set(plan_dict[section]), (section, keys - set(plan_dict[section]))
    assert COMM_KINDS <= set(plan_dict["predicted"]["comm_s"])
    assert MEMORY_KINDS <= set(plan_dict["predicted"]["memory_bytes"])
    assert isinstance(plan_dict["checkpointing"], str)
    assert isinstance(plan_dict["pipeline"]["stages"], list)


def test_model_and_cluster_values(plan, bundle):
    assert plan.model["name"] == "tiny-gpt"
    assert plan.model["params"] == sum(p.numel() for p in bundle.model.parameters())
    assert plan.model["layers"] == 2
    assert plan.model["flops_per_step"] > 0
    assert plan.cluster["spec"] == "1x4xcpu"
    assert plan.cluster["devices"] == 4


def test_mesh_and_degrees_are_consistent(plan):
    shape, names = plan.mesh["shape"], plan.mesh["dim_names"]
    assert len(shape) == len(names) >= 1
    assert math.prod(shape) * plan.degrees["pp"] == plan.cluster["devices"]
    d = plan.degrees
    assert all(isinstance(v, int) and v >= 1 for v in d.values())
    assert d["dp"] * d["tp"] * d["pp"] * d["cp"] * d["ep"] == plan.cluster["devices"]
    for name, size in zip(names, shape):
        assert d[name] == size
    assert d["dp"] % d["fsdp"] == 0 and d["tp"] % d["sp"] == 0


def test_pipeline_splits_the_global_batch(plan):
    pipe = plan.pipeline
    assert pipe["microbatches"] >= 1
    assert pipe["microbatch_size"] * pipe["microbatches"] * plan.degrees["dp"] == BATCH


def test_placements_cover_every_parameter(plan, bundle):
    assert set(plan.placements) == {n for n, _ in bundle.model.named_parameters()}
    ndim = len(plan.mesh["shape"])
    for fqn, pls in plan.placements.items():
        assert len(pls) == ndim, fqn
        assert all(PLACEMENT.match(p) for p in pls), (fqn, pls)
        assert not any(p.is_partial() for p in strs_to_placements(pls)), (fqn, pls)  # parameters are never partial


def test_ops_name_strategies_in_placement_strings(plan):
    assert plan.ops
    ndim = len(plan.mesh["shape"])
    assert any("mm" in op["op"] for op in plan.ops.values())
    for name, op in plan.ops.items():
        assert op["op"].startswith("aten."), name
        for pls in [*op["inputs"], *(o for o in op["outputs"] if o is not None)]:
            assert len(pls) == ndim, (name, pls)
            assert all(PLACEMENT.match(p) for p in pls), (name, pls)


def test_predicted_values_are_consistent(plan):
    p = plan.predicted
    assert p["step_time_s"] > 0 and p["compute_s"] > 0
    assert math.isclose(p["step_time_s"], p["compute_s"] + p["exposed_comm_s"], rel_tol=1e-9)
    assert math.isclose(p["peak_memory_bytes"], sum(p["memory_bytes"].values()), rel_tol=1e-12)
    assert all(v >= 0 for v in p["comm_s"].values())
    assert all(v > 0 for k, v in p["memory_bytes"].items()), p["memory_bytes"]
    assert p["peak_memory_bytes"] <= p["memory_capacity_bytes"]
    assert p["bubble_s"] == 0.0  # no pipeline in this plan
    assert math.isclose(p["tokens_per_s"], BATCH * SEQ / p["step_time_s"], rel_tol=1e-9)


def test_mfu_follows_the_megatron_convention(plan):
    """mfu = model FLOPs per step / (step time x devices x peak FLOP/s of the compute dtype)."""
    peak = plan.cluster["device_spec"]["peak_flops"][plan.model["dtype"]]
    want = plan.model["flops_per_step"] / (plan.predicted["step_time_s"] * plan.cluster["devices"] * peak)
    assert math.isclose(plan.predicted["mfu"], want, rel_tol=1e-9)
    assert 0 < plan.predicted["mfu"] < 1


def test_solver_section(plan):
    s = plan.solver
    assert s["status"] in ("optimal", "feasible")
    assert math.isclose(s["objective"], plan.predicted["step_time_s"], rel_tol=1e-12)
    assert s["bound"] <= s["objective"] * (1 + 1e-9)
    assert 0.0 <= s["gap"] <= 1.0
    assert s["wall_s"] >= 0
    assert s["variables"] > 0 and s["constraints"] > 0


# ---- malformed files ---------------------------------------------------------------------------

def _raises_naming(path, match=None):
    with pytest.raises(PlanFormatError) as info:
        Plan.load(path)
    assert path.name in str(info.value), str(info.value)
    if match:
        assert re.search(match, str(info.value)), str(info.value)
    return info.value


def test_not_json(tmp_path):
    _raises_naming(_write(tmp_path, "{not json", "broken.json"), "JSON")


def test_not_an_object(tmp_path):
    _raises_naming(_write(tmp_path, [1, 2], "list.json"))


def test_wrong_schema(plan_dict, tmp_path):
    plan_dict["schema"] = "autopar.plan/999"
    _raises_naming(_write(tmp_path, plan_dict, "future.json"), "autopar.plan/999")


@pytest.mark.parametrize("key", sorted(TOP_KEYS - {"schema", "precision"}))  # precision: read from model.dtype
def test_missing_key(plan_dict, tmp_path, key):
    del plan_dict[key]
    _raises_naming(_write(tmp_path, plan_dict, f"no-{key}.json"), key)


def test_placement_list_of_wrong_length(plan_dict, tmp_path):
    fqn = next(iter(plan_dict["placements"]))
    plan_dict["placements"][fqn] = plan_dict["placements"][fqn] + ["R"]
    _raises_naming(_write(tmp_path, plan_dict, "long.json"), re.escape(fqn))


def test_mesh_that_does_not_cover_the_cluster(plan_dict, tmp_path):
    plan_dict["cluster"]["devices"] = 64
    _raises_naming(_write(tmp_path, plan_dict, "small-mesh.json"))


def test_leading_layers_that_are_not_a_count(plan_dict, tmp_path):
    plan_dict["pipeline"]["leading_layers"] = -1
    _raises_naming(_write(tmp_path, plan_dict, "leading.json"), "pipeline.leading_layers")


def test_nonexistent_file(tmp_path):
    path = tmp_path / "nowhere.json"
    with pytest.raises(PlanFormatError, match="nowhere.json"):
        Plan.load(path)


@pytest.mark.parametrize("checkpointing, recomputed, match", [
    ("some", {}, "checkpointing must be one of none, core_attention, selective, save_dot_except_mlpwi, full, mixed"),
    ("mixed", {}, "recomputed_layers lists each recomputed layer"),
    ("full", {"blocks.0": "full"}, "only when, checkpointing is 'mixed'"),
    ("mixed", {"blocks.0": "most"}, "modes must be one of core_attention, selective, save_dot_except_mlpwi, full"),
])
def test_bad_checkpointing_is_a_format_error(plan_dict, tmp_path, checkpointing, recomputed, match):
    plan_dict.update(checkpointing=checkpointing, recomputed_layers=recomputed)
    _raises_naming(_write(tmp_path, plan_dict, "checkpointing.json"), match)


def test_mixed_checkpointing_names_each_layer_mode(plan_dict, tmp_path):
    plan_dict.update(checkpointing="mixed", recomputed_layers={"blocks.1": "selective"})
    loaded = Plan.load(_write(tmp_path, plan_dict, "mixed.json"))
    assert [loaded.checkpointing_of(f"blocks.{i}") for i in range(3)] == ["none", "selective", "none"]


@pytest.mark.parametrize("key", ["inputs", "buffers", "recomputed_layers"])
def test_sections_beyond_the_design_minimum_are_optional(plan_dict, tmp_path, key):
    """docs/architecture.md "Plan JSON" lists the minimum keys; a plan without autopar's extra sections still loads."""
    del plan_dict[key]
    loaded = Plan.load(_write(tmp_path, plan_dict, f"no-{key}.json"))
    assert getattr(loaded, key) == {}
    assert loaded.placements == plan_dict["placements"]


@pytest.mark.parametrize("key, value", [("mesh", []), ("degrees", []), ("placements", []), ("cluster", "x")])
def test_section_of_wrong_type_is_a_format_error(plan_dict, tmp_path, key, value):
    plan_dict[key] = value
    _raises_naming(_write(tmp_path, plan_dict, f"bad-{key}.json"))


def test_bad_placement_string_is_a_format_error(plan_dict, tmp_path):
    fqn = next(iter(plan_dict["placements"]))
    plan_dict["placements"][fqn] = ["banana"] * len(plan_dict["mesh"]["shape"])
    _raises_naming(_write(tmp_path, plan_dict, "banana.json"), "banana")


# ---- summary --------------------------------------------------------------------------------------

def test_summary_shows_mesh_degrees_time_and_collapsed_layers(plan):
    from autopar.inspect.show import fmt_seconds

    text = plan.summary()
    assert str(plan) == text
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh["dim_names"], plan.mesh["shape"]))
    assert re.search(r"^mesh\s+" + re.escape(mesh) + "$", text, re.M), text
    assert re.search(r"^degrees\s+dp=\d+\s+fsdp=\d+\s+tp=\d+", text, re.M), text
    assert fmt_seconds(plan.predicted["step_time_s"]) in text
    assert re.search(r"predicted step \d+(\.\d+)? (s|ms|us)", text)
    rows = [line.split()[0] for line in text.splitlines() if line.startswith("  blocks.")]
    assert rows and all(r.startswith("blocks.*.") for r in rows), rows  # both layers agree: one row each
    assert "blocks.*.attn.q_proj.weight" in rows
    assert "tok_emb.weight" in text


def test_summary_lists_a_row_per_layer_when_layers_disagree(plan):
    placements = dict(plan.placements)
    ndim = len(plan.mesh["shape"])
    placements["blocks.0.ln1.weight"] = ["S(0)"] * ndim
    placements["blocks.1.ln1.weight"] = ["R"] * ndim
    text = dataclasses.replace(plan, placements=placements).summary()
    assert "blocks.0.ln1.weight" in text and "blocks.1.ln1.weight" in text
    assert "blocks.*.ln1.weight" not in text


# ---- placement strings ------------------------------------------------------------------------------

@pytest.mark.parametrize("placement, text", [
    (Shard(0), "S(0)"), (Shard(2), "S(2)"), (Replicate(), "R"), (Partial(), "P"), (Partial("avg"), "P(avg)"),
])
def test_placement_strings_round_trip(placement, text):
    assert placement_to_str(placement) == text
    assert PLACEMENT.match(text)
    assert str_to_placement(text) == placement
    assert placement_to_str(str_to_placement(f" {text} ")) == text


def test_placement_list_helpers():
    strs = ["S(1)", "R", "P"]
    ps = strs_to_placements(strs)
    assert ps == (Shard(1), Replicate(), Partial())
    assert placements_to_strs(ps) == strs
    assert [p.is_shard() for p in ps] == [True, False, False]
    assert [p.is_partial() for p in strs_to_placements(strs + ["P(avg)"])] == [False, False, True, True]


def test_optimizer_state_splits_on_the_first_dim_no_mesh_dim_shards():
    """ZeRO's shard dim (``optimizer_shard_dim``) skips tensor dims a mesh dim already splits, and a dim
    too small to split ``ways`` ways; a tensor with no such dim keeps whole state (None)."""
    assert optimizer_shard_dim((8, 6), (Replicate(), Replicate()), 4) == 0
    assert optimizer_shard_dim((8, 6), (Shard(0), Replicate()), 4) == 1
    assert optimizer_shard_dim((8, 6), (Replicate(), Shard(-2)), 4) == 1  # a negative dim counts from the end
    assert optimizer_shard_dim((8, 2), (Shard(0), Partial()), 4) is None
    assert optimizer_shard_dim((), (Replicate(),), 2) is None


@pytest.mark.parametrize("bad", ["X", "S", "S()", "S(a)", "Shard(0)", "r", ""])
def test_bad_placement_string(bad):
    with pytest.raises(PlanFormatError, match="bad placement"):
        str_to_placement(bad)
