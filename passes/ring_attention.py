"""Ring attention: fused attention over a sequence split on a context-parallel group, keys and values
passed around the ring (``cp_attention == "ring"``, docs/architecture.md "Where each parallelism lives").

Each of the ``cp`` ranks keeps its queries and starts with its own block of keys and values. In step
``i`` it holds the block of the rank ``i`` places before it: it sends that block on to the next rank and
receives the next one (one ``batch_isend_irecv`` pair, issued *before* the block's attention is computed,
so the exchange runs behind that compute), attends its queries to the block, and merges the block's
output into its own by their log-sum-exps (the online softmax of flash attention). A block holds the
keys of known true positions (``ranges``: the [start, end) ranges each rank holds, contiguous chunks or
the load-balanced layout of ``sequence_layout.py``), so causal attention masks every query by its true
position, and a block no query of the rank may see is skipped (it is still passed on).

The backward is exact and rings too (``_RingAttention``): it needs the global log-sum-exp and output,
which the forward saved with the rank's own queries, keys and values, and nothing of the other ranks.
Each rank passes the keys and values around again; for each block it computes its queries' share of the
block's dK and dV, adds the share the ranks before it computed (which arrives beside the next block),
and sends the sum on, so after ``cp`` steps every block's dK and dV come home to its owner: ``cp - 1``
exchanges of K and V and ``cp`` of dK and dV, each but the last behind one block's backward compute.
Ringing the gradients back costs a second pass of the keys and values, but holds two blocks at a time,
where recomputing the forward through differentiable point-to-point ops would need autograd to keep
every received block (the gathered K and V the all-gather variant holds) until backward.

Why not PyTorch's ring attention (``torch.distributed.tensor.experimental._attention``, torch 2.13):
it is dispatched from SDPA's CUDA kernels (``_scaled_dot_product_flash/efficient/cudnn_attention``,
none of which runs on CPU, so gloo cannot run it), rotates blocks with ``all_to_all`` or ``all_gather``
rather than point-to-point sends, does not take grouped-query attention's ``enable_gqa``, and wants
the buffers sharded in place by its ``context_parallel`` context manager, not an fx program's values.
So blocks are attended here with plain matmuls (exact, any device; a fused flash kernel per block with
its log-sum-exp would be faster on a GPU).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch._guards import detect_fake_mode

Ranges = tuple[tuple[int, int], ...]


def ring_attention(group: dist.ProcessGroup, ranges: Sequence[Ranges], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, attn_mask: None = None, dropout_p: float = 0.0, is_causal: bool = False, *,
                   scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA's result for this rank's queries ``q`` (``[..., heads, s, head_dim]``) against the keys and
    values of every rank of ``group``; ``k``, ``v``: this rank's block; ``ranges[j]``: the true positions
    group rank ``j`` holds, in its rows' order. No attention mask tensor and no dropout (the planner
    offers the ring only without them)."""
    if attn_mask is not None or dropout_p:
        raise NotImplementedError("ring attention runs without an attention mask tensor and without dropout")
    if detect_fake_mode((q, k, v)) is not None or torch.compiler.is_compiling():
        raise NotImplementedError("ring attention does not trace: its exchanges, and which blocks each query "
                                  "sees, run eagerly")
    head_dim = q.shape[-1]
    spec = _Spec(group, tuple(ranges), is_causal, scale if scale is not None else 1.0 / math.sqrt(head_dim),
                 q.shape[-3] // k.shape[-3], (k.shape, v.shape))
    return _RingAttention.apply(spec, q, k, v)


class _Spec:
    """What every step of one ring attention needs besides the tensors."""

    def __init__(self, group: dist.ProcessGroup, ranges: tuple[Ranges, ...], causal: bool, scale: float,
                 repeats: int, shapes: tuple[torch.Size, torch.Size]):
        self.group, self.ranges, self.causal, self.scale, self.repeats = group, ranges, causal, scale, repeats
        self.shapes = shapes  # of a block's keys and values (their head dims may differ)
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def packed(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Keys and values (or their gradients) as one buffer: one message per exchange."""
        return torch.cat([k.reshape(-1), v.reshape(-1)])

    def unpacked(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of a ``packed`` buffer."""
        k_shape, v_shape = self.shapes
        return block[:k_shape.numel()].view(k_shape), block[k_shape.numel():].view(v_shape)

    def holder(self, step: int) -> int:
        """The group rank whose block this rank holds in ``step``."""
        return (self.rank - step) % self.size

    def mask(self, step: int, device: torch.device) -> torch.Tensor | None:
        """Which keys of ``step``'s block each query may see (None: all of them)."""
        if not self.causal:
            return None
        rows, cols = (torch.cat([torch.arange(a, b, device=device) for a, b in self.ranges[r]])
                      for r in (self.rank, self.holder(step)))
        return rows[:, None] >= cols[None, :]


class _Exchange:
    """``block`` sent to the next rank of the ring while the previous one's arrives (asynchronously)."""

    def __init__(self, spec: _Spec, block: torch.Tensor):
        block = block.contiguous()
        self.received = torch.empty_like(block)
        self._works = dist.batch_isend_irecv([dist.P2POp(dist.isend, block, spec.next, spec.group),
                                              dist.P2POp(dist.irecv, self.received, spec.previous, spec.group)])

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self.received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, q: torch.Tensor, k: torch.Tensor,  # type: ignore[override]
                v: torch.Tensor) -> torch.Tensor:
        block = spec.packed(k, v)
        out = lse = None
        for step in range(spec.size):
            exchange = _Exchange(spec, block) if step < spec.size - 1 else None
            mask = spec.mask(step, q.device)
            if mask is None or bool(mask.any()):
                out, lse = _merged(out, lse, *_block_forward(spec, q, *spec.unpacked(block), mask))
            if exchange is not None:
                block = exchange.wait()
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor  # type: ignore[override]
                 ) -> tuple[None, torch.Tensor, torch.Tensor, torch.Tensor]:
        spec: _Spec = ctx.spec
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.float()
        rowsum = (grad * out).sum(-1)  # D of flash attention's backward: rowsum(dO * O)
        dq = torch.zeros_like(q, dtype=torch.float32)
        block, sums = spec.packed(k, v), None
        for step in range(spec.size):
            exchange = _Exchange(spec, block) if step < spec.size - 1 else None
            mask = spec.mask(step, q.device)
            share = torch.zeros_like(block)
            if mask is None or bool(mask.any()):
                dq_block, dk, dv = _block_backward(spec, q, *spec.unpacked(block), mask, grad, lse, rowsum)
                dq += dq_block
                share = spec.packed(dk, dv).to(block.dtype)
            if sums is not None:  # the share of the ranks that held this block before
                share = share + sums.wait()
            sums = _Exchange(spec, share)  # on to the next holder; after the last step, home to the owner
            if exchange is not None:
                block = exchange.wait()
        dk, dv = spec.unpacked(sums.wait())
        return None, dq.to(q.dtype), dk, dv


