"""Mixture-of-experts decoder (Mixtral-style) with token-permutation dispatch, so expert parallelism is a placement.

Llama blocks (``llama.py``'s rotary grouped-query attention, RMSNorm) whose MLP is a top-k routed mixture
of SwiGLU experts. The routing has static shapes and no data-dependent control flow, so ``torch.export``
captures it on fake tensors and DTensor's strategies split it:

* tokens are grouped per sequence (group dim ``g`` = batch, ``s`` tokens a group), or in groups of
  ``group_size`` consecutive tokens of a sequence (``g`` = batch x s / group_size);
* a router (``Linear(d, E)``) and a softmax give each token a probability per expert; its ``top_k``
  experts are kept, their gates renormalized to sum to 1 (``route``, as Mixtral does);
* each (group, expert) has ``C = ceil(capacity_factor * k * s / E)`` slots (``s`` with
  ``drop_tokens=False``: no token is ever dropped, which parity tests need); a choice's slot is its
  token's rank among the group's tokens routed there (``cumsum``; first choices before second choices,
  as GShard), and choices past the capacity are dropped (weight 0; the residual carries the token);
* dispatch is a token permutation (``dispatch``): a ``scatter_add`` of token positions gives each of the
  group's ``E x C`` slots its token, and a ``gather`` of rows fills ``[E, g x C, d]``; combine
  (``combine``) gathers each choice's row back and sums them weighted by the gates. Unlike GShard's
  one-hot einsums (``E x C x d`` FLOPs a token each way) this moves rows and spends no FLOPs: the step
  costs the experts' matmuls on ``E x C = capacity_factor x k x s`` rows a group, what Megatron-Core's
  dropless dispatcher spends under balanced routing when ``capacity_factor`` is 1;
* experts are batched matmuls over weights ``[E, d, f]`` / ``[E, f, d]`` (SwiGLU);
* the Switch/GShard load-balancing loss per group, ``E * sum_e f_e * p_e`` (``f_e`` the share of the
  group's top-k assignments that went to expert ``e``, over ``k``; ``p_e`` its mean router probability),
  averaged over groups and layers and scaled by ``aux_loss_coef``, is added to the LM loss.

Splitting the expert weights on their expert dim over a mesh dim and the dispatched tokens
``[E, g x C, d]`` on the same dim is expert parallelism; moving them from the group split to the expert
split and back are the two all_to_alls (``planning/roles.py``, role ``ep``). The tokens are grouped
through their rows (``[b, seq, d] -> [b x seq, d] -> [g, s, d]``), so under context parallelism a rank's
sequence shard is grouped on the rank when groups lie within its chunks. The model returns
``(logits, aux_loss)``; ``moe_loss`` adds them. ``routing_facts`` is what a plan states about the
routing (``Plan.model["moe"]``: capacity, dropped-token policy, the router imbalance the price holds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.core.errors import BadInputError

from .common import INIT_STD, RMSNorm, check_positive, init_weights, is_meta, lm_loss
from .llama import LlamaAttention, LlamaConfig, rope_tables

__all__ = ["MoEConfig", "MoE", "MoEBlock", "MoEFeedForward", "Experts", "Dispatch", "Routing", "moe_loss",
           "capacity", "combine", "dispatch", "route", "routing_facts", "slots_per_expert"]


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
    """Slots per (group, expert) of ``cfg``'s layers for groups of ``tokens`` tokens (``slots_per_expert``)."""
    return slots_per_expert(cfg.capacity_factor if cfg.drop_tokens else None, cfg.top_k, cfg.experts, tokens)


def slots_per_expert(capacity_factor: float | None, top_k: int, experts: int, tokens: int) -> int:
    """Slots per (group, expert) for groups of ``tokens`` tokens: ``ceil(capacity_factor * k * tokens / E)``,
    at most ``tokens`` (a token goes to an expert once); ``tokens`` when none is dropped (``capacity_factor``
    None)."""
    if capacity_factor is None:
        return tokens
    return min(tokens, math.ceil(capacity_factor * top_k * tokens / experts))


@dataclass(frozen=True)
class Routing:
    """What a plan states about a mixture-of-experts layer (``Plan.model["moe"]``): its routing, its
    capacity and dropped-token policy, and the router imbalance its price holds."""

    experts: int  # E
    top_k: int  # k
    group_tokens: int  # s: tokens whose choices share the capacity (a sequence, or group_size of it)
    slots_per_expert: int  # C, per (group, expert)
    capacity_factor: float | None  # None: dropless (C = s)

    def facts(self, modules: list[str]) -> dict:
        """The JSON record; ``modules`` the layers' paths (layer indices as ``*``)."""
        e, k, s, c = self.experts, self.top_k, self.group_tokens, self.slots_per_expert
        holds = c * e / (k * s)  # the busiest expert's load over the mean that fits in its slots
        if self.capacity_factor is None:
            policy = "none dropped"
            assumption = (f"any routing: every expert has a slot for each of a group's {s} tokens "
                          f"({holds:.3g}x the balanced load), so any routing fits; the all_to_alls and expert "
                          "matmuls are priced at that worst case")
        else:
            policy = "past capacity: the choice skips its expert, the residual carries the token"
            assumption = (f"a router balanced within {holds:.3g}x: the all_to_alls and expert matmuls are "
                          f"priced at the capacity ({c} slots per expert per {s}-token group), whatever the "
                          f"router does; a router whose busiest expert gets more than {holds:.3g}x the mean load "
                          f"drops the excess, and a dropless dispatcher (Megatron-Core's) would spend its "
                          f"imbalance / {holds:.3g} times these terms on the busiest rank")
        return {"experts": e, "top_k": k, "group_tokens": s, "slots_per_expert": c,
                "capacity_factor": self.capacity_factor, "dropped_tokens": policy,
                "dispatch": "token permutation: rows gathered by index into [E, groups x C] slots and back",
                "router_imbalance_held": holds, "assumption": assumption, "modules": modules}


