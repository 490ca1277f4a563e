"""Mixture-of-experts decoder (Mixtral-style) in the GShard formulation, so expert parallelism is a placement.

Llama blocks (``llama.py``'s rotary grouped-query attention, RMSNorm) whose MLP is a top-k routed mixture
of SwiGLU experts. The routing is written as dense tensor algebra, with no data-dependent shapes or
control flow, so ``torch.export`` captures it on fake tensors and DTensor's strategies split it:

* tokens are grouped per sequence (group dim ``g`` = batch, ``s`` tokens a group), or in groups of
  ``group_size`` consecutive tokens of a sequence (``g`` = batch x s / group_size), which bounds the
  dispatch mask's ``C`` by the group instead of the sequence;
* a router (``Linear(d, E)``) and a softmax give each token a probability per expert; its ``top_k``
  experts are kept, their gates renormalized to sum to 1 (as Mixtral does);
* each (group, expert) has ``C = ceil(capacity_factor * k * s / E)`` slots (``s`` with
  ``drop_tokens=False``: no token is ever dropped, which parity tests need); a token's slot is its
  rank among the group's tokens routed there (``cumsum``; first choices before second choices, as
  GShard), and tokens past the capacity are dropped (their expert output is 0; the residual carries them);
* dispatch and combine are einsums with a one-hot mask ``[g, s, E, C]``:
  ``x_e[E, g, C, d] = dispatch . x`` and ``y[g, s, d] = combine . expert_out``;
* experts are batched matmuls over weights ``[E, d, f]`` / ``[E, f, d]`` (SwiGLU);
* the Switch/GShard load-balancing loss per group, ``E * sum_e f_e * p_e`` (``f_e`` the share of the
  group's top-k assignments that went to expert ``e``, over ``k``; ``p_e`` its mean router probability),
  averaged over groups and layers and scaled by ``aux_loss_coef``, is added to the LM loss.

Splitting the expert weights on their expert dim over a mesh dim and the dispatched tokens
``[E, g, C, d]`` on the same dim is expert parallelism; moving them from the group split to the expert
split and back are the two all_to_alls (``planning/roles.py``, role ``ep``). The model returns
``(logits, aux_loss)``; ``moe_loss`` adds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.core.errors import BadInputError

from .common import INIT_STD, RMSNorm, check_positive, init_weights, lm_loss
from .llama import LlamaAttention, LlamaConfig, rope_tables

__all__ = ["MoEConfig", "MoE", "MoEBlock", "MoEFeedForward", "Experts", "moe_loss", "capacity"]


@dataclass
class MoEConfig:
    """Hyper-parameters of a mixture-of-experts decoder."""

    layers: int  # number of transformer blocks
    hidden: int  # model (embedding) width
    heads: int  # query heads; must divide hidden
    kv_heads: int  # key/value heads (grouped-query attention); must divide heads
    vocab: int  # vocabulary size
    seq: int  # maximum sequence length (size of the rotary tables)
    ffn_hidden: int  # each expert's SwiGLU inner width
    experts: int  # experts per layer (E)
    top_k: int = 2  # experts each token is sent to (k)
    capacity_factor: float = 1.25  # slots per (group, expert): ceil(capacity_factor * k * s / E)
    group_size: int = 0  # tokens a routing group (dividing the sequence); 0: one group per sequence
    drop_tokens: bool = True  # False: capacity s per (group, expert), no token dropped
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss added to the LM loss
    rope_theta: float = 1e6  # rotary embedding base (Mixtral's)
    norm_eps: float = 1e-5  # RMSNorm epsilon

    def __post_init__(self) -> None:
        check_positive(self, ("layers", "hidden", "heads", "kv_heads", "vocab", "seq", "ffn_hidden",
                              "experts", "top_k"))
        if self.top_k > self.experts:
            raise BadInputError(f"top_k ({self.top_k}) must not exceed experts ({self.experts})")
        if not self.capacity_factor > 0:
            raise BadInputError(f"capacity_factor must be > 0, got {self.capacity_factor}")
        if self.group_size < 0:
            raise BadInputError(f"group_size must be >= 0 (0: a group per sequence), got {self.group_size}")
        self.attention_config()  # checks heads, kv_heads and the head width

    def attention_config(self) -> LlamaConfig:
        """The Llama config the attention of a block is built from."""
        return LlamaConfig(layers=self.layers, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                           vocab=self.vocab, seq=self.seq, ffn_hidden=self.ffn_hidden,
                           rope_theta=self.rope_theta, norm_eps=self.norm_eps)


def capacity(cfg: MoEConfig, tokens: int) -> int:
    """Slots per (group, expert) for groups of ``tokens`` tokens: ``ceil(capacity_factor * k * tokens / E)``,
    at most ``tokens`` (a token goes to an expert once); ``tokens`` when tokens are never dropped."""
    if not cfg.drop_tokens:
        return tokens
    return min(tokens, math.ceil(cfg.capacity_factor * cfg.top_k * tokens / cfg.experts))


class Experts(nn.Module):
    """``E`` SwiGLU experts as stacked weights: ``w2(silu(w1 x) * w3 x)`` per expert, batched matmuls."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        e, d, f = cfg.experts, cfg.hidden, cfg.ffn_hidden
        self.w1 = nn.Parameter(torch.empty(e, d, f))
        self.w3 = nn.Parameter(torch.empty(e, d, f))
        self.w2 = nn.Parameter(torch.empty(e, f, d))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every expert weight ~ N(0, INIT_STD), as the Linear layers of the other families."""
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, mean=0.0, std=INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [E, n, d]`` (each expert's tokens) -> ``[E, n, d]``."""
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)


