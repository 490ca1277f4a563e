"""A model built on the meta device, parallelized: each rank makes and initializes only its own shards
(``runtime/deferred_init.py``), on 2 gloo ranks.

What is checked, through ``autoparallelize``: the shards hold the model's initialization (norm weights ones,
biases zeros, rotary tables recomputed, random weights at their std; replicas alike, shards of one weight
independent draws), training from them matches one process trained from the same (gathered) weights, the
model is left on the meta device, and an initialization that leaves a tensor unset is refused on every
rank, naming it. (``init_weights`` for a model that has its weights is refused: ``tests/test_rank_agreement.py``.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import autopar
from autopar.api import autoparallelize
from autopar.core.errors import BadInputError
from autopar.models import build_model
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import LOSS_RTOL, PARAM_ATOL, batches, sgd

STEPS = 3
HF_LLAMA = "autopar.models.hf:llama"


def reset_and_adapt(model: nn.Module) -> None:
    """A user's initialization of ``edge_models:lora_blocks``: torch's modules reset, the adapters drawn."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            module.reset_parameters()
        elif hasattr(module, "a"):
            nn.init.normal_(module.a, std=0.1)
            nn.init.zeros_(module.b)


INITS = {"reset_and_adapt": reset_and_adapt}


def _train_from_meta(rank: int, name: str, constraints: dict[str, Any], lowered: bool | None,
                     init: str | None, built_on: str, save_to: str | None = None,
                     load_from: str | None = None, pretrained: str | None = None,
                     save_trained: str | None = None) -> dict[str, Any]:
    """One run on this rank: the model built on ``built_on``, autoparallelized, its state saved to or loaded
    from a checkpoint (``save_to``, ``load_from``) or loaded from a weights file or directory (``pretrained``)
    before any step, then trained ``STEPS`` SGD steps, and its weights then written to ``save_trained`` as
    Hugging Face names them (safetensors, ``HFModel``'s ``hf.`` prefix left out)."""
    model = build_model(name, global_batch=8, seq=16, device=built_on, seed=0).model
    data = build_model(name, global_batch=8, seq=16, device="cpu", seed=0)
    torch.manual_seed(100 + rank)  # ranks seeded apart: deferred initialization must not depend on it
    try:
        pm = autoparallelize(model, data.example_inputs, loss_fn=data.loss_fn, example_targets=data.example_targets,
                             constraints=constraints, lowered=lowered, init_weights=INITS.get(init))
    except BadInputError as e:
        return {"error": str(e)}
    if save_to:
        autopar.save_checkpoint(pm, None, save_to)
    if load_from:
        autopar.load_checkpoint(pm, None, load_from)
    if pretrained:
        autopar.load_full_state_dict(pm, pretrained)
    initial = {fqn: value.clone() for fqn, value in pm.full_state_dict().items()}  # not aliases of the live ones
    sharded = next(((fqn, p.to_local().clone()) for fqn, p in pm.named_parameters()
                    if isinstance(p, DTensor) and any(isinstance(x, Shard) for x in p.placements)), None)
    opt = sgd(pm.parameters())
    losses = []
    for batch in batches(data, STEPS, 0):
        opt.zero_grad()
        losses.append(pm.step(*batch).item())
        opt.step()
    if save_trained:
        autopar.save_full_state_dict(pm, save_trained, without_prefix="hf.")
    return {"initial": initial, "losses": losses, "final": pm.full_state_dict(), "sharded": sharded,
            "left_on_meta": all(t.is_meta for t in [*model.parameters(), *model.buffers()])}


