"""A step that writes its buffers (BatchNorm's running statistics, a step counter): captured as ``write_buffer`` ops,
planned replicated, and written on every runtime as one process writes them (``autopar/ir/buffer_writes.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import autopar
from autopar import BadInputError, UnsupportedModelError
from autopar.ir.buffer_writes import refuse_evaluation_that_writes
from autopar.ir.capture import capture
from autopar.models import build_model
from autopar.passes.program import copy_graph
from autopar.passes.split_stages import split_program
from autopar.testing.parity import ParityResult, train_parallel_many, train_single

SPEC = "edge_models:batch_normed_convs"


def test_written_buffers_are_planned_replicated_and_their_writes_run_whole() -> None:
    bundle = build_model(SPEC, global_batch=8, device="meta")
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, {"tp": 2},
                        example_targets=bundle.example_targets)
    written = {"steps", *(f"blocks.{i}.bn{j}.{stat}" for i in range(4) for j in (1, 2)
                          for stat in ("running_mean", "running_var", "num_batches_tracked"))}
    assert written <= set(plan.buffers) and all(plan.buffers[name] == ["R"] for name in written)
    writes = [op for op in plan.ops.values() if op["op"] == "autopar.write_buffer.default"]
    assert sum(op.get("count", 1) for op in writes) == len(written)  # a traced layer's stand for the others'
    assert all(op["inputs"] == [["R"]] and op.get("local") for op in writes)


class _WritesItsParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.bias.mul_(0.5)
        return self.fc(x).pow(2).mean()


def test_a_step_writing_its_parameters_is_refused_naming_them() -> None:
    with pytest.raises(UnsupportedModelError, match=r"writes into tensors in place \(parameter fc.bias\)"):
        autopar.plan(_WritesItsParameter(), torch.randn(8, 4), "1x2xcpu")


def test_a_buffer_written_in_one_pipeline_chunk_and_read_in_another_is_refused() -> None:
    bundle = build_model("edge_models:counted_blocks", global_batch=8)
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    program = fx.GraphModule(captured.graph_module, copy_graph(captured.graph))
    with pytest.raises(BadInputError, match="buffer steps is written in pipeline chunk 0 and read in chunk 1"):
        split_program(program, [[0, 2], [2, 4]], captured.params, captured.user_inputs, captured.buffers)
    split_program(program, [[0, 4]], captured.params, captured.user_inputs, captured.buffers)  # one chunk: fine


def test_a_module_in_eval_mode_whose_step_writes_buffers_is_refused() -> None:
    refuse_evaluation_that_writes(True, {"bn.running_mean"}, "step()")
    refuse_evaluation_that_writes(False, set(), "step()")
    with pytest.raises(BadInputError, match=r"forward\(\) of a module in eval mode.*\(bn.running_mean: BatchNorm"):
        refuse_evaluation_that_writes(False, {"bn.running_mean"}, "forward()")


def test_parity_compares_the_final_buffers() -> None:
    exact = train_single(SPEC, None, 8, None, steps=1)
    assert exact.buffers["steps"] == 1 and exact.buffers["blocks.0.bn1.num_batches_tracked"] == 1
    ParityResult([exact.losses], exact.grads, exact.params, exact.buffers).assert_matches(exact)
    stale = {**exact.buffers, "blocks.0.bn1.running_mean": torch.zeros(8)}
    with pytest.raises(AssertionError, match="final buffers: 1 of .* off, worst blocks.0.bn1.running_mean"):
        ParityResult([exact.losses], exact.grads, exact.params, stale).assert_matches(exact)


RUNS = [(SPEC, {"dp": 2}, 1), (SPEC, {"tp": 2}, 1), (SPEC, {"dp": 2, "fsdp": 3}, 1),
        (SPEC, {"dp": 2, "checkpointing": "full"}, 1), (SPEC, {"dp": 2, "microbatches": 2}, 2),
        (SPEC, {"pp": 2, "microbatches": 2, "schedule": "1f1b"}, 2),
        ("edge_models:written_unread", {"pp": 2, "microbatches": 2, "schedule": "1f1b"}, 2),
        ("edge_models:spectral_normed", {"tp": 2}, 1)]


@pytest.mark.dist
@pytest.mark.parametrize("lowered", [False, True], ids=["dtensor", "lowered"])
def test_running_statistics_and_counters_are_written_as_one_process_writes_them(lowered: bool) -> None:
    """Gradients, losses, final parameters and final buffers against one process: BatchNorm's batch statistics
    over the whole microbatch, its running ones updated once a forward, microbatches in order (the reference
    accumulates their gradients as eager PyTorch does), in a pipeline stage too; recomputation writes nothing
    twice; a buffer written but not read is held by the stage that writes it; spectral normalization's power
    iteration writes its vectors. Lowered, the writes leave the graphs
    as outputs (``passes/lower_writes.py``) and nothing falls back."""
    references = {(spec, m): train_single(spec, None, 8, None, steps=3, microbatches=m) for spec, _, m in RUNS}
    runs = [dict(name=spec, overrides=None, global_batch=8, seq=None, steps=3, plan=None, constraints=constraints,
                 lowered=lowered) for spec, constraints, _ in RUNS]
    for (spec, constraints, m), result in zip(RUNS, train_parallel_many(2, runs)):
        assert result.buffers.keys() == references[spec, m].buffers.keys(), constraints
        result.assert_matches(references[spec, m], f"{spec} under {constraints}")
        assert not lowered or (result.lowered["programs"] >= 1 and not result.lowered["fallbacks"]), result.lowered