def _group_tokens(cfg: MoEConfig, seq: int) -> int:
    """Tokens a routing group of sequences of ``seq`` tokens: ``group_size``, or ``seq`` when it is 0."""
    if not cfg.group_size:
        return seq
    if seq % cfg.group_size:
        raise BadInputError(f"group_size {cfg.group_size} must divide the sequence length {seq}")
    return cfg.group_size


def _one_hot(index: torch.Tensor, classes: int, dtype: torch.dtype) -> torch.Tensor:
    """``index [...]`` -> ``[..., classes]`` one-hot, by comparison with ``arange`` (no data-dependent check)."""
    return (index.unsqueeze(-1) == torch.arange(classes, device=index.device)).to(dtype)


def _routes(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs [g, s, E]`` -> (choice masks ``[k, g, s, E]`` one-hot, gates ``[k, g, s]`` renormalized)."""
    top, index = probs.topk(k, dim=-1)
    gates = top / top.sum(dim=-1, keepdim=True)
    masks = _one_hot(index, probs.shape[-1], probs.dtype).movedim(2, 0)
    return masks, gates.movedim(2, 0)


def _slots(masks: torch.Tensor) -> torch.Tensor:
    """Each choice's slot in its expert, ``[k, g, s, E]``: the token's rank among the group's tokens sent
    there, every first choice before every second choice (GShard). Meaningful where ``masks`` is 1."""
    before = masks.sum(dim=2, keepdim=True).cumsum(dim=0) - masks.sum(dim=2, keepdim=True)
    return masks.cumsum(dim=2) - 1 + before


def _dispatch_combine(masks: torch.Tensor, gates: torch.Tensor, slots_per_expert: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One-hot dispatch mask and gate-weighted combine tensor, both ``[g, s, E, C]``, from the choices
    of ``_routes``; a choice whose slot is past the capacity is dropped."""
    slots = _slots(masks)
    kept = masks * (slots < slots_per_expert).to(masks.dtype)
    placed = kept.unsqueeze(-1) * _one_hot(slots.to(torch.long), slots_per_expert, masks.dtype)  # [k, g, s, E, C]
    combine = (placed * gates[..., None, None]).sum(dim=0)
    return placed.sum(dim=0), combine


def _balance_loss(probs: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Switch/GShard load-balancing loss ``E * sum_e f_e * p_e`` per group, averaged over groups."""
    share = masks.mean(dim=(0, 2))  # [g, E]: fraction of the group's k * s assignments per expert
    mean_prob = probs.mean(dim=1)  # [g, E]
    return (share * mean_prob).sum(dim=-1).mean() * probs.shape[-1]


class MoEFeedForward(nn.Module):
    """Top-k routed experts with a capacity per (group, expert): ``x [g, s, d] -> ([g, s, d], aux loss)``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        b, seq, d = x.shape
        s = _group_tokens(cfg, seq)
        g = b * seq // s
        x = x.reshape(g, s, d)
        slots_per_expert = capacity(cfg, s)
        probs = self.router(x).softmax(dim=-1)
        masks, gates = _routes(probs, cfg.top_k)
        dispatch, combine = _dispatch_combine(masks, gates, slots_per_expert)
        routed = torch.einsum("gsec,gsd->egcd", dispatch, x)
        out = self.experts(routed.reshape(cfg.experts, g * slots_per_expert, d))
        out = out.reshape(cfg.experts, g, slots_per_expert, d)
        y = torch.einsum("gsec,egcd->gsd", combine, out)
        return y.reshape(b, seq, d), _balance_loss(probs, masks)


class MoEBlock(nn.Module):
    """Pre-RMSNorm block: ``x + attn(norm1(x))`` then ``x + moe(norm2(x))``; returns ``(x, aux loss)``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = LlamaAttention(cfg.attention_config())
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.moe = MoEFeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        y, aux = self.moe(self.mlp_norm(x))
        return x + y, aux


class MoE(nn.Module):
    """MoE language model: ``forward(idx [b, s] long) -> (logits [b, s, vocab], aux loss)``, the aux loss
    the layers' mean balance loss times ``aux_loss_coef``. Rotary tables as in ``Llama``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
        self.norm_f = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.seq, cfg.attention_config().head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise all weights (N(0, 0.02), unit norms), in registration order."""
        init_weights(self)
        for sub in self.modules():
            if isinstance(sub, Experts):
                sub.reset_parameters()

    def reset_buffers(self) -> None:
        """Recompute the non-persistent buffers on their current device/dtype."""
        cfg, device, dtype = self.config, self.rope_cos.device, self.rope_cos.dtype
        cos, sin = rope_tables(cfg.seq, cfg.attention_config().head_dim, cfg.rope_theta, device=device)
        self.rope_cos, self.rope_sin = cos.to(dtype), sin.to(dtype)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = idx.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_emb(idx)
        balance = []
        for block in self.blocks:
            x, layer_balance = block(x, cos, sin)
            balance.append(layer_balance)
        return self.lm_head(self.norm_f(x)), torch.stack(balance).mean() * self.config.aux_loss_coef


def moe_loss(output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of the logits plus the model's load-balancing loss."""
    logits, aux = output
    return lm_loss(logits, targets) + aux
