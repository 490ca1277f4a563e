"""Pipeline-parallel plans run (``autopar.runtime``, ``passes/split_stages.py``).

* the split, with no processes: the stage programs of a captured step, chained on one process, give
  the whole program's loss (two stages, and four chunks with an embedding-only first chunk and an
  empty trailing one);
* numerical parity on gloo (docs/architecture.md "Correctness"): 3 SGD steps under pp=2 plans (1F1B, GPipe with full
  checkpointing, interleaved 1F1B, tiny-llama on 2 ranks; pp=2 x dp=2 and pp=2 x tp=2 on 4) against
  single-process training of the same seed and batches: every gradient after the first backward (all
  stages, gathered) within rtol 1e-4 / atol 1e-5, per-step loss within rtol 1e-4 on every rank,
  gathered final parameters (all stages) within atol 1e-5; and pp=2 x dp=2 with the data-parallel
  dim sharding the optimizer state (ZeRO-1), also the gradients (ZeRO-2), or the parameters (FSDP);
* torch's zero-bubble schedule (``ScheduleInterleavedZeroBubble``: each backward split into its input-
  and weight-gradient steps), under the same check: pp=2 with one chunk a device on 2 ranks (with two
  chunks a device, and with full checkpointing, in the extended tier); pp=2 x dp=2 under ZeRO-2 (whose reduce_scatter runs from the post-accumulate
  hooks that torch's weight step bypasses: ``AccumulatingStage``), pp=2 x tp=2, and pp=2 x dp=2 under
  ZeRO-1 in bf16 (whose chunks read compute-dtype copies of the optimizer's parameters: the leaves
  ``StageModule.parameters()`` hands torch's split) on 4;
* lowered chunks (``lowered=True``), under the same check, each chunk asserted to run lowered with its
  parameters as local tensors: 1F1B, GPipe with full checkpointing and interleaved on 2 ranks; pp=2 x dp=2
  plain, under ZeRO-1 (fp32 and bf16), FSDP and selective checkpointing, and pp=2 x tp=2 on 4; in the heavy
  tier, compiled by inductor (``compile=True``): 1F1B and interleaved on 2 ranks;
* the last stage's counts of targets, reduced for every microbatch before the schedule (pp=2 x dp=2,
  lowered, 1F1B and interleaved), on batches whose samples ignore different numbers of targets.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import fx

from autopar.ir.capture import CapturedGraph, capture
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import batches, build, sgd, train_parallel_many, train_single
from autopar.passes.program import copy_graph
from autopar.passes.split_stages import StageProgram, split_program

STEPS = 3
BATCH = 8


@functools.lru_cache(maxsize=None)
def _captured(name: str, tie_embeddings: bool = False) -> tuple[CapturedGraph, fx.GraphModule, dict[str, torch.Tensor]]:
    """The captured step of a built-in model, as an FX program, with a value for every placeholder."""
    bundle = build(name, {"tie_embeddings": True} if tie_embeddings else None, BATCH, None, seed=0)
    cg = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    params = dict(bundle.model.named_parameters(remove_duplicate=False))
    buffers = dict(bundle.model.named_buffers())
    values = dict(zip(cg.user_inputs, (*bundle.example_inputs, bundle.example_targets)))
    values.update({n: params[fqn] for n, fqn in cg.params.items()})
    values.update({n: buffers[fqn] for n, fqn in cg.buffers.items()})
    values.update(cg.constants)
    return cg, fx.GraphModule(cg.graph_module, copy_graph(cg.graph)), values


@torch.no_grad()
def _whole_and_chained_loss(name: str, ranges: list[list[int]], tie_embeddings: bool = False
                            ) -> tuple[float, float, list[StageProgram]]:
    cg, program, values = _captured(name, tie_embeddings)
    (whole,) = program(*(values[n.name] for n in program.graph.nodes if n.op == "placeholder"))
    stages = split_program(program, ranges, cg.params, cg.user_inputs, cg.buffers)
    carried: tuple = ()
    for stage in stages:
        carried = stage.graph_module(*carried, *(values[n] for n in stage.placeholders))
    (chained,) = carried
    return float(whole), float(chained), stages


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_stage_programs_chained_give_the_whole_programs_loss(name: str) -> None:
    whole, chained, stages = _whole_and_chained_loss(name, [[0, 1], [1, 2]])
    assert chained == pytest.approx(whole, rel=1e-6)
    assert stages[0].inputs == [] and len(stages[1].inputs) == 1  # one activation crosses the boundary
    cg = _captured(name)[0]
    layer_1 = {n for n, fqn in cg.params.items() if fqn.split(".")[1] == "1"}
    assert layer_1 and not layer_1 & set(stages[0].placeholders), "stage 0 must not read layer 1's parameters"
    assert layer_1 <= set(stages[1].placeholders)


def test_split_puts_embedding_first_and_head_last_around_empty_chunks() -> None:
    whole, chained, stages = _whole_and_chained_loss("tiny-gpt", [[0, 0], [0, 1], [1, 2], [2, 2]])
    assert chained == pytest.approx(whole, rel=1e-6)
    assert [len(s.inputs) for s in stages] == [0, 1, 1, 1]
    fqns = [{_captured("tiny-gpt")[0].params.get(p, "") for p in s.placeholders} for s in stages]
    assert "tok_emb.weight" in fqns[0] and "lm_head.weight" in fqns[3]


def test_a_weight_tied_across_stages_is_read_by_the_first_and_last_chunk() -> None:
    """The tied embedding is one placeholder, of both chunks (each stage holds a copy; the runtime sums
    their gradients: ``passes/tied_parameters.py``, parity in ``tests/test_hf_models.py``)."""
    whole, chained, stages = _whole_and_chained_loss("tiny-gpt", [[0, 1], [1, 2]], tie_embeddings=True)
    assert chained == pytest.approx(whole, rel=1e-6)
    cg = _captured("tiny-gpt", True)[0]
    assert cg.aliases == {"lm_head.weight": "tok_emb.weight"}
    (tied,) = [n for n, fqn in cg.params.items() if fqn == "tok_emb.weight"]
    assert all(tied in stage.placeholders for stage in stages)


def _runs(name: str, constraint_sets: list[dict], overrides: dict | None = None) -> list[dict]:
    return [dict(name=name, overrides=overrides, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                 constraints=c) for c in constraint_sets]


@pytest.mark.slow
@pytest.mark.dist
def test_pp2_1f1b_and_gpipe_with_checkpointing_match_single_process() -> None:
    constraint_sets = [{"pp": 2, "microbatches": 4, "schedule": "1f1b", "checkpointing": "none"},
                       {"pp": 2, "microbatches": 2, "schedule": "gpipe", "checkpointing": "full"}]
    results = train_parallel_many(2, _runs("tiny-gpt", constraint_sets))
    reference = train_single("tiny-gpt", None, BATCH, None, STEPS)
    for constraints, result in zip(constraint_sets, results):
        assert result.plan["degrees"]["pp"] == 2
        assert result.plan["pipeline"]["schedule"] == constraints["schedule"]
        assert result.plan["checkpointing"] == constraints["checkpointing"]
        result.assert_matches(reference)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.dist
def test_pp2_by_dp2_and_pp2_by_tp2_match_single_process() -> None:
    results = train_parallel_many(4, _runs("tiny-gpt", [{"pp": 2, "dp": 2, "microbatches": 2},
                                                        {"pp": 2, "tp": 2, "microbatches": 2}]))
    reference = train_single("tiny-gpt", None, BATCH, None, STEPS)
    assert results[0].plan["degrees"]["dp"] == 2 and results[1].plan["degrees"]["tp"] == 2
    assert any(p != ["R"] for p in results[1].plan["placements"].values()), "tp must shard some weights"
    for result in results:
        assert result.plan["degrees"]["pp"] == 2
        result.assert_matches(reference)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.dist
def test_llama_pp2_and_interleaved_match_single_process() -> None:
    four_layers, seven_layers = {"layers": 4}, {"layers": 7}
    runs = _runs("tiny-llama", [{"pp": 2, "microbatches": 2}])
    runs += _runs("tiny-gpt", [{"pp": 2, "microbatches": 4, "schedule": "interleaved"}], overrides=four_layers)
    runs += _runs("tiny-gpt", [{"pp": 2, "microbatches": 4, "schedule": "interleaved"}], overrides=seven_layers)
    llama, interleaved, uneven = train_parallel_many(2, runs)
    llama.assert_matches(train_single("tiny-llama", None, BATCH, None, STEPS))
    assert interleaved.plan["pipeline"]["virtual_stages"] == 2
    assert len(interleaved.plan["pipeline"]["stages"]) == 4
    interleaved.assert_matches(train_single("tiny-gpt", four_layers, BATCH, None, STEPS))
    assert uneven.plan["pipeline"]["stages"] == [[0, 2], [2, 4], [4, 6], [6, 7]]  # chunks of unequal layers
    uneven.assert_matches(train_single("tiny-gpt", seven_layers, BATCH, None, STEPS))


def _lowered(runs: list[dict]) -> list[dict]:
    return [{**run, "lowered": True} for run in runs]


def _assert_every_chunk_lowered(result, chunks_per_rank: int, eager: int = 0, refused: str = "") -> None:
    """Each chunk of rank 0 ran lowered, its parameters as local tensors (their gradients hooked), each
    parameter's leaf made once for every microbatch of every step (made again, the same numbers); ``eager``
    of them with their forward under eager autograd (``passes/lower_eager.py``), the others kept on AOT's
    graphs for a reason that says ``refused``."""
    lowering = result.lowered
    assert lowering["programs"] == chunks_per_rank and not lowering["fallbacks"], lowering
    assert lowering["local_parameters"] > 0 and not lowering["dtensor_parameters"], lowering
    assert lowering["leaves_made"] == lowering["local_parameters"], lowering
    assert lowering["eager"] == eager, lowering
    assert all(refused in reason for reason in lowering["eager_refused"]), lowering


@pytest.mark.slow
@pytest.mark.dist
def test_lowered_pipeline_chunks_match_single_process() -> None:
    """Each chunk of a rank as its lowered graphs (``lowered=True``): 1F1B on tiny-llama, GPipe with full
    checkpointing, and interleaved 1F1B (two chunks a rank) on tiny-gpt. Chunks that run no collective and
    recompute nothing run their forward under eager autograd, their gradients summed in their leaves and
    filed in the last backward (``lower_eager.py``, ``LoweredProgram.filing_gradients``); the recomputing
    GPipe chunk keeps AOT's graphs."""
    four_layers = {"layers": 4}
    runs = _runs("tiny-llama", [{"pp": 2, "microbatches": 4, "schedule": "1f1b", "checkpointing": "none"}])
    runs += _runs("tiny-gpt", [{"pp": 2, "microbatches": 2, "schedule": "gpipe", "checkpointing": "full"}])
    runs += _runs("tiny-gpt", [{"pp": 2, "microbatches": 4, "schedule": "interleaved", "checkpointing": "none"}],
                  overrides=four_layers)
    llama, gpipe, interleaved = train_parallel_many(2, _lowered(runs))
    for result, chunks, eager in ((llama, 1, 1), (gpipe, 1, 0), (interleaved, 2, 2)):
        _assert_every_chunk_lowered(result, chunks, eager, refused="recomputes")
    llama.assert_matches(train_single("tiny-llama", None, BATCH, None, STEPS))
    gpipe.assert_matches(train_single("tiny-gpt", None, BATCH, None, STEPS))
    interleaved.assert_matches(train_single("tiny-gpt", four_layers, BATCH, None, STEPS))


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.dist
def test_lowered_pipeline_chunks_with_dp_tp_and_zero_match_single_process() -> None:
    """Lowered chunks of pp=2 x dp=2 (plain, ZeRO-1 in fp32 and with bf16 compute, FSDP, selective
    checkpointing) and pp=2 x tp=2 on 4 ranks."""
    one_f_one_b = {"pp": 2, "dp": 2, "microbatches": 2, "schedule": "1f1b"}
    runs = _runs("tiny-gpt", [one_f_one_b, {**one_f_one_b, "fsdp": 1}, {**one_f_one_b, "fsdp": 1, "dtype": "bf16"},
                              {**one_f_one_b, "fsdp": 3}, {**one_f_one_b, "checkpointing": "selective"},
                              {**one_f_one_b, "dp": 1, "tp": 2}])
    reference = train_single("tiny-gpt", None, BATCH, None, STEPS)
    # rank 0, the first stage: eager where its graphs run no collective (FSDP's gathers, tp's reductions) and
    # it recomputes nothing (selective checkpointing); its gradients reach ZeRO-1's reduce_scatter and the
    # gradient sync's buckets from the leaves' sums, filed in the last backward
    eager = [1, 1, 1, 0, 0, 0]
    for result, eager_chunks in zip(train_parallel_many(4, _lowered(runs)), eager):
        _assert_every_chunk_lowered(result, 1, eager_chunks)
        result.assert_matches(reference)


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.dist
def test_compiled_pipeline_chunks_match_single_process() -> None:
    """Each chunk's lowered graphs compiled by inductor (``compile=True``; a minute or two of C++ compilation
    per rank on 2 cores): 1F1B on tiny-llama and interleaved 1F1B (two chunks a rank) on tiny-gpt, every
    chunk compiled, none fallen back to DTensor."""
    four_layers = {"layers": 4}
    runs = _runs("tiny-llama", [{"pp": 2, "microbatches": 4, "schedule": "1f1b", "checkpointing": "none"}])
    runs += _runs("tiny-gpt", [{"pp": 2, "microbatches": 4, "schedule": "interleaved"}], overrides=four_layers)
    llama, interleaved = train_parallel_many(2, [{**run, "lowered": True, "compile": True} for run in runs])
    for result, chunks in ((llama, 1), (interleaved, 2)):
        _assert_every_chunk_lowered(result, chunks)
        assert result.lowered["compiled"] == chunks, result.lowered
    llama.assert_matches(train_single("tiny-llama", None, BATCH, None, STEPS))
    interleaved.assert_matches(train_single("tiny-gpt", four_layers, BATCH, None, STEPS))


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.dist
def test_zero_and_fsdp_inside_pipeline_stages_match_single_process() -> None:
    """Megatron-LM's distributed optimizer with pipelines (ZeRO-1), ZeRO-2 and FSDP inside the stages."""
    stages = [{"pp": 2, "dp": 2, "microbatches": 2, "fsdp": zero} for zero in (1, 2, 3)]
    results = train_parallel_many(4, _runs("tiny-gpt", stages))
    reference = train_single("tiny-gpt", None, BATCH, None, STEPS)
    for constraints, result in zip(stages, results):
        assert result.plan["degrees"]["pp"] == 2 and result.plan["degrees"]["zero"] == constraints["fsdp"]
        result.assert_matches(reference)


