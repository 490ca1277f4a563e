"""Dynamic loss scaling for plans that compute in fp16.

fp16 keeps 5 bits of exponent: a gradient below 6e-8 flushes to zero, one below 6e-5 loses precision, so an
fp16 backward loses the small gradients that bf16 or fp32 keep. Mixed-precision training in fp16 (Micikevicius
et al., "Mixed Precision Training", ICLR 2018, §3.2) scales the loss by ``S`` before backward and the
gradients by ``1/S`` after it, and skips a step whose gradients overflowed, halving ``S``; ``S`` doubles after
a run of steps without overflow. The policy is ``torch.amp.GradScaler``'s (growth 2 every 2,000 good steps,
backoff 0.5), but for its largest scale: autopar's program computes the loss itself in fp16, so the gradient
backward starts from, ``S``, must stay below fp16's largest number (65,504). ``GradScaler``'s initial 2**16
overflowed there on every step; 2**15 is where it starts and what it grows back to.

Where we diverge from ``GradScaler``: autopar's ``step()`` runs backward itself, so it scales, unscales and
checks inside the step and the training loop stays as it is. The gradients ``step()`` leaves are unscaled
(``clip_grad_norm_`` reads true norms); after an overflow it leaves none, so the caller's ``optimizer.step()``
changes nothing, as ``GradScaler.step`` skips it. Gradients held from an earlier ``step()`` (accumulation over
calls) are scaled by ``S`` before backward adds to them, so the unscale gives back both sums as they were.
All ranks agree on an overflow (one all_reduce of a flag a step), so every replica skips the same steps.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

LARGEST_SCALE = 2.0 ** 15
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


class DynamicLossScale:
    """The loss scale of one module's fp16 steps (``scale``), and how many steps it skipped (``skipped``)."""

    def __init__(self) -> None:
        self.scale = LARGEST_SCALE
        self.skipped = 0
        self._good_steps = 0

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps of it (``runtime/checkpoint.py``), so a resumed run starts from this scale."""
        return {"scale": self.scale, "skipped": float(self.skipped), "good_steps": float(self._good_steps)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.skipped, self._good_steps = int(state["skipped"]), int(state["good_steps"])

    def before_backward(self, params: list[torch.Tensor]) -> float:
        """Scale the gradients ``params`` already hold by ``scale``, as backward will add scaled ones to them;
        returns the scale, which the step's loss is multiplied by."""
        for grad in _gradients(params):
            grad.mul_(self.scale)
        return self.scale

    def after_backward(self, params: list[torch.Tensor], device: torch.device) -> bool:
        """Unscale ``params``' gradients; where any rank's overflowed, drop them all (the step is skipped) and
        back the scale off. Returns whether the gradients were finite. Collective: every rank calls it."""
        grads = list(_gradients(params))
        for grad in grads:
            grad.mul_(1.0 / self.scale)
        overflow = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))], device=device)
        if dist.is_initialized():
            dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
        if overflow.item():
            for p in params:
                p.grad = None
            self.scale *= BACKOFF_FACTOR
            self.skipped += 1
            self._good_steps = 0
            return False
        self._good_steps += 1
        if self._good_steps == GROWTH_INTERVAL:
            self.scale = min(self.scale * GROWTH_FACTOR, LARGEST_SCALE)
            self._good_steps = 0
        return True


def _gradients(params: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The local tensors of ``params``' gradients (a DTensor's shard)."""
    for p in params:
        if p.grad is not None:
            yield p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
