"""Checkpoints that any plan loads (``autopar/runtime/checkpoint.py``), on gloo ranks.

One spawn of 4 ranks trains tiny-gpt ``SAVE_AT`` steps under each plan A and saves a distributed
checkpoint (model, optimizer state, step); one spawn of 2 ranks builds the model from another seed,
loads each checkpoint under a plan B of another world size and parallelism, and trains on to
``STEPS``. The losses of both halves equal single-process training of the same seed and batches with
the same optimizer (momentum SGD, or AdamW), the final parameters too (SGD), and the optimizer state
plan B loaded equals the one plan A saved, gathered (plan B's optimizer is made with another learning
rate, which the checkpoint's replaces). A control that loads the model but not the
optimizer state ends elsewhere, so the momentum check can fail. The same 2-rank spawn writes one
unsharded weights file, which a plain ``nn.Module`` and another plan load.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import autopar
from autopar.core.errors import BadInputError
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import (LOSS_RTOL, LR, PARAM_ATOL, batches, build, gathered, max_abs_diff,
                                    train_single)

MODEL = "tiny-gpt"
BATCH = 8
STEPS = 4
SAVE_AT = 2
ADAMW_LR = 1e-4  # as tests/test_examples.py: Adam moves each element by about lr, rounding included

OPTIMIZERS = {
    "sgd-momentum": functools.partial(torch.optim.SGD, lr=LR, momentum=0.9),
    "adamw": functools.partial(torch.optim.AdamW, lr=ADAMW_LR),
}
SCENARIOS = {  # name: (plan A on 4 ranks, plan B on 2 ranks, optimizer)
    "tp2xdp2 -> fsdp2": ({"tp": 2, "dp": 2, "fsdp": 0}, {"dp": 2, "fsdp": 3}, "sgd-momentum"),
    "pp2xdp2 -> tp2": ({"pp": 2, "dp": 2, "microbatches": 2}, {"tp": 2}, "sgd-momentum"),
    "zero1 dp4 -> dp2": ({"dp": 4, "fsdp": 1}, {"dp": 2, "fsdp": 0}, "sgd-momentum"),
    "zero2 dp2xtp2 -> pp2 (adamw)": ({"dp": 2, "tp": 2, "fsdp": 2}, {"pp": 2, "microbatches": 2}, "adamw"),
}
CONTROL = "tp2xdp2 -> fsdp2"
"""Loaded again without its optimizer state: the run must then differ from single-process training."""
FULL_FILE_FROM = "pp2xdp2 -> tp2"
"""Its plan B (tp=2) writes the unsharded weights file after training; plan FULL_FILE_INTO loads it."""
FULL_FILE_INTO = {"dp": 2, "fsdp": 3}
TIED = {"tie_embeddings": True}
"""A model whose token embedding is its head's weight: its unsharded file, written from a pipeline whose first and
last stage each hold that weight, must hold it under both names."""

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def _module(constraints: dict, seed: int, overrides: dict | None = None) -> tuple[Any, Any]:
    bundle = build(MODEL, overrides, BATCH, None, seed)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints=constraints)
    return pm, bundle


def _train(pm: Any, optimizer: Any, bundle: Any, first: int, last: int) -> list[float]:
    losses = []
    for batch in batches(bundle, STEPS, seed=0)[first:last]:
        optimizer.zero_grad()
        losses.append(pm.step(*batch).item())
        optimizer.step()
    return losses


def _optimizer_state(pm: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every parameter's optimizer state, gathered to full tensors (all stages), by flattened FQN key."""
    flat = autopar.optimizer_state_dict(pm, optimizer)
    return gathered({k: v for k, v in flat.items() if k.startswith("state.") and isinstance(v, torch.Tensor)})


