"""Hugging Face ``transformers`` models as they come (``autopar/models/hf.py``), built from tiny configs
with random weights, nothing downloaded:

* every family (GPT-2, Llama, Mistral, Mixtral, Qwen2, BERT, T5, ViT) captures and plans offline, with an
  attention mask or the model's own loss (``labels=``); a tied weight is one parameter with one
  placement; the checks torch.export records (``aten._assert_tensor_metadata``) are not in the graph;
  masked attention is split on heads, and an op with no sharding rule runs replicated with a warning;
* a capture that fails on data-dependent control flow or shapes names the module, the source line
  and what to change;
* numerical parity on 2 gloo ranks (docs/architecture.md "Correctness"), 3 SGD steps, in one spawn:
  the decoder LMs and BERT under dp=2 and tp=2 (GPT-2 also FSDP), Mixtral, T5 and ViT, and weights
  tied across pipeline stages (pp=2: GPT-2, Llama, tiny-gpt with ``tie_embeddings``), whose copies'
  gradients the runtime sums, and on 4 ranks (pp=2 x FSDP dp=2, pp=2 x tp=2);
* ``autopar plan autopar.models.hf:gpt2`` from the command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.ir.capture import TrainingStep, capture  # noqa: E402
from autopar.models import build_model  # noqa: E402
from autopar.testing.parity import train_parallel_many, train_single  # noqa: E402
from cli_runner import run_cli  # noqa: E402

FAMILIES = ["gpt2", "llama", "mistral", "mixtral", "qwen2", "bert", "t5", "vit"]
TIED = {  # the names a family's tied weight also goes by -> the one it keeps (nn.Module's first)
    "gpt2": {"hf.lm_head.weight": "hf.transformer.wte.weight"},
    "llama": {"hf.lm_head.weight": "hf.model.embed_tokens.weight"},
    "mistral": {},
    "mixtral": {},
    "qwen2": {"hf.lm_head.weight": "hf.model.embed_tokens.weight"},
    "bert": {"hf.cls.predictions.decoder.weight": "hf.bert.embeddings.word_embeddings.weight",
             "hf.cls.predictions.decoder.bias": "hf.cls.predictions.bias"},
    "t5": {"hf.encoder.embed_tokens.weight": "hf.shared.weight", "hf.decoder.embed_tokens.weight": "hf.shared.weight",
           "hf.lm_head.weight": "hf.shared.weight"},
    "vit": {},
}
BATCH, STEPS = 4, 3


def _bundle(family: str, device: str = "meta", **overrides: object):
    return build_model(f"autopar.models.hf:{family}", overrides=overrides, global_batch=BATCH, device=device)


def _plan(bundle, constraints: dict) -> autopar.Plan:
    return autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, constraints,
                        example_targets=bundle.example_targets)


@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_captures_and_plans_offline_with_its_tied_weights_placed_once(family: str) -> None:
    own_loss = family in ("llama", "bert", "vit")  # the model's loss from labels=; the others' logits
    bundle = _bundle(family, own_loss=own_loss, **({} if family == "vit" else {"mask": True}))
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    assert captured.aliases == TIED[family]
    names = dict(bundle.model.named_parameters())  # nn.Module's own dedup of tied names
    assert sorted(captured.params.values()) == sorted(names)
    plan = _plan(bundle, {"tp": 2})
    assert sorted(plan.placements) == sorted(names)
    assert plan.degrees.tp == 2


def test_the_checks_torch_export_records_are_dropped_from_the_graph() -> None:
    """Llama's ``.to(dtype)`` leaves ``aten._assert_tensor_metadata`` nodes, which return nothing and
    broke the runtime; capture drops every such op."""
    bundle = _bundle("llama", device="cpu")
    step = TrainingStep(bundle.model, bundle.loss_fn, True)
    exported = torch.export.export(step, (*bundle.example_inputs, bundle.example_targets), strict=False)
    recorded = [n for n in exported.graph.nodes if "_assert_tensor_metadata" in str(n.target)]
    assert recorded, "the export no longer records the check: this test no longer tests the drop"
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    assert not [n for n in captured.graph.nodes if n.op == "call_function" and "_assert" in str(n.target)]


def test_masked_attention_is_split_on_heads_and_its_mask_built_on_local_shards_without_warnings() -> None:
    """transformers builds the padding mask by advanced indexing (``aten.index.Tensor``), which DTensor offers no
    strategy for: autopar's own (``strategies.index_strategies``) runs it on local shards, with no warning that
    an op runs replicated."""
    bundle = _bundle("llama", mask=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = _plan(bundle, {"tp": 2})
    assert not [str(w.message) for w in caught if "no DTensor sharding strategy" in str(w.message)]
    attention = [op for op in plan.ops.values() if op["op"].endswith("scaled_dot_product_attention.default")]
    assert len(attention) == 2 and all(op["local"] for op in attention)
    # q, k, v split on heads; the mask [b, 1, s, s] broadcasts over heads, so each rank reads all of it
    assert all(op["inputs"] == [["S(1)"]] * 3 + [["R"]] and op["outputs"] == [["S(1)"]] for op in attention)
    index = [op for op in plan.ops.values() if op["op"].endswith("index.Tensor")]
    assert index and all(op["local"] for op in index)


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return x * 2
        return x


class _Select(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]  # a data-dependent shape


def test_a_capture_failure_names_module_line_and_what_to_change() -> None:
    branching = nn.Sequential(nn.Linear(8, 8), _Gate())
    with pytest.raises(autopar.UnsupportedModelError,
                       match=r"raised at .*test_hf_models.py:\d+ in forward of module 1 \(_Gate\)\); .*torch\.where"):
        autopar.plan(branching, (torch.randn(4, 8),), "1x2xcpu", lambda out: out.sum())
    selecting = nn.Sequential(nn.Linear(8, 8), _Select())
    with pytest.raises(autopar.UnsupportedModelError,
                       match=r"in module 1 makes a tensor of shape \[u\d+\], known only at run time at .*test_hf_models"
                             r".*return x\[x > 0\].*fixed shape"):
        autopar.plan(selecting, (torch.randn(4, 8),), "1x2xcpu", lambda out: out.sum())


def _run(name: str, constraints: dict, **overrides: object) -> dict:
    return dict(name=name if ":" in name or name.startswith("tiny") else f"autopar.models.hf:{name}",
                overrides=overrides, global_batch=BATCH, seq=None, steps=STEPS, plan=None, constraints=constraints)


def _assert_parity(world: int, runs: list[dict]) -> None:
    results = train_parallel_many(world, runs)
    for run, result in zip(runs, results):
        degrees = result.plan["degrees"]
        pinned = {"zero" if k == "fsdp" else k: v for k, v in run["constraints"].items() if k != "schedule"}
        assert {k: degrees.get(k) for k in pinned} == pinned
        result.assert_matches(train_single(run["name"], run["overrides"], BATCH, None, STEPS),
                              f"{run['name']} {run['overrides']} under {run['constraints']}")


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_hf_models_train_like_single_process_under_dp_tp_and_pp() -> None:
    _assert_parity(2, [
        _run("gpt2", {"dp": 2}, mask=True), _run("gpt2", {"tp": 2}, own_loss=True),
        _run("gpt2", {"dp": 2, "fsdp": 3}),  # the tied weight sharded once, gathered for both uses
        _run("llama", {"dp": 2}, own_loss=True), _run("llama", {"tp": 2}, mask=True),
        _run("mistral", {"dp": 2}), _run("mistral", {"tp": 2}, mask=True, own_loss=True),
        _run("mixtral", {"tp": 2}, mask=True),
        _run("qwen2", {"dp": 2}, mask=True), _run("qwen2", {"tp": 2}),
        _run("bert", {"dp": 2}, own_loss=True), _run("bert", {"tp": 2}, mask=True),
        _run("t5", {"tp": 2}, mask=True), _run("vit", {"dp": 2}, own_loss=True),
        # weights tied across pipeline stages: embedding on the first, output layer on the last
        _run("gpt2", {"pp": 2}, mask=True), _run("llama", {"pp": 2, "schedule": "gpipe"}, own_loss=True),
        _run("tiny-gpt", {"pp": 2}, tie_embeddings=True),
        # the encoder and the decoder's first layer (its relative position bias) on the first stage, which passes
        # the encoder's output and the bias on; one embedding tied across the stages
        _run("t5", {"pp": 2}, layers=3, mask=True),
    ])


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
def test_tied_weights_across_stages_of_a_4_rank_pipeline_train_like_single_process() -> None:
    """Each stage's copy sharded on tp, or by FSDP on dp (there the embedding's and the output layer's
    gradients lie in memory differently: the sum must still pair like elements)."""
    _assert_parity(4, [_run("gpt2", {"pp": 2, "dp": 2, "fsdp": 3}, mask=True),
                       _run("qwen2", {"pp": 2, "tp": 2}, own_loss=True)])


@pytest.mark.slow
def test_cli_plans_an_hf_factory() -> None:
    run = subprocess.run([sys.executable, "-m", "autopar", "plan", "autopar.models.hf:gpt2", "--cluster", "1x8xH100",
                          "--global-batch", "8", "--seq", "16", "--set", "mask=true,own_loss=true", "--json"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["model"]["name"] == "autopar.models.hf:gpt2"
    assert "hf.transformer.wte.weight" in plan["placements"] and "hf.lm_head.weight" not in plan["placements"]


def test_a_config_the_family_refuses_is_one_line_naming_the_override_and_the_factory_line() -> None:
    """transformers validates its config (heads must divide the hidden size) deep in its own code: the CLI
    says which factory failed with which override, the library's message, and the factory's line."""
    run = run_cli("plan", "autopar.models.hf:llama", "--cluster", "1x2xcpu", "--set", "heads=7")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.startswith("autopar plan: error: model factory 'autopar.models.hf:llama' failed with heads=7: ")
    assert "(7)" in run.stderr and run.stderr.rstrip().endswith("in _decoder_config)")
    assert len(run.stderr.strip().splitlines()) == 1


@pytest.mark.extended
@pytest.mark.dist
def test_the_families_benchmark_runs_a_row_and_merges_it_into_its_results(tmp_path) -> None:
    """``benchmarks/hf_families.py`` (every family it has plans and trains at parity, its table in
    benchmarks/README.md): one row again, planned and trained under dp, tp and pp, the other rows kept."""
    out = tmp_path / "families.json"
    out.write_text(json.dumps({"rows": [{"family": "Gemma", "config": "GemmaConfig", "plan": "ok", "replicated": []}]}))
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "hf_families.py")
    run = subprocess.run([sys.executable, script, "--parity", "--only", "SqueezeBERT", "--out", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["family"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"Gemma", "SqueezeBERT"}
    assert rows["SqueezeBERT"]["plan"] == "ok"
    assert rows["SqueezeBERT"]["parity"] == {"dp=2": "ok", "tp=2": "ok", "pp=2": "ok"}
    assert "| SqueezeBERT | `SqueezeBertConfig` | ok | ok | ok | ok |" in run.stdout
