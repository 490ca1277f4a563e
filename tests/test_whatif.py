"""What-if without re-capturing: saved planning problems (round trip, malformed files), re-solving a
saved problem with added constraints, and re-pricing a plan on another cluster (API and CLI)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import autopar
from autopar import BadInputError
from autopar.ir.capture import CapturedGraph, capture, module_path
from autopar.cli import main
from autopar.cost_models import parse_cluster
from autopar.models import build_model
from autopar.core.constraints import Constraints
from autopar.planning.search import make_plan
from autopar.ir.problem_file import load_problem, save_problem

BATCH = 16  # splits over 4 cpu ranks and 16 H100s


def _plan(captured: CapturedGraph, cluster: str, constraints=None, name: str = "tiny-gpt") -> autopar.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_plan(captured, parse_cluster(cluster), model_name=name,
                         constraints=Constraints.from_mapping(constraints or {}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """tiny-gpt and tiny-llama: the capture, and the same capture saved to a file and read back."""
    out = {}
    for name in ("tiny-gpt", "tiny-llama"):
        bundle = build_model(name, global_batch=BATCH, device="meta")
        captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
        path = tmp_path_factory.mktemp("problems") / f"{name}.json"
        save_problem(captured, path, model_name=name)
        out[name] = (captured, path, load_problem(path))
    return out


@pytest.fixture(scope="module")
def planned(saved):
    """``planned(name, cluster, constraints)``: a plan of the loaded problem, made once per module."""
    cache = {}

    def get(name: str, cluster: str, constraints: dict | None = None) -> autopar.Plan:
        key = (name, cluster, json.dumps(constraints, sort_keys=True))
        if key not in cache:
            cache[key] = _plan(saved[name][2].captured, cluster, constraints, name=name)
        return cache[key]

    return get


def _same_decisions(a: autopar.Plan, b: autopar.Plan) -> None:
    assert a.mesh == b.mesh and a.degrees == b.degrees and a.pipeline == b.pipeline
    assert a.placements == b.placements and a.inputs == b.inputs and a.buffers == b.buffers
    assert {n: (op["inputs"], op["outputs"]) for n, op in a.ops.items()} == \
        {n: (op["inputs"], op["outputs"]) for n, op in b.ops.items()}


# ---- saved problems -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_loaded_graph_is_the_captured_graph(saved, name):
    captured, path, loaded = saved[name]
    back = loaded.captured
    assert json.loads(path.read_text())["schema"] == "autopar.problem/1"
    assert loaded.model_name == name
    shapes = [list(captured.node(n).meta["val"].shape) for n in captured.user_inputs]
    assert [i["shape"] for i in loaded.inputs] == shapes
    assert (back.params, back.buffers, back.user_inputs, back.loss_node, back.tie_keys) == \
        (captured.params, captured.buffers, captured.user_inputs, captured.loss_node, captured.tie_keys)
    for old, new in zip(captured.graph.nodes, back.graph.nodes, strict=True):
        assert (new.name, new.op, new.target) == (old.name, old.op, old.target)
        assert repr(new.args) == repr(old.args) and repr(new.kwargs) == repr(old.kwargs)
        assert module_path(new) == module_path(old)
        assert _described(new.meta.get("val")) == _described(old.meta.get("val"))


def _described(val):
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.stride(), val.dtype)
    if isinstance(val, (list, tuple)):
        return tuple(_described(v) for v in val)
    return val


DP16 = {"dp": 16, "pp": 1, "checkpointing": "none"}  # pinned where a test needs no search (keeps it fast)
FSDP16 = {**DP16, "fsdp": 3}


@pytest.mark.parametrize("name, cluster, constraints", [
    ("tiny-gpt", "1x4xcpu", None), ("tiny-llama", "2x8xH100", DP16),
    pytest.param("tiny-llama", "2x8xH100", None, marks=[pytest.mark.slow, pytest.mark.heavy]),
])
def test_loaded_problem_plans_like_the_capture(saved, planned, name, cluster, constraints):
    original = _plan(saved[name][0], cluster, constraints, name=name)
    again = planned(name, cluster, constraints)
    _same_decisions(original, again)
    assert again.predicted["step_time_s"] == pytest.approx(original.predicted["step_time_s"], rel=1e-9)
    assert again.predicted["memory_bytes"] == original.predicted["memory_bytes"]
    assert again.model == original.model  # same fingerprint, parameter count, FLOPs


MALFORMED = {
    "not JSON": (lambda text: text[:100], "not JSON"),
    "wrong schema": (lambda text: text.replace("autopar.problem/1", "autopar.problem/9"), "schema"),
    "a plan": (lambda text: json.dumps({"schema": "autopar.plan/1"}), "autopar.problem/1"),
    "unknown op": (lambda text: text.replace('"aten.mm.default"', '"aten.no_such_op.default"', 1), "no_such_op"),
    "dangling node": (lambda text: text.replace('{"node":"', '{"node":"missing_', 1), "missing_"),
    "bad dtype": (lambda text: text.replace('"dtype":"float32"', '"dtype":"float99"', 1), "float99"),
    "unknown param": (lambda text: _edit(text, lambda d: d["params"].update(ghost="w")), "ghost"),
    "nodes not a list": (lambda text: _edit(text, lambda d: d.update(nodes={})), "'nodes'"),
    "leading layers not first": (lambda text: _edit(text, lambda d: d.update(leading_layers=["blocks.1"])),
                                 "'leading_layers' must list the graph's first layers"),
}


def _edit(text: str, change) -> str:
    data = json.loads(text)
    change(data)
    return json.dumps(data)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_problem_file_names_the_file_and_the_fault(saved, tmp_path, case):
    mutate, mentions = MALFORMED[case]
    bad = tmp_path / "bad.json"
    bad.write_text(mutate(saved["tiny-gpt"][1].read_text()))
    with pytest.raises(BadInputError) as err:
        load_problem(bad)
    assert str(bad) in str(err.value) and mentions in str(err.value)


def test_missing_problem_file(tmp_path):
    with pytest.raises(BadInputError, match="no such problem file"):
        load_problem(tmp_path / "nope.json")


# ---- re-solving -----------------------------------------------------------------------------------

def test_resolving_a_saved_problem_with_a_constraint_equals_planning_the_model(saved, planned):
    captured, _, loaded = saved["tiny-gpt"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resolved = autopar.plan(loaded, cluster="2x8xH100", constraints=FSDP16)
    direct = _plan(captured, "2x8xH100", FSDP16)
    assert resolved.degrees["fsdp"] > 1 and resolved.model["name"] == "tiny-gpt"
    _same_decisions(direct, resolved)
    assert resolved.predicted["step_time_s"] == pytest.approx(direct.predicted["step_time_s"], rel=1e-9)


def test_api_saves_the_problem_and_refuses_inputs_with_a_saved_one(tmp_path):
    bundle = build_model("mlp", global_batch=8)
    path = tmp_path / "mlp.json"
    first = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn,
                         example_targets=bundle.example_targets, name="mlp", save_problem=path)
    problem = autopar.load_problem(path)
    assert autopar.plan(problem, cluster="1x2xcpu").placements == first.placements
    with pytest.raises(BadInputError, match="already fixes"):
        autopar.plan(problem, bundle.example_inputs, cluster="1x2xcpu")


def test_a_saved_problem_keeps_the_leading_layers_a_pipeline_sets_apart(tmp_path):
    bundle = build_model("edge_models:dense_first_blocks", global_batch=8, device="meta")
    path = tmp_path / "dense_first.json"
    first = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, {"pp": 2},
                         example_targets=bundle.example_targets, save_problem=path)
    again = autopar.plan(autopar.load_problem(path), cluster="1x2xcpu", constraints={"pp": 2})
    assert again.pipeline.stages == first.pipeline.stages == [[0, 3], [3, 5]]
    assert again.predicted["step_time_s"] == pytest.approx(first.predicted["step_time_s"], rel=1e-9)


# ---- re-pricing -----------------------------------------------------------------------------------

REPRICED = [("tiny-gpt", "1x4xcpu", None), ("tiny-llama", "2x8xH100", DP16),
            ("tiny-gpt", "2x8xH100", FSDP16), ("tiny-gpt", "1x4xcpu", {"dp": 4, "microbatches": 2}),
            ("tiny-gpt", "2x8xH100", {**DP16, "fsdp": 1}),  # ZeRO-1: optimizer state sharded
            ("tiny-llama", "2x8xH100", {"dp": 8, "pp": 2, "microbatches": 2, "checkpointing": "full"})]


@pytest.mark.parametrize("name, cluster, constraints", REPRICED)
def test_reprice_on_the_same_cluster_reproduces_the_plan(saved, planned, name, cluster, constraints):
    _, _, loaded = saved[name]
    plan = planned(name, cluster, constraints)
    again = autopar.reprice(plan, loaded, cluster)
    _same_decisions(plan, again)
    assert again.checkpointing == plan.checkpointing
    assert again.predicted["step_time_s"] == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)
    for key in ("compute_s", "exposed_comm_s", "bubble_s", "grad_sync_s"):
        assert again.predicted[key] == pytest.approx(plan.predicted[key], rel=1e-9, abs=1e-15), key
    assert again.predicted["comm_s"] == pytest.approx(plan.predicted["comm_s"], rel=1e-9, abs=1e-15)
    assert again.predicted["memory_bytes"] == plan.predicted["memory_bytes"]
    assert again.solver["status"] == "repriced"


def test_reprice_on_a_slower_network_costs_only_communication(saved, planned):
    _, _, loaded = saved["tiny-llama"]
    plan = planned("tiny-llama", "2x8xH100", DP16)  # the data-parallel dim crosses the two nodes
    slow = autopar.reprice(plan, loaded, "2x8xH100,ib=25Gbps")
    old, new = plan.predicted, slow.predicted
    assert new["step_time_s"] > old["step_time_s"]
    assert new["compute_s"] == pytest.approx(old["compute_s"], rel=1e-12)
    assert new["memory_bytes"] == old["memory_bytes"]
    for kind, seconds in old["comm_s"].items():
        assert new["comm_s"][kind] >= seconds * (1 - 1e-12), kind
    # a 1-stage step is compute plus exposed communication: the whole slowdown is communication
    slowdown = new["step_time_s"] - old["step_time_s"]
    assert slowdown == pytest.approx(new["exposed_comm_s"] - old["exposed_comm_s"], rel=1e-9)
    assert slow.cluster["spec"] == "2x8xH100,ib=25Gbps" and slow.placements == plan.placements


def test_reprice_on_slower_devices_of_the_same_count(saved, planned):
    _, _, loaded = saved["tiny-gpt"]
    plan = planned("tiny-gpt", "2x8xH100", DP16)
    a100 = autopar.reprice(plan, loaded, "2x8xA100-80GB")
    assert a100.predicted["compute_s"] > plan.predicted["compute_s"]
    assert a100.predicted["step_time_s"] > plan.predicted["step_time_s"]
    assert a100.model["dtype"] == plan.model["dtype"]
    assert math.prod(a100.mesh["shape"]) == 16


def test_reprice_refuses_another_world_size_and_another_model(saved, planned):
    _, _, gpt = saved["tiny-gpt"]
    _, _, llama = saved["tiny-llama"]
    plan = planned("tiny-gpt", "1x4xcpu")
    with pytest.raises(BadInputError, match="plan --problem"):
        autopar.reprice(plan, gpt, "1x8xcpu")
    with pytest.raises(BadInputError, match="other parameters or input shapes"):
        autopar.reprice(plan, llama, "1x4xcpu")


# ---- the command line (in process: main() returns the exit code) ---------------------------------

@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    """A tiny-gpt plan and its problem, as `autopar plan tiny-gpt ... --save-problem` writes them."""
    d = tmp_path_factory.mktemp("cli")
    code = main(["plan", "tiny-gpt", "--cluster", "1x4xcpu", "--global-batch", str(BATCH), "--fix", "dp=4",
                 "-o", str(d / "plan.json"), "--save-problem", str(d / "problem.json"), "--json"])
    assert code == 0
    return d


def test_cli_plan_saves_the_problem(cli_files, capsys):
    assert load_problem(cli_files / "problem.json").model_name == "tiny-gpt"
    assert json.loads((cli_files / "plan.json").read_text())["schema"] == "autopar.plan/1"


def test_cli_plan_from_a_saved_problem(cli_files, capsys):
    code = main(["plan", "--problem", str(cli_files / "problem.json"), "--cluster", "2x8xH100",
                 "--fix", "dp=16,fsdp=3,pp=1,checkpointing=none", "--json"])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["degrees"]["fsdp"] > 1 and plan["model"]["name"] == "tiny-gpt"


def test_cli_reprice_prints_the_comparison_and_writes_the_plan(cli_files, capsys):
    out_file = cli_files / "slow.json"
    code = main(["reprice", str(cli_files / "plan.json"), "--problem", str(cli_files / "problem.json"),
                 "--cluster", "1x4xcpu,nvlink=1GBps", "-o", str(out_file)])
    assert code == 0
    out = capsys.readouterr().out
    assert "1x4xcpu,nvlink=1GBps" in out and "step time" in out and "placements that differ: 0" in out
    assert autopar.Plan.load(out_file).cluster["spec"] == "1x4xcpu,nvlink=1GBps"


def test_cli_reprice_keeps_the_plans_sequence_layout(tmp_path, capsys):
    """A cp plan made before load balancing (no ``cp_layout``: contiguous chunks) is re-priced as the
    contiguous plan it is, and a load-balanced one stays load-balanced."""
    balanced, problem = tmp_path / "balanced.json", tmp_path / "problem.json"
    assert main(["plan", "tiny-llama", "--cluster", "1x2xcpu", "--global-batch", "4", "--fix", "cp=2",
                 "-o", str(balanced), "--save-problem", str(problem), "--json"]) == 0
    old = json.loads(balanced.read_text())
    assert old.pop("cp_layout") == "load_balanced"
    (tmp_path / "old.json").write_text(json.dumps(old))
    for given, layout in (("balanced", "load_balanced"), ("old", "contiguous")):
        out = tmp_path / f"{given}-repriced.json"
        assert main(["reprice", str(tmp_path / f"{given}.json"), "--problem", str(problem),
                     "--cluster", "1x2xcpu,nvlink=1GBps", "-o", str(out)]) == 0
        assert autopar.Plan.load(out).cp_layout == layout


@pytest.mark.parametrize("args, mentions", [
    (["reprice", "{plan}", "--problem", "{problem}", "--cluster", "2x8xH100"], "plan --problem"),
    (["reprice", "{plan}", "--problem", "{bad}", "--cluster", "1x4xcpu"], "bad.json"),
    (["plan", "--problem", "{bad}", "--cluster", "1x4xcpu"], "bad.json"),
    (["plan", "--problem", "{problem}", "--cluster", "1x4xcpu", "--seq", "8"], "--seq"),
    (["plan", "tiny-gpt", "--problem", "{problem}", "--cluster", "1x4xcpu"], "not both"),
    (["plan", "--cluster", "1x4xcpu"], "MODEL"),
])
def test_cli_what_if_bad_input_exits_2(cli_files, capsys, args, mentions):
    (cli_files / "bad.json").write_text('{"schema": "autopar.problem/1", "nodes": 3}')
    files = {"plan": cli_files / "plan.json", "problem": cli_files / "problem.json", "bad": cli_files / "bad.json"}
    assert main([a.format(**files) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and mentions in err
