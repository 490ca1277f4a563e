"""Gradient synchronization: all-reduce partial gradients in buckets after backward.

A parameter replicated on a mesh dim where its users split the batch (data parallelism) ends backward
with a *partial* gradient on that dim: each rank holds its batch shard's contribution. We reduce those
in flat buckets (PyTorch DDP's idea: few large collectives beat many small ones), one bucket list per
set of mesh dims, then store each gradient with its parameter's placements so the optimizer sees
plain replicated or sharded DTensors.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial

BUCKET_BYTES = 25 * 2**20
"""Bucket size, PyTorch DDP's default ``bucket_cap_mb=25``."""


def buckets(sizes: Sequence[float], bucket_bytes: float = BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``sizes`` (gradient bytes, in reduction order) grouped into buckets: a bucket closes
    when the next gradient would take it past ``bucket_bytes``; a gradient larger than that is a
    bucket of its own. ``GradientSync`` reduces each bucket with one all_reduce per partial mesh dim;
    ``autopar.collectives`` counts a plan's gradient all_reduces with the same rule."""
    found: list[list[int]] = []
    bucket: list[int] = []
    size = 0.0
    for i, nbytes in enumerate(sizes):
        if bucket and size + nbytes > bucket_bytes:
            found.append(bucket)
            bucket, size = [], 0.0
        bucket.append(i)
        size += nbytes
    if bucket:
        found.append(bucket)
    return found


class GradientSync:
    def __init__(self, params: Iterable[nn.Parameter], bucket_bytes: int = BUCKET_BYTES):
        self.params = list(params)
        self.bucket_bytes = bucket_bytes
        self.collectives = 0  # all_reduce calls issued by the last sync (for tests and reports)

    def __call__(self) -> None:
        self.collectives = 0
        groups: dict[tuple[tuple[int, str], ...], list[nn.Parameter]] = defaultdict(list)
        for p in self.params:
            if isinstance(p.grad, DTensor):
                partial = tuple((d, pl.reduce_op) for d, pl in enumerate(p.grad.placements) if isinstance(pl, Partial))
                if partial:
                    groups[partial].append(p)
                elif p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        for partial, params in groups.items():
            for bucket in self._buckets(params):
                self._reduce(bucket, partial)

    def _buckets(self, params: list[nn.Parameter]) -> Iterable[list[nn.Parameter]]:
        sizes = [p.grad.to_local().numel() * p.grad.to_local().element_size() for p in params]
        for indices in buckets(sizes, self.bucket_bytes):
            yield [params[i] for i in indices]

    def _reduce(self, bucket: list[nn.Parameter], partial: tuple[tuple[int, str], ...]) -> None:
        locals_ = [p.grad.to_local() for p in bucket]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        mesh = bucket[0].device_mesh
        for dim, reduce_op in partial:
            dist.all_reduce(flat, group=mesh.get_group(dim))
            self.collectives += 1
            if reduce_op == "avg":
                flat /= mesh.size(dim)
        offset = 0
        for p, t in zip(bucket, locals_):
            reduced = flat[offset: offset + t.numel()].view_as(t)
            offset += t.numel()
            grad = DTensor.from_local(reduced, mesh, _without_partial(p.grad.placements), run_check=False)
            p.grad = grad if grad.placements == p.placements else grad.redistribute(mesh, p.placements)


def _without_partial(placements) -> list:
    from torch.distributed.tensor import Replicate

    return [Replicate() if isinstance(pl, Partial) else pl for pl in placements]