def _expanded(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """Grouped-query attention: each key-value head serves ``repeats`` consecutive query heads."""
    return x.float() if repeats == 1 else x.float().repeat_interleave(repeats, dim=-3)


def _grouped(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """The gradient of ``_expanded``: the query heads' shares summed onto their key-value head."""
    if repeats == 1:
        return x
    return x.unflatten(-3, (x.shape[-3] // repeats, repeats)).sum(-3)


def _scores(spec: _Spec, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    scores = q.float() @ _expanded(k, spec.repeats).transpose(-2, -1) * spec.scale
    return scores if mask is None else scores.masked_fill(~mask, -math.inf)


def _block_forward(spec: _Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax-normalized output, log-sum-exp per query) of the queries against one block; a query
    that sees none of the block gets output 0 and log-sum-exp -inf."""
    scores = _scores(spec, q, k, mask)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return weights @ _expanded(v, spec.repeats), lse


def _merged(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax: two normalized partial outputs combined by their log-sum-exps."""
    if out is None:
        return block_out, block_lse
    total = torch.logaddexp(lse, block_lse)
    safe = total.masked_fill(torch.isinf(total), 0.0)
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], total


def _block_backward(spec: _Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    grad: torch.Tensor, lse: torch.Tensor, rowsum: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of one block's part in the attention, from the global log-sum-exp (flash attention's
    backward: P = exp(S - lse), dS = P * (dO V^T - rowsum(dO * O)))."""
    weights = torch.exp(_scores(spec, q, k, mask) - lse[..., None])
    kx, vx, qf = _expanded(k, spec.repeats), _expanded(v, spec.repeats), q.float()
    dv = weights.transpose(-2, -1) @ grad
    dscores = weights * (grad @ vx.transpose(-2, -1) - rowsum[..., None])
    dq = dscores @ kx * spec.scale
    dk = dscores.transpose(-2, -1) @ qf * spec.scale
    return dq, _grouped(dk, spec.repeats), _grouped(dv, spec.repeats)
