"""Numerical parity on gloo (docs/architecture.md "Correctness"): k steps under a plan == single-process training.

Each test spawns W gloo ranks once and trains several configurations in that one process group: the
solver's own plan for the world, a plan forced to data parallelism, one forced to tensor parallelism,
and (world 4) a 2x2 hybrid. Per-step loss within rtol 1e-4 on every rank, gathered final parameters
within atol 1e-5 of the single-process run with the same seed and global batches.
"""

from __future__ import annotations

import pytest
import torch

from autopar.testing.parity import max_param_diff, train_parallel_many, train_single

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3
BATCH = 8


def _check(reference, result) -> None:
    for rank_losses in result["losses"]:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(reference.losses), rtol=1e-4, atol=0)
    assert max_param_diff(reference.params, result["params"]) < 1e-5


def _runs(name: str, constraint_sets: list[dict | None], optimizer: str = "adamw") -> list[dict]:
    return [dict(name=name, overrides=None, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                 constraints=c, optimizer=optimizer) for c in constraint_sets]


def _degrees(result) -> dict:
    return result["plan"]["degrees"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", [pytest.param("mlp", marks=pytest.mark.heavy), "tiny-gpt"])
def test_solver_dp_and_tp_plans_match_single_process(name: str, world: int) -> None:
    constraint_sets = [None, {"dp": world}, {"tp": world}] + ([{"dp": 2, "tp": 2}] if world == 4 else [])
    results = train_parallel_many(world, _runs(name, constraint_sets))
    reference = train_single(name, None, BATCH, None, STEPS)
    for result in results:
        _check(reference, result)
    assert _degrees(results[1])["dp"] == world and _degrees(results[1])["tp"] == 1
    assert _degrees(results[2])["tp"] == world
    tp_placements = results[2]["plan"]["placements"]
    assert any(p != ["R"] for p in tp_placements.values()), "a tp plan must shard some weights"


def test_llama_fsdp_microbatches_and_sgd_match_single_process() -> None:
    """Llama (RMSNorm, SwiGLU, rotary, GQA) under TP and 2x2; FSDP (dp-sharded parameters); gradient
    accumulation; and SGD, whose update is proportional to the gradient (catches scale errors)."""
    runs = _runs("tiny-llama", [{"tp": 4}, {"dp": 2, "tp": 2}, {"dp": 4, "fsdp": 3}, {"dp": 2, "tp": 2, "microbatches": 2}])
    runs += _runs("tiny-gpt", [{"dp": 2, "tp": 2}], optimizer="sgd")
    results = train_parallel_many(4, runs)
    reference = train_single("tiny-llama", None, BATCH, None, STEPS)
    for result in results[:4]:
        _check(reference, result)
    assert _degrees(results[2])["fsdp"] == 4
    assert results[3]["plan"]["pipeline"]["microbatches"] == 2
    _check(train_single("tiny-gpt", None, BATCH, None, STEPS, optimizer="sgd"), results[4])


def test_hsdp_matches_single_process() -> None:
    """HSDP: parameters sharded within groups of 2 ranks and replicated across the 2 groups."""
    runs = _runs("tiny-gpt", [{"dp": 4, "dp_shard": 2}]) + _runs("tiny-llama", [{"dp": 4, "dp_shard": 2}])
    results = train_parallel_many(4, runs)
    for name, result in zip(("tiny-gpt", "tiny-llama"), results):
        plan = result["plan"]
        assert plan["mesh"] == {"shape": [2, 2], "dim_names": ["dp_replicate", "dp"]}
        assert _degrees(result)["fsdp"] == 2 and _degrees(result)["dp"] == 4
        assert all(p[0] == "R" for p in plan["placements"].values())  # replicated across groups
        assert any(p[1].startswith("S(") for p in plan["placements"].values())  # sharded within one
        _check(train_single(name, None, BATCH, None, STEPS), result)