def _runs_on_rank(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = [_train_from_meta(rank, **run) for run in runs]
    dist.barrier()
    return results


def _one_process(name: str, initial: dict[str, torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: one process trained from the parallel run's initial weights (buffers as built)."""
    bundle = build_model(name, global_batch=8, seq=16, device="cpu", seed=0)
    bundle.model.load_state_dict(initial, strict=False)
    opt = sgd(p for p in bundle.model.parameters() if p.requires_grad)
    losses = []
    for batch in batches(bundle, STEPS, 0):
        opt.zero_grad()
        loss = bundle.loss_fn(bundle.model(*batch[:-1]), batch[-1])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in bundle.model.named_parameters()}


def _check_trains_as_one_process(name: str, per_rank: list[dict[str, Any]]) -> None:
    first = per_rank[0]
    assert "error" not in first, first.get("error")
    assert first["left_on_meta"]
    for other in per_rank[1:]:
        assert other["losses"] == first["losses"]
    losses, params = _one_process(name, first["initial"])
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(losses), rtol=LOSS_RTOL, atol=0)
    for fqn, value in params.items():
        torch.testing.assert_close(first["final"][fqn], value, rtol=0, atol=PARAM_ATOL, msg=fqn)


def _check_initialized(initial: dict[str, torch.Tensor], per_rank: list[dict[str, Any]]) -> None:
    """Norm weights ones, random weights at the models' std (0.02), and the two ranks' shards of a split weight
    independent draws (not one draw repeated)."""
    for fqn, value in initial.items():
        assert not torch.isnan(value).any(), fqn
        if "norm" in fqn:
            assert torch.equal(value, torch.ones_like(value)), fqn
        elif value.dim() == 2:
            assert 0.017 < value.std().item() < 0.023, (fqn, value.std().item())
    (fqn, mine), (_, theirs) = per_rank[0]["sharded"], per_rank[1]["sharded"]
    assert mine.shape == theirs.shape and not torch.equal(mine, theirs), fqn


def test_a_model_built_on_meta_is_initialized_on_its_shards_and_trains_as_one_process() -> None:
    runs = [dict(name="tiny-llama", constraints={"dp": 2}, lowered=None, init=None, built_on="meta"),
            dict(name="tiny-llama", constraints={"tp": 2}, lowered=False, init=None, built_on="meta"),
            dict(name="edge_models:lora_blocks", constraints={"dp": 2}, lowered=None, init=None, built_on="meta"),
            dict(name="edge_models:lora_blocks", constraints={"tp": 2}, lowered=None, init="reset_and_adapt",
                 built_on="meta")]
    dp, tp, unset, adapted = zip(*run_on_ranks(_runs_on_rank, 2, runs))
    _check_trains_as_one_process("tiny-llama", dp)
    _check_trains_as_one_process("tiny-llama", tp)
    _check_initialized(tp[0]["initial"], tp)
    for rank in unset:  # the adapters (no reset_parameters) left unset: refused on every rank, naming them
        assert "left 8 of its tensors without values" in rank["error"] and "blocks.0.fc1.a" in rank["error"]
    _check_trains_as_one_process("edge_models:lora_blocks", adapted)
    assert not adapted[0]["initial"]["blocks.0.fc1.b"].any()


def test_pretrained_hugging_face_weights_load_into_a_model_built_on_meta_and_save_back(tmp_path) -> None:
    """Fine-tuning from a hub checkpoint and back: Hugging Face's Llama saved by ``save_pretrained`` in safetensors
    shards (its keys without ``HFModel``'s ``hf.`` prefix, its tied head left out), loaded into the model built on
    meta under tp=2: the weights are the saved ones, training goes on as one process from them, and the trained
    weights written as safetensors under Hugging Face's names load with ``from_pretrained``."""
    import transformers

    pretrained = build_model(HF_LLAMA, global_batch=8, seq=16, device="cpu", seed=7).model
    pretrained.hf.save_pretrained(tmp_path / "hub", max_shard_size="100KB")
    assert (tmp_path / "hub" / "model.safetensors.index.json").is_file()  # several shards, read through the index
    pretrained.hf.config.save_pretrained(tmp_path / "tuned")
    runs = [dict(name=HF_LLAMA, constraints={"tp": 2}, lowered=None, init=None, built_on="meta",
                 pretrained=str(tmp_path / "hub"), save_trained=str(tmp_path / "tuned" / "model.safetensors"))]
    (loaded,) = zip(*run_on_ranks(_runs_on_rank, 2, runs))
    saved = pretrained.state_dict()
    assert loaded[0]["initial"].keys() == {fqn for fqn, _ in pretrained.named_parameters()}
    for fqn, value in loaded[0]["initial"].items():
        assert torch.equal(value, saved[fqn]), fqn
    _check_trains_as_one_process(HF_LLAMA, loaded)
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    for name, value in tuned.named_parameters():
        assert torch.equal(value, loaded[0]["final"]["hf." + name]), name


@pytest.mark.extended
def test_a_checkpoint_loads_into_a_model_built_on_meta_under_another_plan(tmp_path) -> None:
    """The fine-tuning start: weights saved under dp=2 from a model built on the CPU, loaded into the same model
    built on meta under tp=2 (its shards initialized, then overwritten), train on as one process from them."""
    path = str(tmp_path / "ckpt")
    runs = [dict(name="tiny-llama", constraints={"dp": 2}, lowered=None, init=None, built_on="cpu", save_to=path),
            dict(name="tiny-llama", constraints={"tp": 2}, lowered=None, init=None, built_on="meta", load_from=path)]
    saved, loaded = zip(*run_on_ranks(_runs_on_rank, 2, runs))
    for fqn, value in saved[0]["initial"].items():
        assert torch.equal(loaded[0]["initial"][fqn], value), fqn
    _check_trains_as_one_process("tiny-llama", loaded)


@pytest.mark.extended
def test_meta_initialization_under_pipelines_fsdp_and_hugging_face() -> None:
    """Hugging Face's Llama by torch's convention: ``HFModel.reset_parameters`` is transformers' ``init_weights``
    (whose rotary tables are whole values copied into their shards)."""
    runs = [dict(name="tiny-gpt", constraints={"pp": 2}, lowered=None, init=None, built_on="meta"),
            dict(name="tiny-llama", constraints={"dp": 2, "fsdp": 3}, lowered=None, init=None, built_on="meta"),
            dict(name=HF_LLAMA, constraints={"tp": 2}, lowered=None, init=None, built_on="meta")]
    pp, fsdp, hf = zip(*run_on_ranks(_runs_on_rank, 2, runs))
    _check_trains_as_one_process("tiny-gpt", pp)
    _check_trains_as_one_process("tiny-llama", fsdp)
    _check_initialized(fsdp[0]["initial"], fsdp)
    _check_trains_as_one_process(HF_LLAMA, hf)