def routing_facts(model: nn.Module, seq: int) -> dict | None:
    """``Plan.model["moe"]`` for ``model`` on sequences of ``seq`` tokens: the routing of its first
    mixture-of-experts layer (a module with a ``routing(seq)`` method; the layers of a stack are alike)
    and the paths of all of them; None for a dense model."""
    found = [(name, module.routing(seq)) for name, module in model.named_modules()
             if callable(getattr(module, "routing", None))]
    if not found:
        return None
    modules = sorted({".".join("*" if part.isdigit() else part for part in name.split(".")) for name, _ in found})
    return found[0][1].facts(modules)


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
        """Every expert weight ~ N(0, INIT_STD), as the Linear layers of the other families (none on meta)."""
        if is_meta(self):
            return
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


def route(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs [g, s, E]`` -> (the ``k`` chosen experts ``[g, s, k]``, their gates ``[g, s, k]`` renormalized
    to sum to 1, as Mixtral does)."""
    top, index = probs.topk(k, dim=-1)
    return index, top / top.sum(dim=-1, keepdim=True)


def _choice_slots(index: torch.Tensor, experts: int) -> torch.Tensor:
    """Each choice's slot in its expert, ``[g, s, k]``: the token's rank among the group's tokens sent
    there, every first choice before every second choice (GShard's priority). Counted in integers: a
    bf16 count is exact only to 256."""
    masks = _one_hot(index, experts, torch.long).movedim(2, 0)  # [k, g, s, E]
    before = masks.sum(dim=2, keepdim=True).cumsum(dim=0) - masks.sum(dim=2, keepdim=True)
    slots = masks.cumsum(dim=2) - 1 + before
    return (slots * masks).sum(dim=-1).movedim(0, -1)


@dataclass(frozen=True)
class Dispatch:
    """Where each choice of a group's tokens went: ``rows [g, s, k]``, its row among the group's
    ``E x C`` expert slots (``expert x C + slot``, clamped into its expert when dropped), and
    ``kept [g, s, k]`` (1, or 0 for a choice past its expert's capacity)."""

    rows: torch.Tensor
    kept: torch.Tensor
    slots_per_expert: int
    experts: int


def dispatch(x: torch.Tensor, index: torch.Tensor, experts: int, slots_per_expert: int
             ) -> tuple[torch.Tensor, Dispatch]:
    """Token permutation: ``x [g, s, d]`` and the chosen experts ``index [g, s, k]`` -> each expert's
    tokens ``[E, g * C, d]`` (a slot no token filled holds a copy of the group's first token, which no
    combine reads) and where each choice went. A gather of rows by index: no dense ``[s, E, C]`` mask,
    no FLOPs but the experts' own; shapes are static, so it traces on fake tensors."""
    g, s, k = index.shape
    e, c, d = experts, slots_per_expert, x.shape[-1]
    slot = _choice_slots(index, e)
    kept = (slot < c).to(x.dtype)
    rows = index * c + slot.clamp(max=c - 1)
    token = (torch.arange(1, s + 1, device=x.device).view(1, s, 1) * kept.to(torch.long)).reshape(g, s * k)
    filler = torch.zeros(g, e * c, dtype=torch.long, device=x.device).scatter_add(1, rows.reshape(g, s * k), token)
    source = (filler - 1).clamp(min=0)  # slot -> token of the group (0 where no token came)
    routed = x.gather(1, source.unsqueeze(-1).expand(g, e * c, d))
    return routed.reshape(g, e, c, d).transpose(0, 1).reshape(e, g * c, d), Dispatch(rows, kept, c, e)


def combine(out: torch.Tensor, where: Dispatch, gates: torch.Tensor) -> torch.Tensor:
    """Each token's expert outputs ``out [E, g * C, d]`` gathered back from its slots and summed weighted
    by ``gates [g, s, k]`` (a dropped choice weighs 0): ``[g, s, d]``."""
    g, s, k = where.rows.shape
    e, c, d = where.experts, where.slots_per_expert, out.shape[-1]
    grouped = out.reshape(e, g, c, d).transpose(0, 1).reshape(g, e * c, d)
    picked = grouped.gather(1, where.rows.reshape(g, s * k, 1).expand(g, s * k, d)).reshape(g, s, k, d)
    return (picked * (gates * where.kept).unsqueeze(-1)).sum(dim=2)


def _balance_loss(probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Switch/GShard load-balancing loss ``E * sum_e f_e * p_e`` per group, averaged over groups."""
    share = _one_hot(index, probs.shape[-1], probs.dtype).mean(dim=(1, 2))  # [g, E]: share of k * s assignments
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
        x = x.reshape(b * seq, d).reshape(b * seq // s, s, d)  # via rows: a sequence split over cp stays local
        probs = self.router(x).softmax(dim=-1)
        index, gates = route(probs, cfg.top_k)
        routed, where = dispatch(x, index, cfg.experts, capacity(cfg, s))
        y = combine(self.experts(routed), where, gates)
        return y.reshape(b * seq, d).reshape(b, seq, d), _balance_loss(probs, index)

    def routing(self, seq: int) -> Routing:
        """The layer's routing on sequences of ``seq`` tokens (``routing_facts``)."""
        cfg = self.config
        s = _group_tokens(cfg, seq)
        factor = cfg.capacity_factor if cfg.drop_tokens else None
        return Routing(cfg.experts, cfg.top_k, s, capacity(cfg, s), factor)


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
