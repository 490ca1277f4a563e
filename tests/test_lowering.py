"""The lowered runtime (``autoparallelize(..., lowered=True)``, ``passes/lower.py``) on gloo: the rank's
forward and backward run as graphs of local tensor ops with explicit functional collectives.

Numerical parity (docs/architecture.md "Correctness"): 3 SGD steps of the lowered program on 2 ranks
(data parallelism, FSDP, FSDP with selective checkpointing, tensor parallelism, tensor + sequence
parallelism, ZeRO-2 with gradient accumulation) and on 4 ranks (FSDP, dp x tp) match single-process
training: gradients, losses and final parameters. Collective parity: the collectives in the lowered
graphs are the ones that run (counted by ``CollectiveCounter``), the forward graph's are the plan's
forward prediction exactly, and the whole step's (graphs plus the gradient sync outside them) are the
plan's prediction kind by kind, up to the gap ``tests/test_collective_parity.py`` explains for the
DTensor runtime, which the lowering inherits (it traces that program). All runs of one world share one
spawn of ranks (``_lowered_runs``), as ``tests/test_parity.py`` does.

The heavy tier compiles the lowered program with inductor (``compile=True``) and checks both parities
again; a program that cannot be traced runs unlowered with one warning.
"""

from __future__ import annotations

from typing import Any, Mapping

import pytest
import torch

from autopar.inspect.collectives import predicted_collectives
from autopar.passes.lower import COLLECTIVE_KINDS
from autopar.testing.parity import AutoparResult, train_single
from test_collective_parity import BACKWARD_GAPS, as_run_on_gloo

DISTRIBUTED = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3
BATCH = 8
CONFIGS = {2: [("tiny-gpt", {"dp": 2}), ("tiny-gpt", {"dp": 2, "fsdp": 3}), ("tiny-gpt", {"tp": 2}),
               ("tiny-gpt", {"tp": 2, "sp": 1}), ("tiny-gpt", {"dp": 2, "fsdp": 3, "checkpointing": "selective"}),
               ("tiny-llama", {"dp": 2, "fsdp": 2, "microbatches": 2})],
           4: [("tiny-gpt", {"dp": 4, "fsdp": 3}), ("tiny-llama", {"dp": 2, "tp": 2})]}
STEP_GAPS: dict[str, dict[str, int]] = {
    "tiny-gpt {'dp': 2}": BACKWARD_GAPS["tiny-gpt"],
}
"""A step's collectives, counted minus predicted, per kind, where they differ: data parallelism's lazy
reduction of the position embedding's gradient (``tests/test_collective_parity.py``)."""
NOT_EXACT = {"tiny-llama {'dp': 2, 'tp': 2}", "tiny-llama {'dp': 2, 'fsdp': 2, 'microbatches': 2}"}
"""Configurations checked for numerical parity only: a 2-D mesh, whose backward the plan does not predict
exactly on the DTensor runtime either (DTensor's norm backward, ``tests/test_collective_parity.py``),
and gradient accumulation (collective parity counts one microbatch's forward)."""


def _lowered_runs(rank: int, world: int, configs: list[tuple[str, dict]], compile: bool) -> list[dict[str, Any]]:
    return [_lowered_run(rank, name, constraints, compile) for name, constraints in configs]


def _lowered_run(rank: int, name: str, constraints: dict, compile: bool) -> dict[str, Any]:
    """Train the lowered (``compile``: and compiled) program ``STEPS`` steps (``train_module``), then
    count one forward's and one step's collectives and read the lowered graphs'."""
    import autopar
    from autopar.testing.counters import CollectiveCounter
    from autopar.testing.parity import batches, build, train_module

    bundle = build(name, None, BATCH, None, seed=0)
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints=constraints, lowered=True,
                                 compile=compile)
    result = train_module(pm, bundle, STEPS, 0, rank)
    (batch,) = batches(bundle, 1, seed=0)
    with CollectiveCounter() as forward:
        if pm.microbatches == 1:  # a forward pass takes one microbatch
            pm(*batch)
    for p in pm.parameters():  # a step onto held gradients would add partial ones to them, one all_reduce each
        p.grad = None
    with CollectiveCounter() as step:
        pm.step(*batch)
    return {**result, "forward": forward.counts, "step": step.counts, "graphs": pm.program.collectives(),
            "fallback": pm.program.fallback}


