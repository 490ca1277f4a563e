"""An op with no DTensor strategy: planned replicated with one warning naming it, and still exact."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import autopar
from autopar.models import build_model
from autopar.testing.parity import train_parallel, train_single

sys.path.insert(0, str(Path(__file__).parent))
SPEC = "custom_op_model:make"


def test_unknown_op_runs_replicated_with_one_warning() -> None:
    bundle = build_model(SPEC, global_batch=8, device="meta")
    with pytest.warns(UserWarning, match="autopar_test.soft_clip") as record:
        plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, {"dp": 2},
                            example_targets=bundle.example_targets)
    assert sum("soft_clip" in str(w.message) for w in record) == 1
    (entry,) = [op for op in plan.ops.values() if "soft_clip" in op["op"]]
    assert entry["local"] and entry["inputs"] == [["R"]] and entry["outputs"] == [["R"]]


@pytest.mark.dist
@pytest.mark.slow
def test_unknown_op_trains_like_single_process() -> None:
    reference = train_single(SPEC, None, 8, None, 3)
    train_parallel(2, SPEC, None, 8, None, 3, constraints={"dp": 2}).assert_matches(reference)
