"""Steps at the edges of what capture accepts: a 0-dim input beside the batch is planned and trained like
single-process training (it holds no batch: every rank reads it whole, as positions ``[seq]`` are); a step
that writes into its inputs is refused naming what it writes (the runtime would leave the written tensors
stale); models at the edges of what the runtimes met train like one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar import UnsupportedModelError
from autopar.testing.parity import train_parallel_many, train_single

SPEC = "scalar_input_model:make"


def test_a_0_dim_input_is_read_whole_and_the_batch_is_the_next_input() -> None:
    from autopar.models import build_model

    bundle = build_model(SPEC, global_batch=8, device="meta")
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, {"dp": 2, "microbatches": 2},
                        example_targets=bundle.example_targets)
    scale, x, targets = plan.inputs.values()
    assert scale["shape"] == [] and scale["placements"] == ["R"]
    assert x["placements"] == targets["placements"] == ["S(0)"]
    assert plan.pipeline.microbatches == 2 and plan.pipeline.microbatch_size == 2  # 8 samples / (2 x dp 2)


@pytest.mark.dist
def test_a_0_dim_input_trains_on_2_ranks_like_one_process() -> None:
    """Under gradient accumulation and in a pipeline, whose schedule cuts the inputs into microbatches itself
    (the second stage reads the scale too)."""
    reference = train_single(SPEC, None, 8, None, steps=3)
    runs = [{"dp": 2, "microbatches": 2}, {"pp": 2, "microbatches": 4, "schedule": "1f1b"}]
    for result in train_parallel_many(2, [dict(name=SPEC, overrides=None, global_batch=8, seq=None, steps=3, plan=None,
                                               constraints=constraints) for constraints in runs]):
        result.assert_matches(reference)


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x).pow(2).mean()


def test_a_step_that_writes_its_input_in_place_is_refused_naming_it() -> None:
    """(Writes into buffers are kept: ``tests/test_buffer_writes.py``.)"""
    with pytest.raises(UnsupportedModelError, match="register_buffer") as info:
        autopar.plan(_WritesItsInput(), torch.randn(8, 4), "1x2xcpu")
    assert "the training step writes into tensors in place (input args_0): " in str(info.value)


def test_batch_statistics_without_running_ones_are_planned() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, track_running_stats=False))
    plan = autopar.plan(model, torch.randn(8, 4), "1x2xcpu", lambda out: out.pow(2).mean())
    assert plan.predicted["step_time_s"] > 0


EDGE_RUNS = [("edge_models:experts", {"dp": 2, "ep": 2}), ("edge_models:grouped_conv", {"dp": 2}),
             ("edge_models:sequential_blocks", {"pp": 2, "microbatches": 2}),
             ("edge_models:positions", {"dp": 2, "microbatches": 2}),
             ("edge_models:positions", {"pp": 2, "microbatches": 4}),
             ("edge_models:gathered_rows", {"dp": 2}), ("edge_models:gathered_rows", {"tp": 2}),
             ("edge_models:gathered_rows", {"dp": 2, "fsdp": 3}),
             ("edge_models:einsum_attention", {"tp": 2}),
             ("edge_models:einsum_attention", {"tp": 2, "checkpointing": "selective"}),
             ("edge_models:reshaped_blocks", {"pp": 2, "microbatches": 2}),
             ("edge_models:clamped_activations", {"dp": 2}), ("edge_models:clamped_activations", {"tp": 2}),
             ("edge_models:learned_attention_bias", {"dp": 2}), ("edge_models:column_blocks", {"dp": 2, "fsdp": 3}),
             ("edge_models:sequence_first_attention", {"tp": 2}),
             ("edge_models:depth_scaled_blocks", {"pp": 2, "microbatches": 2}),
             ("edge_models:alternating_blocks", {"pp": 2, "schedule": "interleaved", "virtual_stages": 2,
                                                 "microbatches": 2}),
             ("edge_models:pooled_convs", {"dp": 2}), ("edge_models:upsampled_convs", {"dp": 2}),
             ("edge_models:upsampled_convs", {"tp": 2}), ("edge_models:pooled_tokens", {"dp": 2}),
             ("edge_models:channel_first_blocks", {"pp": 2, "microbatches": 2}),
             ("edge_models:dense_first_blocks", {"pp": 2, "schedule": "1f1b", "microbatches": 4}),
             ("edge_models:dense_first_blocks", {"pp": 2, "microbatches": 2, "checkpointing": "full"}),
             ("edge_models:dense_first_blocks", {"dp": 2}), ("edge_models:dense_first_blocks", {"tp": 2}),
             ("edge_models:encoder_decoder_blocks", {"pp": 2, "microbatches": 2})]


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:autopar. DTensor's sharding strategy")
@pytest.mark.parametrize("lowered", [False, True], ids=["dtensor", "lowered"])
def test_models_at_the_edges_train_on_2_ranks_like_one_process(lowered: bool) -> None:
    """A loss an expert-parallel dim leaves partial is reduced before it is returned and backpropagated (each
    rank returned its own share); a parameter the step never uses gets no gradient (the lowered runtime stored
    one it did not have); GroupNorm runs whole (DTensor's batch split of it cannot run its backward); blocks
    whose numbered parts differ in shape are alike layers that a pipeline cuts between (they were one layer);
    positions ``[seq]`` beside the batch are given whole to every microbatch (they were cut on dim 0); einsum
    attention under tp trains on DTensor and with selective checkpointing (a view in backward met a gradient
    laid out otherwise than its spec said); a stage boundary that is a view, its layout guard looked through
    for its placement (the plan has none for the guard: "the plan gives no placement", OPT under pp); ReLU6,
    LeakyReLU and ELU split over dp or tp run their backward (DTensor had no rule for their derivatives); a
    learned attention bias read whole by batch-split fused attention gets its gradient summed over dp (each rank
    kept its own shard's: Swin's relative position bias, about half its gradient); a parameter FSDP gathers on
    dim 0 and views back (a ``[1, width]`` transposed weight) reads a contiguous piece of its layer's gathered
    buffer on the lowered runtime (it failed: "view size is not compatible with input tensor's size"); a view
    whose input a redistribute laid out otherwise than the trace saw reads it laid out as traced (XLNet's
    einsum attention under tp failed: "Cannot view a tensor with shape [8, 2, 8, 8, 1] and strides ..."); layers whose
    ops differ only in float constants are alike layers a pipeline cuts between (DiffLlama's were refused); layers of
    two kinds alternating are cut between pairs, each chunk a pair (Jamba's were refused); average and adaptive max
    pooling split over dp run their backward (DTensor had no rule for their derivatives: PoolFormer failed); a stage
    whose input's gradient is strided sends it back (``isend`` refused it: SqueezeBERT under pp); alike layers after
    a first one that is not are cut between, the first stage holding the leading one, never recomputed (DeepSeek-V3's
    were refused), an encoder-decoder's pipeline cut between decoder layers passes the encoder's output on, and a
    lowered stage running an op whose derivative the program supplies (``aten.copy`` of a
    tensor written half by half) runs it in its eager forward too ("derivative for aten::copy is not implemented"),
    and that ``copy`` runs on local shards split over dp or tp (it ran whole), as ``F.interpolate``'s upsampling
    does (it ran whole, with a warning), and adaptive pooling's restride of its size-1 dims is read as its input
    (an ``as_strided`` that ran whole, with a warning: FocalNet's pooler)."""
    runs = [dict(name=spec, overrides=None, global_batch=8, seq=None, steps=3, plan=None, constraints=constraints,
                 lowered=lowered) for spec, constraints in EDGE_RUNS]
    for (spec, _), result in zip(EDGE_RUNS, train_parallel_many(2, runs)):
        result.assert_matches(train_single(spec, None, 8, None, steps=3), spec)


@pytest.mark.dist
def test_a_partial_loss_cast_back_to_the_compute_dtype_is_reduced_too() -> None:
    """In bf16 the captured mean-squared loss ends in a cast back from fp32 that the plan (captured in fp32)
    never saw, so the plan says nothing of the loss the program returns: it is reduced all the same where
    partial (ep), and returned as its input is placed where not (dp: its boundary had no placement)."""
    spec = "edge_models:experts"
    runs = [dict(name=spec, overrides=None, global_batch=8, seq=None, steps=3, plan=None,
                 constraints={"dp": 2, **parallel, "dtype": "bf16"}, lowered=lowered)
            for parallel in ({"ep": 2}, {}) for lowered in (False, True)]
    reference = train_single(spec, None, 8, None, steps=3, dtype="bf16")
    for result in train_parallel_many(2, runs):
        result.assert_matches(reference)


def test_an_expert_dim_may_leave_the_loss_partial_and_group_norm_is_offered_whole() -> None:
    """What the runs above rest on: the planner's choices that the runtimes must carry out."""
    from autopar.models import build_model

    bundle = build_model("edge_models:experts", global_batch=8, device="meta")
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, {"dp": 2, "ep": 2},
                        example_targets=bundle.example_targets)
    assert plan.mesh.dim_names == ["ep"] and plan.placements["w1"] == ["S(0)"]
    loss = next(op for op in plan.ops.values() if op["op"] == "aten.mean.default")
    assert loss["outputs"] == [["P(avg)"]]
    conv = build_model("edge_models:grouped_conv", global_batch=8, device="meta")
    with pytest.warns(UserWarning, match=r"native_group_norm\.default cannot be trained on shards"):
        plan = autopar.plan(conv.model, conv.example_inputs, "1x2xcpu", conv.loss_fn, {"dp": 2},
                            example_targets=conv.example_targets)
    norm = next(op for op in plan.ops.values() if op["op"] == "aten.native_group_norm.default")
    assert norm["inputs"][0] == ["R"] and norm.get("local")


def test_a_tensor_written_half_by_half_stays_split_on_the_batch() -> None:
    """``dst.copy_(src)`` is captured as ``aten.copy``, which DTensor has no rule for: it runs on local shards
    split like its source (``strategies.LOCAL_RULES``), so under dp the tensor a block writes half by half
    (DeepSeek-V3's latent attention writes its queries so) and every op after it stay split on the batch. Run
    whole, the copy gathered the batch on every rank and the data-parallel rule lost the batch dim after it
    (``roles.batch_dims``), leaving those ops every placement on dp."""
    from autopar.models import build_model

    bundle = build_model("edge_models:dense_first_blocks", global_batch=8, device="meta")
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, {"dp": 2},
                        example_targets=bundle.example_targets)
    copies = [op for op in plan.ops.values() if op["op"] == "aten.copy.default"]
    assert copies and all(op["outputs"] == [["S(0)"]] and op["inputs"] == [["S(0)"], ["S(0)"]] and op.get("local")
                          for op in copies), copies
    written = [op for op in plan.ops.values() if op["op"] == "aten.slice_scatter.default"]
    assert written and all(op["outputs"] == [["S(0)"]] for op in written), written


@pytest.mark.parametrize("layers", [3, 6])
def test_blocks_with_numbered_parts_are_alike_layers_traced_three_deep(layers: int) -> None:
    from autopar.ir.capture import TRACED_LAYERS, capture
    from autopar.ir.layers import layer_count
    from autopar.models import build_model

    bundle = build_model("edge_models:sequential_blocks", overrides={"layers": layers}, global_batch=8, device="meta")
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn,
                       traced_layers=TRACED_LAYERS)
    assert layer_count(captured) == layers
    assert (captured.stack is not None) == (layers > TRACED_LAYERS)
    keys = {captured.tie_keys[name] for name in captured.params}
    assert {"param:blocks.*.1.weight", "param:blocks.*.3.weight"} <= keys


def test_only_inputs_whose_dim_0_is_the_batch_are_split_on_it() -> None:
    from autopar.core.batch import batch_carriers

    assert batch_carriers([[8, 6], [6], [], [8, 6]]) == [True, False, False, True]
    assert batch_carriers([[], [4, 3]]) == [False, True]  # the batch is the first input with dims
    from autopar.models import build_model

    bundle = build_model("edge_models:positions", global_batch=8, device="meta")
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, {"dp": 2, "microbatches": 2},
                        example_targets=bundle.example_targets)
    idx, pos, targets = plan.inputs.values()
    assert idx["placements"] == targets["placements"] == ["S(0)"] and pos["placements"] == ["R"]
