"""The random numbers a training step draws (dropout's masks), the same on every rank that needs them alike.

An activation a plan replicates is computed whole on every rank that holds it, so its dropout mask must be the
same on all of them, or the replicas, and the parameters their gradients update, part without a word. torch
draws the mask from the process's global generator, which a job's own code moves rank by rank (a sample drawn
on rank 0 only, a data order seeded per rank). So a step draws from a stream of its own: ``StepRandomness``
seeds the generators of the job's device (and the CPU's) at each step from a base seed rank 0 chose when the
module was built, the step's number and the stream (a pipeline's stage), and gives the caller's generator
states back when the step ends, as if the step had drawn nothing.

Every rank of a stream (every rank of a one-stage plan, a pipeline stage's ranks) starts each step from the
same state; stages draw apart, as Megatron-LM seeds its pipeline stages apart. Ranks whose local shapes are
equal draw alike: replicas get one mask, and the shards of one sharded activation each get the same pattern
over their own part (Megatron-LM instead seeds its tensor-parallel regions per rank; DTensor on CUDA offsets
each shard into one global mask). A step's draws never depend on what the job drew between steps, and
``load_checkpoint`` sets the count of steps to the step it resumes from, so a job that seeds alike and resumes
under the same plan draws the masks of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from autopar.runtime.mesh import job_device_type

_SEED_RANGE = 2**62  # seeds kept inside int64, which the broadcast carries


class StepRandomness:
    """The generator states of each step: seeded from a base seed, rank 0's ``torch.initial_seed()`` (so a
    job seeded alike draws alike, and building one moves no generator), the step's number and ``stream``."""

    def __init__(self, stream: int = 0) -> None:
        self.stream = stream
        self.device_type = job_device_type()
        chosen = torch.tensor([torch.initial_seed() % _SEED_RANGE], dtype=torch.int64, device=self.device_type)
        dist.broadcast(chosen, src=0)
        self.base_seed = int(chosen.item())
        self.steps = 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """A training step: its random numbers drawn from its own seed, then the count of steps advanced."""
        with self.drawing():
            yield
        self.steps += 1

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """Draw from the seed of the step to come (a forward-only call does not advance the count); the
        caller's generators untouched after."""
        devices = [torch.cuda.current_device()] if self.device_type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device_type):
            seed = hash((self.base_seed, self.steps, self.stream)) % _SEED_RANGE  # ints hash alike in every process
            torch.random.default_generator.manual_seed(seed)
            if devices:
                torch.cuda.manual_seed(seed)  # this rank's device: the one fork_rng gives back
            yield
