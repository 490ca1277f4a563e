"""A training loop's ``torch.autocast`` around autopar's step: the program runs in the plan's precision with
autocast set aside, and says so once (``runtime/autocast.py``); under autocast its captured aten ops took
autocast's per-op casts unlike eager code (the loss's log-softmax in bf16: tiny-gpt's losses came out as bf16
numbers). Called under the same autocast, ``autoparallelize`` captures autocast's casts into the program,
which then trains as eager autocast does."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import autopar
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import BF16, AutoparResult, build, train_module, train_single

RUNS = [  # constraints, lowered, autoparallelize called under autocast too
    ({"dp": 2}, True, False),
    ({"pp": 2}, False, False),
    ({"tp": 2}, True, True),
]


def _bf16_autocast() -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _trained_with_steps_under_autocast(rank: int, world: int) -> list[dict[str, Any]]:
    """Each run of ``RUNS``: tiny-gpt trained 3 SGD steps, each ``step`` under CPU autocast in bf16, with the
    warnings that name autocast."""
    results = []
    for constraints, lowered, built_under in RUNS:
        bundle = build("tiny-gpt", None, 4, 16, 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=built_under):
                pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                             example_targets=bundle.example_targets, constraints=constraints,
                                             lowered=lowered)
            pm.step = _under_autocast(pm.step)
            result = train_module(pm, bundle, 3, 0, rank)
        result["warned"] = [str(w.message) for w in caught if "autocast" in str(w.message)]
        results.append(result)
    return results


def _under_autocast(step: Any) -> Any:
    def stepped(*args: torch.Tensor) -> torch.Tensor:
        with _bf16_autocast():
            return step(*args)
    return stepped


@pytest.mark.dist
def test_steps_under_autocast_run_in_the_plans_precision_or_as_eager_autocast_when_captured_under_it() -> None:
    per_rank = run_on_ranks(_trained_with_steps_under_autocast, 2)
    fp32 = train_single("tiny-gpt", None, 4, 16, 3)
    eager_autocast = train_single("tiny-gpt", None, 4, 16, 3, autocast=torch.bfloat16)
    for i, (constraints, _, built_under) in enumerate(RUNS):
        result = AutoparResult.from_ranks([ranks[i] for ranks in per_rank])
        warned = per_rank[0][i]["warned"]
        if built_under:
            assert result.mismatches(eager_autocast, BF16) == [], constraints
            assert result.losses[0] != fp32.losses  # autocast's casts ran: its losses are not fp32's
            assert warned == []
        else:
            result.assert_matches(fp32, f"tiny-gpt under {constraints}, steps under autocast")
            assert len(warned) == 1 and "dtype='bf16'" in warned[0], warned  # once, saying what to do