def test_the_runtime_runs_the_zero_bubble_schedule_the_planner_prices() -> None:
    """The schedules' names agree where the layers keep them apart (cost_models imports nothing of autopar)."""
    from autopar.core.plan import MULTI_CHUNK_SCHEDULES, SCHEDULES as NAMES
    from autopar.cost_models import pipeline as priced
    from autopar.runtime.pipeline import SCHEDULES, ZERO_BUBBLE

    assert ZERO_BUBBLE == priced.SIMULATED and priced.SCHEDULES == NAMES == tuple(SCHEDULES)
    assert priced.MULTI_CHUNK == MULTI_CHUNK_SCHEDULES
    assert {name: SCHEDULES[name].__name__ for name in ZERO_BUBBLE} == ZERO_BUBBLE  # torch 2.13 has it


ZERO_BUBBLE = {"pp": 2, "schedule": "zero_bubble"}


@pytest.mark.slow
@pytest.mark.dist
def test_zero_bubble_pp2_matches_single_process() -> None:
    (one_chunk,) = train_parallel_many(2, _runs("tiny-gpt", [{**ZERO_BUBBLE, "microbatches": 4,
                                                               "checkpointing": "none"}]))
    assert one_chunk.plan["pipeline"]["schedule"] == "zero_bubble"
    one_chunk.assert_matches(train_single("tiny-gpt", None, BATCH, None, STEPS))


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.dist
def test_zero_bubble_with_two_chunks_a_rank_and_full_checkpointing_matches_single_process() -> None:
    four_layers = {"layers": 4}
    runs = _runs("tiny-gpt", [{**ZERO_BUBBLE, "microbatches": 4, "virtual_stages": 2}], overrides=four_layers)
    runs += _runs("tiny-llama", [{**ZERO_BUBBLE, "microbatches": 2, "checkpointing": "full"}])
    two_chunks, llama = train_parallel_many(2, runs)
    for result in (two_chunks, llama):
        assert result.plan["pipeline"]["schedule"] == "zero_bubble"
    assert two_chunks.plan["pipeline"]["virtual_stages"] == 2 and len(two_chunks.plan["pipeline"]["stages"]) == 4
    two_chunks.assert_matches(train_single("tiny-gpt", four_layers, BATCH, None, STEPS))
    llama.assert_matches(train_single("tiny-llama", None, BATCH, None, STEPS))


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.dist
def test_zero_bubble_with_zero_tp_and_mixed_precision_matches_single_process() -> None:
    zero_bubble = {"pp": 2, "microbatches": 2, "schedule": "zero_bubble"}
    zero2, tp, bf16 = train_parallel_many(4, _runs("tiny-gpt", [{**zero_bubble, "dp": 2, "fsdp": 2},
                                                                {**zero_bubble, "tp": 2},
                                                                {**zero_bubble, "dp": 2, "fsdp": 1, "dtype": "bf16"}]))
    reference = train_single("tiny-gpt", None, BATCH, None, STEPS)
    assert zero2.plan["degrees"]["zero"] == 2 and tp.plan["degrees"]["tp"] == 2 and bf16.plan["degrees"]["zero"] == 1
    assert bf16.plan["precision"]["compute"] == "bf16"
    zero2.assert_matches(reference)
    tp.assert_matches(reference)
    bf16.assert_matches(train_single("tiny-gpt", None, BATCH, None, STEPS, dtype="bf16"))