def _save_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Plan A of every scenario: train to SAVE_AT, save; the losses and the optimizer state saved."""
    out = {}
    for name, (plan_a, _, opt_name) in SCENARIOS.items():
        pm, bundle = _module(plan_a, seed=0)
        optimizer = OPTIMIZERS[opt_name](pm.parameters())
        losses = _train(pm, optimizer, bundle, 0, SAVE_AT)
        autopar.save_checkpoint(pm, optimizer, Path(root) / name, step=SAVE_AT)
        out[name] = {"losses": losses, "optimizer": _optimizer_state(pm, optimizer),
                     "degrees": pm.plan.to_dict()["degrees"]}
    return out


def _resume_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Plan B of every scenario, built from another seed: load, train SAVE_AT..STEPS; then the control
    and the unsharded file."""
    out = {name: _resume(root, name, plan_b, OPTIMIZERS[opt], load_optimizer=True)
           for name, (_, plan_b, opt) in SCENARIOS.items()}
    out["control"] = _resume(root, CONTROL, SCENARIOS[CONTROL][1], OPTIMIZERS[SCENARIOS[CONTROL][2]],
                             load_optimizer=False)
    pm, _ = _module(FULL_FILE_INTO, seed=2)
    autopar.load_full_state_dict(pm, Path(root) / "weights.pt")
    out["full file into another plan"] = pm.full_state_dict()
    tied, _ = _module({"pp": 2, "microbatches": 2}, seed=0, overrides=TIED)  # each stage holds the tied weight
    autopar.save_full_state_dict(tied, Path(root) / "tied.pt")
    return out


