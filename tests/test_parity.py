"""Numerical parity on gloo (docs/architecture.md "Correctness"): k SGD steps under a plan == single-process training.

Each multi-process test spawns W gloo ranks once and trains several configurations in that one process
group: the solver's own plan for the world, a plan forced to data parallelism, one forced to tensor
parallelism, and (world 4) a 2x2 hybrid; tiny-llama under TP, 2x2, FSDP and gradient accumulation;
HSDP. Each must match the single-process run with the same seed and global batches
(``ParityResult.assert_matches``): every gathered gradient after the first backward (rtol 1e-4, atol
1e-5, at least 1e-6 of the tensor's largest entry), per-step losses on every rank (rtol 1e-4), gathered
final parameters (atol 1e-5).

And the check itself can fail: a gradient sync that scales every gradient by 1.25 fails it, naming the
gradients, and the SGD learning rate turns such an error into a parameter error far above the tolerance.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from autopar.testing.parity import (LR, PARAM_ATOL, AutoparResult, ParityResult, TrainResult, max_abs_diff,
                                    train_parallel_many, train_single)

STEPS = 3
BATCH = 8
SCALE_ERROR = 1.25
"""The gradient error the check must catch: every gradient 1.25x its value (Adam's update hides it)."""
SCALE_ERROR_MARGIN = 50
"""How many times ``PARAM_ATOL`` that error must move some parameter in ``STEPS`` SGD steps at ``LR``."""


def _runs(name: str, constraint_sets: list[dict | None], **extra) -> list[dict]:
    return [dict(name=name, overrides=None, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                 constraints=c, **extra) for c in constraint_sets]


def _degrees(result: AutoparResult) -> dict:
    return result.plan["degrees"]


@contextmanager
def scaled_gradient_sync() -> Iterator[None]:
    """Every gradient the data-parallel gradient sync hands back, multiplied by ``SCALE_ERROR`` (what a
    wrong averaging factor would do). Entered on each spawned rank around one run (``under``), so the
    library's code is patched only there and only for that run."""
    from autopar.passes import GradientSync

    synchronize = GradientSync.__call__

    def scaled(self: GradientSync) -> None:
        synchronize(self)
        for p in self.params:
            if p.grad is not None:
                p.grad = p.grad * SCALE_ERROR

    GradientSync.__call__ = scaled
    try:
        yield
    finally:
        GradientSync.__call__ = synchronize


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
@pytest.mark.parametrize("name", [pytest.param("mlp", marks=pytest.mark.heavy), "tiny-gpt"])
def test_solver_dp_and_tp_plans_match_single_process(name: str, world: int) -> None:
    constraint_sets = [None, {"dp": world}, {"tp": world}] + ([{"dp": 2, "tp": 2}] if world == 4 else [])
    results = train_parallel_many(world, _runs(name, constraint_sets))
    reference = train_single(name, None, BATCH, None, STEPS)
    for result in results:
        result.assert_matches(reference)
    assert _degrees(results[1])["dp"] == world and _degrees(results[1])["tp"] == 1
    assert _degrees(results[2])["tp"] == world
    tp_placements = results[2].plan["placements"]
    assert any(p != ["R"] for p in tp_placements.values()), "a tp plan must shard some weights"


LLAMA_RUNS = [{"tp": 4}, {"dp": 2, "tp": 2}, {"dp": 4, "fsdp": 3}, {"dp": 2, "tp": 2, "microbatches": 2}]


@pytest.fixture(scope="module")
def llama_on_4_ranks() -> list[AutoparResult]:
    """One spawn of 4 ranks: tiny-llama under each of ``LLAMA_RUNS``, then under 2x2 with every
    gradient the sync hands back scaled by ``SCALE_ERROR``."""
    runs = _runs("tiny-llama", LLAMA_RUNS) + _runs("tiny-llama", [{"dp": 2, "tp": 2}], under=scaled_gradient_sync)
    return train_parallel_many(4, runs)


@pytest.fixture(scope="module")
def llama_single() -> TrainResult:
    return train_single("tiny-llama", None, BATCH, None, STEPS)


@pytest.mark.dist
@pytest.mark.slow
def test_llama_fsdp_and_microbatches_match_single_process(llama_on_4_ranks, llama_single) -> None:
    """Llama (RMSNorm, SwiGLU, rotary, GQA) under TP and 2x2; FSDP (dp-sharded parameters); gradient
    accumulation."""
    for result in llama_on_4_ranks[:len(LLAMA_RUNS)]:
        result.assert_matches(llama_single)
    assert _degrees(llama_on_4_ranks[2])["fsdp"] == 4
    assert llama_on_4_ranks[3].plan["pipeline"]["microbatches"] == 2


@pytest.mark.dist
@pytest.mark.slow
def test_a_gradient_sync_off_by_a_constant_factor_fails_the_check(llama_on_4_ranks, llama_single) -> None:
    scaled = llama_on_4_ranks[len(LLAMA_RUNS)]
    with pytest.raises(AssertionError, match=r"gradients after the first backward: \d+ of \d+ off, worst") as failure:
        scaled.assert_matches(llama_single)
    assert "final parameters: " in str(failure.value)


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_hsdp_matches_single_process() -> None:
    """HSDP: parameters sharded within groups of 2 ranks and replicated across the 2 groups."""
    runs = _runs("tiny-gpt", [{"dp": 4, "dp_shard": 2}]) + _runs("tiny-llama", [{"dp": 4, "dp_shard": 2}])
    results = train_parallel_many(4, runs)
    for name, result in zip(("tiny-gpt", "tiny-llama"), results):
        plan = result.plan
        assert plan["mesh"] == {"shape": [2, 2], "dim_names": ["dp_replicate", "dp"]}
        assert _degrees(result)["fsdp"] == 2 and _degrees(result)["dp"] == 4
        assert all(p[0] == "R" for p in plan["placements"].values())  # replicated across groups
        assert any(p[1].startswith("S(") for p in plan["placements"].values())  # sharded within one
        result.assert_matches(train_single(name, None, BATCH, None, STEPS))


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_grouped_query_llama_under_tp_with_one_sample_microbatches_matches_single_process() -> None:
    """Llama with 8 query and 4 key-value heads at tp=2, one sample a microbatch: its norms cannot split the
    batch over tp, and a plan splitting their hidden dim left the mean ``P(avg)``, whose backward DTensor
    refuses (``roles._no_average_partials_on``)."""
    overrides = {"layers": 2, "hidden": 128, "heads": 8, "kv_heads": 4, "ffn_hidden": 256, "vocab": 1024, "seq": 64}
    constraints = {"tp": 2, "sp": 0, "checkpointing": "none", "microbatches": BATCH}
    (result,) = train_parallel_many(2, [dict(name="tiny-llama", overrides=overrides, global_batch=BATCH, seq=None,
                                             steps=STEPS, plan=None, constraints=constraints)])
    assert result.plan["pipeline"]["microbatches"] == BATCH
    result.assert_matches(train_single("tiny-llama", overrides, BATCH, None, STEPS))


# ---- the check, in one process --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp", "tiny-gpt", "tiny-llama"])
def test_the_learning_rate_turns_a_scaled_gradient_into_a_parameter_error(name: str) -> None:
    """Plain SGD's update is ``lr * g``, so gradients ``SCALE_ERROR`` x too large at ``LR`` update exactly
    as true ones at ``SCALE_ERROR * LR``: after ``STEPS`` steps some parameter is off by more than
    ``SCALE_ERROR_MARGIN`` x ``PARAM_ATOL``, and the check reports the final parameters."""
    exact = train_single(name, None, BATCH, None, STEPS)
    scaled = train_single(name, None, BATCH, None, STEPS,
                          optimizer=functools.partial(torch.optim.SGD, lr=SCALE_ERROR * LR))
    assert max_abs_diff(scaled.params, exact.params) > SCALE_ERROR_MARGIN * PARAM_ATOL
    with pytest.raises(AssertionError, match=r"final parameters: \d+ of \d+ off, worst"):
        ParityResult([exact.losses], exact.grads, scaled.params).assert_matches(exact)


def test_the_check_names_the_worst_gradient_and_its_error() -> None:
    exact = train_single("mlp", None, BATCH, None, 1)
    ParityResult([exact.losses, exact.losses], exact.grads, exact.params).assert_matches(exact)
    grads = dict(exact.grads)
    grads["layers.1.weight"] = grads["layers.1.weight"] * SCALE_ERROR
    wrong = ParityResult([exact.losses, [exact.losses[0] * 1.001]], grads, exact.params)
    with pytest.raises(AssertionError) as failure:
        wrong.assert_matches(exact)
    message = str(failure.value)
    assert "gradients after the first backward: 1 of 6 off, worst layers.1.weight[" in message
    assert "per-step losses: 1 of 2 off, worst rank 1 step 0: " in message
    assert "final parameters" not in message


def test_an_fp32_gradient_entry_is_held_to_the_scale_of_its_tensors_largest() -> None:
    """An entry near zero in a gradient reaching 100 may be off by the rounding of the sums at that scale (a
    millionth of it), however small itself; a tensor 1.25x too large still fails."""
    expected = TrainResult([1.0], {"w": torch.tensor([100.0, 0.0128])}, {"w": torch.zeros(2)})
    rounded = ParityResult([[1.0]], {"w": torch.tensor([100.0, 0.0128 + 1.5e-5])}, {"w": torch.zeros(2)})
    assert rounded.mismatches(expected) == []
    scaled = ParityResult([[1.0]], {"w": torch.tensor([125.0, 0.016])}, {"w": torch.zeros(2)})
    assert scaled.mismatches(expected)[0].startswith("gradients after the first backward: 1 of 1 off")


def _gathered_gradient_storage(rank: int, world: int) -> tuple[int, int, list[tuple[int, int]]]:
    """(bytes of this rank's gradients, bytes of the storages they view, (storage, tensor) bytes of each
    gathered gradient) after one data-parallel step."""
    from torch.distributed.tensor import DTensor

    import autopar
    from autopar.testing.parity import gathered_grads

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(6)))
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pm = autopar.autoparallelize(model, (x,), torch.nn.functional.mse_loss, cluster="1x2xcpu",
                                 constraints={"dp": 2}, example_targets=y)
    pm.step(x, y)
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in pm.parameters()]
    found = gathered_grads(pm)
    return (sum(g.nbytes for g in local), sum(g.untyped_storage().nbytes() for g in local),
            [(g.untyped_storage().nbytes(), g.nbytes) for g in found.values()])


@pytest.mark.dist
def test_gathered_gradients_are_sent_without_the_buckets_they_view() -> None:
    """Gradients are views of their sync buckets; ``gathered`` copies each into storage of its own before it
    pickles it, else every gradient carried its whole bucket (a 12-layer Hugging Face model ran a rank out of
    memory gathering 26 MB of gradients)."""
    from autopar.testing.launch import run_on_ranks

    held, viewed, gathered = run_on_ranks(_gathered_gradient_storage, 2)[0]
    assert viewed > 2 * held  # the case: each gradient views a bucket larger than itself
    assert len(gathered) == 12 and all(storage == nbytes for storage, nbytes in gathered)