def _with_ignored_targets(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The batch with a different number of leading targets of each sample ignored (-100, cross-entropy's
    ``ignore_index``): every microbatch and every data-parallel shard of it counts its own targets."""
    *inputs, targets = batch
    targets = targets.clone()
    for sample in range(targets.shape[0]):
        targets[sample, :(5 * sample + 1) % targets.shape[1]] = -100
    return (*inputs, targets)


def _uneven_targets_rank(rank: int, world: int, runs: list[tuple[dict, dict | None]]) -> list[dict]:
    """Lowered pp x dp training (each run: constraints, model overrides) on batches with ignored targets:
    losses, gradients after the first step, the collectives the rank ran in its last step, and how many
    all_reduces its gradient sync issued there."""
    from autopar import autoparallelize
    from autopar.testing.counters import CollectiveCounter
    from autopar.testing.parity import gathered_grads

    results = []
    for constraints, overrides in runs:
        bundle = build("tiny-gpt", overrides, BATCH, None, seed=0)
        pm = autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                             example_targets=bundle.example_targets, constraints=constraints, lowered=True)
        opt = sgd(pm.parameters())
        losses, grads = [], {}
        for i, batch in enumerate(batches(bundle, STEPS, 0)):
            opt.zero_grad()
            with CollectiveCounter() as counter:
                losses.append(pm.step(*_with_ignored_targets(batch)).item())
            if i == 0:
                grads = gathered_grads(pm)
            opt.step()
        results.append({"losses": losses, "grads": grads, "counted": counter.counts, "lowering": pm.lowering,
                        "synced": pm._program_params.grad_sync.collectives})
    return results


def _single_process_with_ignored_targets(overrides: dict | None) -> tuple[list[float], dict]:
    """The reference: single-process SGD on the same batches, the loss the mean over every counted target of
    the batch (the pipeline weighs each microbatch by its share of them, ``ir/loss_reduction.py``): the losses,
    and the gradients after the first step."""
    bundle = build("tiny-gpt", overrides, BATCH, None, seed=0)
    opt = sgd(bundle.model.parameters())
    losses, grads = [], {}
    for i, batch in enumerate(batches(bundle, STEPS, 0)):
        *inputs, targets = _with_ignored_targets(batch)
        opt.zero_grad()
        loss = bundle.loss_fn(bundle.model(*inputs), targets)
        loss.backward()
        if i == 0:
            grads = {k: p.grad.clone() for k, p in bundle.model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.slow
@pytest.mark.dist
def test_a_pipelines_counts_of_targets_are_reduced_ahead_of_its_schedule_for_every_microbatch() -> None:
    """pp=2 x dp=2 on 4 ranks, lowered, 4 microbatches whose samples each ignore a different number of
    targets, under 1F1B and interleaved 1F1B (two chunks a rank): the last chunk, run eagerly, takes its
    count of targets out of its forward (``lower_eager.take_out_input_sums``) and the step reduces all four
    microbatches' counts in one all_reduce before the schedule runs
    (``PipelineParallelModule._reduce_inputs_ahead``), each forward reading its own microbatch's: losses and
    gradients match single-process training on the same batches (a count handed to the wrong microbatch
    would not), and in a step a last-stage rank runs one all_reduce for the counts and one for the losses'
    sums besides its gradient buckets, where each microbatch's forward ran its own."""
    one_f_one_b = {"pp": 2, "dp": 2, "microbatches": 4, "schedule": "1f1b", "checkpointing": "none"}
    runs = [(one_f_one_b, None), ({**one_f_one_b, "schedule": "interleaved"}, {"layers": 4})]
    per_rank = run_on_ranks(_uneven_targets_rank, 4, runs)
    for i, (constraints, overrides) in enumerate(runs):
        ranks = [results[i] for results in per_rank]
        expected_losses, expected_grads = _single_process_with_ignored_targets(overrides)
        for rank in ranks:
            assert rank["losses"] == pytest.approx(expected_losses, rel=1e-4), constraints
        for name, grad in expected_grads.items():
            torch.testing.assert_close(ranks[0]["grads"][name], grad, rtol=1e-4, atol=1e-5)
        last_stage = [r for r in ranks if r["lowering"]["input_sums_ahead"]]
        assert len(last_stage) == 2, [r["lowering"] for r in ranks]
        for rank in last_stage:
            assert rank["counted"]["all_reduce"] == 2 + rank["synced"], (constraints, rank["counted"])
