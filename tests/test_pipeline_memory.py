"""Activations a pipeline's first stage holds under interleaved 1F1B (cost_models/pipeline.py, planning/stages.py),
checked against two counts made without autopar's formula: Megatron-LM's warmup (Narayanan et al., SC21, §2.2:
the first device runs ``(p - 1) 2 + (v - 1) p`` chunk forwards before its first backward, and one more before
each backward after) and torch's own ``ScheduleInterleaved1F1B`` action table, which autopar's runtime runs
(simulated by ``simulate``). Issue 20: the Nemotron-4 340B row (tp8 pp8 v12, 16 microbatches) is one of them."""

from __future__ import annotations

import pytest

from autopar.cost_models.pipeline import microbatches_in_flight, simulate, torch_schedule_order
from autopar.planning.stages import Staging

# (stages p, microbatches m, chunks v), m a multiple of p above p, as Megatron-LM's interleaved schedule needs
INTERLEAVED_SIZES = [(8, 16, 12), (4, 8, 2), (4, 12, 3), (8, 32, 12)]


def megatron_first_device_chunks_held(stages: int, microbatches: int, chunks: int) -> int:
    """Chunk-microbatches the first device holds at most: its warmup forwards plus the steady state's one."""
    warmup = (stages - 1) * 2 + (chunks - 1) * stages
    return min(warmup + 1, microbatches * chunks)


@pytest.mark.parametrize("stages,microbatches,chunks", INTERLEAVED_SIZES)
def test_interleaved_in_flight_is_megatron_warmup_plus_one(stages: int, microbatches: int, chunks: int) -> None:
    held = megatron_first_device_chunks_held(stages, microbatches, chunks) / chunks  # in stages' worth
    assert microbatches_in_flight("interleaved", stages, microbatches, chunks) == pytest.approx(held)


@pytest.mark.parametrize("stages,microbatches,chunks", INTERLEAVED_SIZES)
def test_interleaved_in_flight_is_what_torchs_table_holds(stages: int, microbatches: int, chunks: int) -> None:
    table = torch_schedule_order("ScheduleInterleaved1F1B", stages, microbatches, chunks)
    assert simulate(table, chunks).in_flight == pytest.approx(
        microbatches_in_flight("interleaved", stages, microbatches, chunks))


def test_nemotron4_340b_first_stage_holds_103_layer_microbatches() -> None:
    """96 layers on pp 8 x v 12: one layer a chunk, 12 a device; 16 microbatches (global batch 32 over dp 2).
    Megatron's warmup is 7 x 2 + 11 x 8 = 102 chunk forwards, so 103 one-layer chunks' activations are held:
    12 layers at 103 / 12 microbatches each."""
    staging = Staging(stages=8, layers=96, schedule="interleaved", chunks=12)
    assert staging.layers_per_stage == 12
    assert staging.layers_per_stage * staging.in_flight(16) == pytest.approx(103)
    assert staging.last_chunk_in_flight(16) == 1  # the head's logits: one microbatch