def _spawned(world: int, configs: list[tuple[str, dict]], compile: bool = False) -> list[dict[str, Any]]:
    from autopar.testing.launch import run_on_ranks

    per_rank = run_on_ranks(_lowered_runs, world, configs, compile, timeout_s=900)
    return [{**per_rank[0][i], "ranks": [r[i] for r in per_rank]} for i in range(len(configs))]


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict[str, Any]]]:
    """Per world, per configuration: rank 0's run (and every rank's, under ``ranks``)."""
    return {world: _spawned(world, configs) for world, configs in CONFIGS.items()}


def _cases(exact_only: bool = False) -> list[Any]:
    return [pytest.param(world, i, id=f"{name}-{c}-w{world}", marks=DISTRIBUTED) for world, configs in CONFIGS.items()
            for i, (name, c) in enumerate(configs) if not (exact_only and f"{name} {c}" in NOT_EXACT)]


def _minus(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) - b.get(k, 0) for k in sorted(set(a) | set(b)) if a.get(k, 0) != b.get(k, 0)}


def _plus(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b)) if a.get(k, 0) + b.get(k, 0)}


@pytest.mark.parametrize("world, index", _cases())
def test_lowered_program_matches_single_process(runs, world: int, index: int) -> None:
    run = runs[world][index]
    name, _ = CONFIGS[world][index]
    assert run["fallback"] is None, f"the program was not lowered: {run['fallback']}"
    AutoparResult.from_ranks(run["ranks"]).assert_matches(train_single(name, None, BATCH, None, STEPS))


@pytest.mark.parametrize("world, index", _cases(exact_only=True))
def test_lowered_graphs_run_the_predicted_collectives(runs, world: int, index: int) -> None:
    name, constraints = CONFIGS[world][index]
    _assert_predicted_collectives(runs[world][index], f"{name} {constraints}")


@pytest.mark.heavy
@pytest.mark.dist
@pytest.mark.slow
def test_compiled_program_matches_single_process_and_keeps_the_collectives() -> None:
    """Inductor compiles the lowered graphs (a minute or two of C++ compilation per rank on 2 cores):
    the same numbers within parity's tolerances, the same collectives (inductor's in-place
    ``all_reduce_`` counted as ``all_reduce``)."""
    name, constraints = "tiny-gpt", {"tp": 2}
    (run,) = _spawned(2, [(name, constraints)], compile=True)
    assert run["fallback"] is None, f"the program was not compiled: {run['fallback']}"
    AutoparResult.from_ranks(run["ranks"]).assert_matches(train_single(name, None, BATCH, None, STEPS))
    run["forward"] = _as_plan_kinds(run["forward"])
    run["step"] = _as_plan_kinds(run["step"])
    _assert_predicted_collectives(run, f"{name} {constraints}")


def _as_plan_kinds(counts: Mapping[str, int]) -> dict[str, int]:
    """``CollectiveCounter``'s counts with inductor's in-place collectives under their plan kinds."""
    out: dict[str, int] = {}
    for kind, n in counts.items():
        out[COLLECTIVE_KINDS.get(kind, kind)] = out.get(COLLECTIVE_KINDS.get(kind, kind), 0) + n
    return out


def _assert_predicted_collectives(run: Mapping[str, Any], config: str) -> None:
    graphs, plan = run["graphs"], run["plan"]
    assert run["forward"] == graphs["forward"], "the forward ran other collectives than its graph holds"
    assert graphs["forward"] == as_run_on_gloo(predicted_collectives(plan, ["forward"]))
    sync = _minus(run["step"], _plus(graphs["forward"], graphs["backward"]))
    assert set(sync) <= {"all_reduce"} and all(v > 0 for v in sync.values()), (
        f"outside the graphs a step may only all-reduce gradients; it ran {sync}")
    predicted = as_run_on_gloo(predicted_collectives(plan))
    assert _minus(run["step"], predicted) == STEP_GAPS.get(config, {}), (run["step"], predicted)


class _DataDependent(torch.nn.Module):
    """A program AOT autograd cannot trace: its branch depends on a value."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return ((x * 2).sum() if x.sum() > 0 else x.sum(),)


def test_a_program_that_cannot_be_traced_runs_unlowered_with_one_warning() -> None:
    from autopar.passes.lower import LoweredProgram

    program = LoweredProgram(_DataDependent(), parameter_positions=[])
    x = torch.ones(3, requires_grad=True)
    with pytest.warns(UserWarning, match="could not be lowered") as warned:
        (first,) = program(x)
        (second,) = program(x)
    assert len([w for w in warned if "could not be lowered" in str(w.message)]) == 1
    assert program.fallback and first.item() == second.item() == 6.0
