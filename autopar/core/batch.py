"""Which of a training step's inputs carry the batch, and how a batch is cut into microbatches.

A step's inputs (the model's, then the targets) carry the batch on dim 0 when their dim 0 is the batch size,
that of the first input with dims; the others (a 0-dim scale, positions ``[seq]`` every sample reads) are read
whole by every rank and microbatch. Capture, planning, the runtimes and the parity reference all cut a batch so.
"""

from __future__ import annotations

from typing import Sequence

import torch


def batch_size_of(shapes: Sequence[Sequence[int]]) -> int | None:
    """A step's samples, from its inputs' shapes in order (the inputs, then the targets): dim 0 of the first
    input that has dims (a 0-dim input, such as a scale or a step index, holds no batch); None if none has."""
    return next((int(shape[0]) for shape in shapes if len(shape)), None)


def batch_carriers(shapes: Sequence[Sequence[int]]) -> list[bool]:
    """Which of a step's inputs (``batch_size_of``'s shapes) carry the batch on dim 0: those whose dim 0 is the
    batch size. The others (no dims, or another dim 0: positions ``[seq]`` every sample reads) are read whole
    by every rank and microbatch; an input whose dim 0 only happens to equal the batch size counts as a carrier."""
    batch = batch_size_of(shapes)
    return [len(shape) > 0 and int(shape[0]) == batch for shape in shapes]


def microbatches_of(x: torch.Tensor, microbatches: int, carries: bool) -> list[torch.Tensor]:
    """``x`` cut into ``microbatches`` pieces: on dim 0 where it ``carries`` the batch, else whole each time."""
    return list(torch.chunk(x, microbatches, dim=0)) if carries else [x] * microbatches


def microbatch_pieces(args: Sequence[torch.Tensor], microbatches: int, carriers: Sequence[bool] | None = None
                      ) -> list[tuple[torch.Tensor, ...]]:
    """A step's inputs ``args`` as ``microbatches`` tuples of inputs, each cut by ``microbatches_of``
    (``carriers``: whether each carries the batch; by default ``batch_carriers`` of their shapes)."""
    carriers = batch_carriers([tuple(a.shape) for a in args]) if carriers is None else carriers
    return list(zip(*(microbatches_of(a, microbatches, carries) for a, carries in zip(args, carriers))))