def _resume(root: str, name: str, plan_b: dict, make_optimizer: Any, load_optimizer: bool) -> dict[str, Any]:
    pm, bundle = _module(plan_b, seed=1)
    optimizer = make_optimizer(pm.parameters())
    if load_optimizer:  # the checkpoint's learning rate must replace this one
        optimizer.param_groups[0]["lr"] *= 7
    step = autopar.load_checkpoint(pm, optimizer if load_optimizer else None, Path(root) / name)
    loaded = _optimizer_state(pm, optimizer) if load_optimizer else {}
    losses = _train(pm, optimizer, bundle, step, STEPS)
    if name == FULL_FILE_FROM and load_optimizer:
        autopar.save_full_state_dict(pm, Path(root) / "weights.pt")
    return {"step": step, "losses": losses, "optimizer": loaded, "params": pm.full_state_dict(),
            "degrees": pm.plan.to_dict()["degrees"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    root = tmp_path_factory.mktemp("checkpoints")
    saved = run_on_ranks(_save_rank, 4, str(root))[0]
    resumed = run_on_ranks(_resume_rank, 2, str(root))[0]
    return root, saved, resumed


@functools.lru_cache(maxsize=None)
def _single(opt_name: str):
    return train_single(MODEL, None, BATCH, None, STEPS, seed=0, optimizer=OPTIMIZERS[opt_name])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_checkpoint_loads_under_another_plan_and_training_continues(runs, name):
    _, saved, resumed = runs
    plan_a, plan_b, opt_name = SCENARIOS[name]
    before, after = saved[name], resumed[name]
    for plan, run in ((plan_a, before), (plan_b, after)):  # the plans ran as pinned
        assert all(run["degrees"][k] == v for k, v in plan.items() if k in ("dp", "tp", "pp")), run["degrees"]
    single = _single(opt_name)
    assert after["step"] == SAVE_AT
    assert before["losses"] + after["losses"] == pytest.approx(single.losses, rel=LOSS_RTOL)
    assert after["optimizer"].keys() == before["optimizer"].keys() and before["optimizer"]
    for key, value in before["optimizer"].items():
        assert torch.equal(after["optimizer"][key], value), key
    if opt_name != "adamw":  # Adam's normalization lets rounding move parameters by ~lr (test_examples.py)
        assert max_abs_diff(after["params"], single.params) <= PARAM_ATOL


def test_resuming_without_the_optimizer_state_does_not_continue(runs):
    _, _, resumed = runs
    single = _single(SCENARIOS[CONTROL][2])
    assert max_abs_diff(resumed["control"]["params"], single.params) > 100 * PARAM_ATOL


def test_the_unsharded_file_loads_into_a_plain_module_and_another_plan(runs):
    root, _, resumed = runs
    expected = resumed[FULL_FILE_FROM]["params"]
    model = build(MODEL, None, BATCH, None, seed=3).model
    model.load_state_dict(torch.load(root / "weights.pt"))  # strict: every key, none extra
    assert max_abs_diff({k: p.detach() for k, p in model.named_parameters()}, expected) == 0
    assert max_abs_diff(resumed["full file into another plan"], expected) == 0


def test_a_tied_models_unsharded_file_loads_under_every_name(runs):
    root, _, _ = runs
    expected = build(MODEL, TIED, BATCH, None, seed=0).model.state_dict()
    model = build(MODEL, TIED, BATCH, None, seed=3).model
    model.load_state_dict(torch.load(root / "tied.pt"))  # strict: the tied weight under both its names
    assert max_abs_diff(model.state_dict(), expected) == 0


def test_a_cut_short_or_foreign_checkpoint_is_refused(tmp_path):
    with pytest.raises(BadInputError, match="not a checkpoint"):
        autopar.load_checkpoint(None, None, tmp_path)  # no .metadata: the save did not finish
    assert autopar.latest_checkpoint(tmp_path) is None
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "step-00000002" / ".metadata").write_bytes(b"")
    assert autopar.latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    (tmp_path / "weights.pt").write_text("not torch")
    with pytest.raises(BadInputError, match="not a torch.save file"):
        autopar.load_full_state_dict(None, tmp_path / "weights.pt")


@pytest.mark.parametrize("zip_format", [True, False])
def test_a_weights_file_loads_memory_mapped_or_in_torchs_legacy_format(tmp_path, zip_format):
    """``load_full_state_dict`` maps the file (each rank reads its shards' pages only); a legacy-format file, which
    cannot be mapped, is read whole. Any module with ``load_state_dict`` takes it, a plain one here."""
    source = torch.nn.Linear(3, 2)
    torch.save(source.state_dict(), tmp_path / "weights.pt", _use_new_zipfile_serialization=zip_format)
    target = torch.nn.Linear(3, 2)
    autopar.load_full_state_dict(target, tmp_path / "weights.pt")
    assert max_abs_diff(target.state_dict(), source.state_dict()) == 0


def test_a_weights_directory_or_safetensors_file_that_is_not_one_is_refused(tmp_path):
    with pytest.raises(BadInputError, match="no model.safetensors.index.json or model.safetensors"):
        autopar.load_full_state_dict(None, tmp_path)
    (tmp_path / "model.safetensors").write_text("not safetensors")
    with pytest.raises(BadInputError, match="not a safetensors file"):
        autopar.load_full_state_dict(None, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(BadInputError, match="not a safetensors index"):
        autopar.load_full_state_dict(None, tmp_path)


def test_a_safetensors_file_loads_into_a_plain_module(tmp_path):
    from safetensors.torch import save_file

    source = torch.nn.Linear(3, 2)
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    target = torch.nn.Linear(3, 2)
    autopar.load_full_state_dict(target, tmp_path / "w.safetensors")
    assert max_abs_diff(target.state_dict(), source.state_dict()) == 0


def test_keys_are_read_under_the_one_prefix_that_makes_every_key_a_models_name():
    from autopar.runtime.checkpoint import with_model_prefix

    t = torch.zeros(1)
    wrapped = {"hf.model.w": (), "hf.model.b": (), "hf.lm_head.w": ()}
    assert set(with_model_prefix({"model.w": t, "model.b": t}, wrapped)) == {"hf.model.w", "hf.model.b"}
    bare = {"model.w": (), "model.b": ()}
    assert set(with_model_prefix({"hf.model.w": t, "hf.model.b": t}, bare)) == {"model.w", "model.b"}
    mixed = {"model.w": t, "other.b": t}  # no one prefix names both: left as given, for the strict check to report
    assert with_model_prefix(mixed, wrapped) is mixed


def test_the_full_state_dict_holds_copies_that_the_next_optimizer_step_leaves_alone(two_fake_ranks) -> None:
    """Under data parallelism every parameter is replicated, so its ``full_tensor`` is its own storage: the
    full state dict copies it, as it gathers a sharded one (FSDP x TP's parity run caught an AdamW step
    taken after the dict was made moving its norm weights)."""
    bundle = build("mlp", None, 8, None, seed=0)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints={"dp": 2})
    full = pm.full_state_dict()
    before = {fqn: t.clone() for fqn, t in full.items()}
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(1.0)
    assert full.keys() == before.keys() and all(torch.equal(full[fqn], before[fqn]) for fqn in full)
