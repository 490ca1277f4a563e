"""Small models at the edges of what the planner and runtimes meet in the wild, for parity runs.

Loaded by spec ``edge_models:NAME`` (``build_model`` imports it, in spawned ranks too):

* ``experts``: a stack of expert matrices applied by ``torch.bmm`` to every token (its weights' expert dim is the
  bmm's batch dim, so an ep dim may split them), a mean-squared loss that an ep dim leaves ``Partial(avg)``,
  and a router it never uses (a parameter without a gradient);
* ``grouped_conv``: ``Conv1d`` and ``GroupNorm``, whose DTensor backward fails on a batch split;
* ``einsum_attention``: causal attention written with ``torch.einsum`` and a mask buffer, whose backward under
  tp meets a gradient DTensor lays out otherwise than its spec says (``passes/layout.guard_view_gradients``);
* ``positions``: a second input of positions ``[seq]`` that every sample reads (no batch on its dim 0);
* ``gathered_rows``: ``positions`` with its tables read by advanced indexing, ``weight[ids]`` (``aten.index.Tensor``),
  its positions made in the model and repeated over the batch (Whisper's decoder): a split of the ids leaves each
  table's gradient partial;
* ``upsampled_convs``: convolutions with ``F.interpolate`` between them (bilinear and nearest), which DTensor
  cannot split (no strategy for the ``.vec`` overloads, nor for bilinear's backward);
* ``pooled_tokens``: tokens averaged by ``nn.AdaptiveAvgPool1d`` (FocalNet's and Swinv2's pooler), whose
  ``[b, c, 1, 1]`` mean torch.export restrides with an ``as_strided`` of its size-1 dims;
* ``sequential_blocks``: a stack of ``nn.Sequential`` blocks, each with two numbered ``Linear``s of other
  shapes (``blocks.*.1``, ``blocks.*.3``), that pipelines cut between;
* ``reshaped_blocks``: blocks that flatten their tokens to rows for the MLP and view the sum back (OPT's
  decoder layer), so the value crossing a pipeline stage is a view (guarded by ``layout.guard_view_gradients``);
* ``dropout_blocks``: pre-norm blocks of causal attention with dropout (fused attention's ``dropout_p``, as
  transformers passes it while training) and an MLP with dropout on the hidden and on the residual branch,
  which tensor parallelism leaves replicated on every rank (its masks must agree there);
* ``frozen_blocks``: ``reshaped_blocks`` fine-tuned, its embedding, first block and one matrix of the second
  frozen (``requires_grad=False``): they get no gradient and keep their values, as in single-process training;
* ``lora_blocks``: ``reshaped_blocks`` frozen whole, with low-rank adapters (LoRA, Hu et al. 2021) beside each
  block's ``fc1``, the only parameters trained;
* ``padded_tokens``: ``reshaped_blocks`` whose loss leaves out the targets 0 (``ignore_index``, as padding; parity
  runs draw targets 0 and 1), so microbatches count different numbers of targets;
* ``smoothed_tokens``: ``padded_tokens`` with label smoothing (its loss two quotients by the same count);
* ``summed_regression``: a small regression whose loss is a sum over the batch (``reduction='sum'``);
* ``faint_gradients``: ``reshaped_blocks`` with its loss scaled down 1e-4 times, so that most gradients in its
  backward lie below fp16's smallest normal number (6e-5) and many below its smallest one (6e-8);
* ``straight_through``: ``reshaped_blocks`` whose MLP hidden values are rounded to quarters by a
  ``torch.autograd.Function`` with a straight-through backward (quantization-aware training): the derivative
  of its forward (``round``) is zero, its backward passes the gradient through;
* ``reversed_gradient``: ``reshaped_blocks`` whose head also reads the last hidden state through a gradient
  reversal (a ``Function`` returning a view of its input forward, ``-0.5`` times the gradient backward);
* ``stop_gradient``: ``reshaped_blocks`` whose logits add half the head of the last hidden state detached
  (``h.detach()``: the head gets a gradient from it, the blocks none);
* ``no_grad_teacher``: ``reshaped_blocks`` whose logits add half those of the same blocks run under
  ``torch.no_grad()`` (a teacher's targets: no gradient flows into them);
* ``hooked_forward``: ``reshaped_blocks`` whose forward registers a gradient hook on its last hidden state
  (refused: a captured step keeps no hooks);
* ``batch_normed_convs``: residual blocks of convolutions and BatchNorm with running statistics (ResNet's), and a
  step counter buffer the forward increments: a step that writes its buffers;
* ``written_unread``: blocks that each write their input's mean into a buffer they never read (a pipeline stage
  holds it all the same);
* ``counted_blocks``: blocks that read a step counter the model writes before them (a pipeline would hold a copy
  per stage: refused);
* ``clamped_activations``: ReLU6, Hardtanh, LeakyReLU, ELU and SELU, whose backward kernels DTensor had no rule for;
* ``learned_attention_bias``: fused attention whose float mask is a learned relative position bias of batch size 1
  (Swin's), whose gradient a batch split leaves partial;
* ``spectral_normed``: spectral normalization, whose power iteration writes its buffers at every forward;
* ``random_function``: ``reshaped_blocks`` whose head reads its hidden state through a ``torch.autograd.Function``
  that draws random noise in its forward (refused);
* ``column_blocks``: blocks with a ``Linear(1, width)`` read transposed (Mamba's ``dt_proj``), which FSDP gathers
  and views back from a column block of the layer's gathered buffer;
* ``sequence_first_attention``: einsum attention on ``[seq, batch, heads, dim]`` values (XLNet's), whose views
  under tp read a value a redistribute laid out otherwise than the trace saw.
* ``depth_scaled_blocks``: ``reshaped_blocks`` whose residual branches are scaled by a constant of their depth
  (DiffLlama's per-layer ``lambda_init``): alike layers, though their ops' float arguments differ.
* ``alternating_blocks``: ``reshaped_blocks`` whose odd blocks are wider gated MLPs (layers alike every other one,
  as Jamba's mixture-of-experts layers are): pipelines cut between pairs of layers;
* ``pooled_convs``: convolutions mixing tokens by average pooling (PoolFormer's) and reduced by adaptive max
  pooling, whose backward kernels DTensor had no rule for;
* ``channel_first_blocks``: blocks over ``[batch, channels, seq]`` values that normalize their channels through a
  permute (SqueezeBERT's), so the gradient of a value a pipeline stage receives is strided.
* ``dense_first_blocks``: a gated MLP block, then blocks that write their update into an empty tensor half by half
  (``copy_`` and a slice assignment, as DeepSeek-V3's latent attention writes its queries): alike layers after a
  first one that is not (DeepSeek-V3's dense first layers), which a pipeline's first stage holds beside its share.
* ``encoder_decoder_blocks``: an encoder of blocks, then decoder blocks that each read the encoder's output (as
  cross-attention does): a pipeline cuts the decoder, the first stage holding the encoder, whose output every
  stage passes on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    def __init__(self, width: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.router = nn.Linear(width, experts)  # unused: no gradient, in single-process training too
        self.w1 = nn.Parameter(torch.randn(experts, width, 2 * width) / 4)
        self.w2 = nn.Parameter(torch.randn(experts, 2 * width, width) / 4)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        b, t, d = h.shape
        tokens = h.reshape(1, b * t, d).expand(self.w1.shape[0], b * t, d)
        y = torch.bmm(torch.bmm(tokens, self.w1).relu(), self.w2)
        return self.out(y.mean(0).reshape(b, t, d)).squeeze(-1)


def experts(global_batch: int = 8, seq: int = 8):
    return Experts(), torch.randn(global_batch, seq, 8), torch.randn(global_batch, seq), F.mse_loss


class GroupedConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.silu(self.norm(self.conv(x))).mean(-1))


def grouped_conv(global_batch: int = 8, seq: int = 32):
    return GroupedConv(), torch.randn(global_batch, 4, seq), torch.randint(0, 5, (global_batch,)), F.cross_entropy


class SequentialBlocks(nn.Module):
    def __init__(self, vocab: int = 40, width: int = 24, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.SiLU(),
                                                  nn.Linear(2 * width, width)) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def sequential_blocks(global_batch: int = 8, seq: int = 12, layers: int = 4):
    loss = lambda out, targets: F.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    return (SequentialBlocks(layers=layers), torch.randint(0, 40, (global_batch, seq)),
            torch.randint(0, 40, (global_batch, seq)), loss)


class Positions(nn.Module):
    def __init__(self, vocab: int = 16, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(32, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.tokens(idx) + self.positions(pos)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.head(h)


def positions(global_batch: int = 8, seq: int = 6):
    loss = lambda out, targets: F.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    return (Positions(), (torch.randint(0, 16, (global_batch, seq)), torch.arange(seq)),
            torch.randint(0, 16, (global_batch, seq)), loss)


class GatheredRows(nn.Module):
    def __init__(self, vocab: int = 16, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)  # read as tables, ``weight[ids]``, not called
        self.positions = nn.Embedding(32, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape
        pos = torch.arange(s).unsqueeze(0).repeat(b, 1)  # as Whisper's decoder positions: every sample's
        h = self.tokens.weight[idx] + self.positions.weight[pos]
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.head(h)


def gathered_rows(global_batch: int = 8, seq: int = 6):
    loss = lambda out, targets: F.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    return GatheredRows(), (torch.randint(0, 16, (global_batch, seq)),), torch.randint(0, 16, (global_batch, seq)), loss


class EinsumAttention(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(q=nn.Linear(width, width), k=nn.Linear(width, width),
                                                       v=nn.Linear(width, width), o=nn.Linear(width, width),
                                                       norm=nn.LayerNorm(width, elementwise_affine=False)))
                                    for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            y = block["norm"](h)
            q, k, v = block["q"](y), block["k"](y), block["v"](y)
            scores = torch.einsum("btd,bsd->bts", q, k) / q.shape[-1] ** 0.5
            scores = scores.masked_fill(self.mask, float("-inf"))
            h = h + block["o"](torch.einsum("bts,bsd->btd", scores.softmax(-1), v))
        return self.head(h)


def einsum_attention(global_batch: int = 8, seq: int = 16):
    loss = lambda out, targets: F.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    return (EinsumAttention(seq=seq), torch.randint(0, 64, (global_batch, seq)),
            torch.randint(0, 64, (global_batch, seq)), loss)


class DropoutBlock(nn.Module):
    def __init__(self, width: int, p: float, heads: int = 4) -> None:
        super().__init__()
        self.p, self.heads = p, heads
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.attn_norm(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        h = h + attended.transpose(1, 2).reshape(b, t, d)
        return h + self.drop(self.fc2(self.drop(F.gelu(self.fc1(self.norm(h))))))


class DropoutBlocks(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2, p: float = 0.3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(DropoutBlock(width, p) for _ in range(layers)))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(idx)))


def dropout_blocks(global_batch: int = 4, seq: int = 8):
    loss = lambda out, targets: F.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    return (DropoutBlocks(), torch.randint(0, 64, (global_batch, seq)), torch.randint(0, 64, (global_batch, seq)),
            loss)


class ReshapedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        rows = h.reshape(-1, shape[-1])
        return (rows + self.fc2(F.gelu(self.fc1(self.norm(rows))))).view(shape)


class ReshapedBlocks(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(ReshapedBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(idx))


def reshaped_blocks(global_batch: int = 8, seq: int = 8):
    loss = lambda out, targets: F.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    return (ReshapedBlocks(), torch.randint(0, 64, (global_batch, seq)), torch.randint(0, 64, (global_batch, seq)),
            loss)


FROZEN_IN_BLOCKS = ("emb.", "blocks.0.", "blocks.1.fc1.weight")
"""The parameters ``frozen_blocks`` freezes: those whose names start so."""


def frozen_blocks(global_batch: int = 8, seq: int = 8):
    model, tokens, targets, loss = reshaped_blocks(global_batch, seq)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN_IN_BLOCKS))
    return model, tokens, targets, loss


class LowRankAdapted(nn.Module):
    """A frozen linear layer plus a trained low-rank update: ``base(x) + scale * x A^T B^T``."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features ** 0.5)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) / 16)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t() @ self.b.t()) * self.scale


def lora_blocks(global_batch: int = 8, seq: int = 8):
    model, tokens, targets, loss = reshaped_blocks(global_batch, seq)
    model.requires_grad_(False)
    for block in model.blocks:
        block.fc1 = LowRankAdapted(block.fc1)
    return model, tokens, targets, loss


def padded_tokens(global_batch: int = 8, seq: int = 8):
    model, tokens, targets, _ = reshaped_blocks(global_batch, seq)
    loss = lambda out, t: F.cross_entropy(out.flatten(0, 1), torch.where(t == 0, -100, t).flatten())  # noqa: E731
    return model, tokens, targets, loss


def smoothed_tokens(global_batch: int = 8, seq: int = 8):
    model, tokens, targets, _ = reshaped_blocks(global_batch, seq)
    loss = lambda out, t: F.cross_entropy(out.flatten(0, 1), torch.where(t == 0, -100, t).flatten(),  # noqa: E731
                                          label_smoothing=0.1)
    return model, tokens, targets, loss


def summed_regression(global_batch: int = 8, seq: int = 8):
    model = nn.Sequential(nn.Linear(seq, 16), nn.Tanh(), nn.Linear(16, 1))
    loss = lambda out, t: F.mse_loss(out, t, reduction="sum")  # noqa: E731
    return model, torch.randn(global_batch, seq), torch.randn(global_batch, 1), loss


def faint_gradients(global_batch: int = 8, seq: int = 8):
    model, tokens, targets, loss = reshaped_blocks(global_batch, seq)
    return model, tokens, targets, lambda out, t: loss(out, t) * 1e-4


class RoundToQuarter(torch.autograd.Function):
    """Forward: round to a multiple of 1/4. Backward: the gradient as it is (straight through)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad


class StraightThroughBlock(ReshapedBlock):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        rows = h.reshape(-1, shape[-1])
        return (rows + self.fc2(RoundToQuarter.apply(F.gelu(self.fc1(self.norm(rows)))))).view(shape)


def straight_through(global_batch: int = 8, seq: int = 8):
    model, tokens, targets, loss = reshaped_blocks(global_batch, seq)
    model.blocks = nn.ModuleList(StraightThroughBlock(32) for _ in model.blocks)
    return model, tokens, targets, loss


def _next_tokens(model: nn.Module, global_batch: int, seq: int):
    """``model`` (``reshaped_blocks``' vocabulary) with random tokens, targets and a token cross-entropy."""
    loss = lambda out, targets: F.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    return model, torch.randint(0, 64, (global_batch, seq)), torch.randint(0, 64, (global_batch, seq)), loss


class ReverseGradient(torch.autograd.Function):
    """Forward: the input (a view of it). Backward: ``-scale`` times the gradient (domain-adversarial training)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN001
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return -ctx.scale * grad, None


class ReversedHead(ReshapedBlocks):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.hidden(idx)
        return self.head(h) + self.head(ReverseGradient.apply(h, 0.5))


def reversed_gradient(global_batch: int = 8, seq: int = 8):
    return _next_tokens(ReversedHead(), global_batch, seq)


class StopGradient(ReshapedBlocks):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.hidden(idx)
        return self.head(h) + 0.5 * self.head(h.detach())


def stop_gradient(global_batch: int = 8, seq: int = 8):
    return _next_tokens(StopGradient(), global_batch, seq)


class NoGradTeacher(ReshapedBlocks):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        student = super().forward(idx)
        with torch.no_grad():
            teacher = super().forward(idx)
        return student + 0.5 * teacher


def no_grad_teacher(global_batch: int = 8, seq: int = 8):
    return _next_tokens(NoGradTeacher(), global_batch, seq)


class HookedForward(ReshapedBlocks):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.hidden(idx)
        h.register_hook(lambda grad: grad * 2)
        return self.head(h)


def hooked_forward(global_batch: int = 8, seq: int = 8):
    return _next_tokens(HookedForward(), global_batch, seq)


class NormedConvBlock(nn.Module):
    """A residual block of two convolutions, each followed by BatchNorm with running statistics (ResNet's)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm1d(channels)
        self.conv2 = nn.Conv1d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm1d(channels, momentum=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class NormedConvNet(nn.Module):
    def __init__(self, channels: int = 8, blocks: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv1d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(NormedConvBlock(channels) for _ in range(blocks))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1  # a counter of forwards, written each one
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(-1))


def batch_normed_convs(global_batch: int = 8, seq: int = 16):
    """``NormedConvNet`` on ``[batch, 3, seq]`` signals, classified by cross-entropy."""
    return NormedConvNet(), torch.randn(global_batch, 3, seq), torch.randint(0, 5, (global_batch,)), F.cross_entropy


class SeenBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("seen", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.copy_(x.detach().mean(0))  # written, never read
        return x + torch.tanh(self.fc(x))


class SeenBlocks(nn.Module):
    def __init__(self, width: int = 8, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList(SeenBlock(width) for _ in range(blocks))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def written_unread(global_batch: int = 8, seq: int = 8):
    """``SeenBlocks``: each block writes its input's mean into a buffer it never reads."""
    return SeenBlocks(), torch.randn(global_batch, 6), torch.randint(0, 3, (global_batch,)), F.cross_entropy


class CountedBlock(SeenBlock):
    def forward(self, x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1 + 0.01 * steps)


class CountedBlocks(SeenBlocks):
    def __init__(self, width: int = 8, blocks: int = 4) -> None:
        super().__init__(width, blocks)
        self.blocks = nn.ModuleList(CountedBlock(width) for _ in range(blocks))
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, self.steps)
        return self.out(h)


def counted_blocks(global_batch: int = 8, seq: int = 8):
    """``SeenBlocks`` whose blocks scale their output by a step counter the model writes before them."""
    return CountedBlocks(), torch.randn(global_batch, 6), torch.randint(0, 3, (global_batch,)), F.cross_entropy


class ClampedActivations(nn.Module):
    """An MLP through the activations whose backward kernels DTensor has no rule for by itself (``ir/dtensor_rules``):
    ReLU6 and Hardtanh (``hardtanh``), LeakyReLU, ELU and SELU (``elu``)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.acts = nn.ModuleList([nn.ReLU6(), nn.Hardtanh(-0.5, 0.5), nn.LeakyReLU(0.1), nn.ELU(), nn.SELU()])
        self.fcs = nn.ModuleList(nn.Linear(8 if i == 0 else width, width) for i in range(len(self.acts)))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc, act in zip(self.fcs, self.acts):
            x = act(fc(x) * 4)  # past the clamps, so that their gradient cut matters
        return self.out(x)


def clamped_activations(global_batch: int = 8, seq: int = 8):
    return ClampedActivations(), torch.randn(global_batch, 8), torch.randint(0, 3, (global_batch,)), F.cross_entropy


class LearnedAttentionBias(nn.Module):
    """Attention whose additive mask is a learned relative position bias (Swin's, T5's): ``[1, heads, seq, seq]``
    gathered from a table by a fixed index, passed to fused attention as its float ``attn_mask``."""

    def __init__(self, seq: int = 8, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.seq = heads, seq
        self.qkv = nn.Linear(width, 3 * width)
        self.table = nn.Parameter(torch.randn(2 * seq - 1, heads) / 2)
        offsets = torch.arange(seq)[:, None] - torch.arange(seq)[None, :] + seq - 1
        self.register_buffer("index", offsets.reshape(-1), persistent=False)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.table[self.index].view(n, n, self.heads).permute(2, 0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(attended.transpose(1, 2).reshape(b, n, d).mean(1))


def learned_attention_bias(global_batch: int = 8, seq: int = 8):
    return (LearnedAttentionBias(seq), torch.randn(global_batch, seq, 16), torch.randint(0, 3, (global_batch,)),
            F.cross_entropy)


class SpectralNormed(nn.Module):
    """Linear layers under spectral normalization (``torch.nn.utils.parametrizations.spectral_norm``), whose power
    iteration updates its ``_u`` and ``_v`` buffers in place at every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16))
        self.fc2 = nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16))
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


def spectral_normed(global_batch: int = 8, seq: int = 8):
    return SpectralNormed(), torch.randn(global_batch, 8), torch.randint(0, 3, (global_batch,)), F.cross_entropy


class NoisyScale(torch.autograd.Function):
    """Multiplies by random noise drawn in the forward, saved for the backward: a Function autopar refuses (it runs
    a Function's forward again for its backward, which would draw other noise)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        noise = torch.rand_like(x) + 0.5
        ctx.save_for_backward(noise)
        return x * noise

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (noise,) = ctx.saved_tensors
        return grad * noise


class NoisyBlocks(ReshapedBlocks):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(NoisyScale.apply(self.hidden(idx)))


def random_function(global_batch: int = 8, seq: int = 8):
    return _next_tokens(NoisyBlocks(), global_batch, seq)


class ColumnBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.gate = nn.Linear(1, width, bias=False)  # weight [width, 1], read transposed: [1, width]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * self.gate(x.mean(-1, keepdim=True))


class ColumnBlocks(nn.Module):
    """Blocks whose ``Linear(1, width)`` weight is read transposed, ``[1, width]`` (Mamba's ``dt_proj``): FSDP over
    2 ranks splits it, DTensor gathers it on dim 0 and views it back, and the block's gathered parameters come out
    of one buffer (a column block of it, which that view needs contiguous)."""

    def __init__(self, width: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ColumnBlock(width) for _ in range(blocks))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def column_blocks(global_batch: int = 8, seq: int = 8):
    return ColumnBlocks(), torch.randn(global_batch, 16), torch.randint(0, 3, (global_batch,)), F.cross_entropy


class SequenceFirstAttention(nn.Module):
    """Attention on ``[seq, batch, heads, dim]`` values written with ``torch.einsum`` (XLNet's relative attention),
    whose decomposed permutes and views under tp read values a redistribute lays out otherwise than the trace."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Parameter(torch.randn(width, heads, width // heads) / 4)
        self.k = nn.Parameter(torch.randn(width, heads, width // heads) / 4)
        self.v = nn.Parameter(torch.randn(width, heads, width // heads) / 4)
        self.bias = nn.Parameter(torch.randn(heads, width // heads) / 4)
        self.o = nn.Parameter(torch.randn(width, heads, width // heads) / 4)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(0, 1)  # [seq, batch, width]
        q, k, v = (torch.einsum("ibh,hnd->ibnd", h, w) for w in (self.q, self.k, self.v))
        scores = torch.einsum("ibnd,jbnd->bnij", q + self.bias, k) / 4
        attended = torch.einsum("bnij,jbnd->ibnd", scores.softmax(-1), v)
        y = torch.einsum("ibnd,hnd->ibh", attended, self.o)
        return self.out(y.mean(0))


def sequence_first_attention(global_batch: int = 8, seq: int = 8):
    return (SequenceFirstAttention(), torch.randn(global_batch, seq, 16), torch.randint(0, 3, (global_batch,)),
            F.cross_entropy)


class DepthScaledBlock(ReshapedBlock):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__(width)
        self.scale = 0.8 - 0.6 * math.exp(-0.3 * depth)  # a Python float: a constant of the traced graph

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.scale * self.fc2(F.gelu(self.fc1(self.norm(h))))


class DepthScaledBlocks(ReshapedBlocks):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DepthScaledBlock(32, depth) for depth in range(len(self.blocks)))


def depth_scaled_blocks(global_batch: int = 8, seq: int = 8):
    _, tokens, targets, loss = reshaped_blocks(global_batch, seq)
    return DepthScaledBlocks(), tokens, targets, loss


class GatedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.gate = nn.Linear(width, 4 * width, bias=False)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))


class AlternatingBlocks(ReshapedBlocks):
    def __init__(self, layers: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GatedBlock(32) if i % 2 else ReshapedBlock(32) for i in range(layers))


def alternating_blocks(global_batch: int = 8, seq: int = 8, layers: int = 8):
    _, tokens, targets, loss = reshaped_blocks(global_batch, seq)
    return AlternatingBlocks(layers), tokens, targets, loss


class PooledConvs(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.mix = nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
        self.conv = nn.Conv2d(channels, channels, 1)
        self.reduce = nn.AdaptiveMaxPool2d(1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = h + self.conv(self.mix(h) - h)
        return self.head(self.reduce(h).flatten(1))


def pooled_convs(global_batch: int = 8, seq: int = 8):
    return PooledConvs(), torch.randn(global_batch, 3, seq, seq), torch.randint(0, 3, (global_batch,)), F.cross_entropy


class UpsampledConvs(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(self.stem(x), scale_factor=2, mode="bilinear", align_corners=False)
        h = F.interpolate(self.conv(h), size=(3 * x.shape[-2], 3 * x.shape[-1]), mode="nearest")
        return self.head(h.mean((2, 3)))


def upsampled_convs(global_batch: int = 8, seq: int = 6):
    return UpsampledConvs(), torch.randn(global_batch, 3, seq, seq), torch.randint(0, 3, (global_batch,)), \
        F.cross_entropy


class PooledTokens(nn.Module):
    def __init__(self, width: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, tokens, width]
        return self.head(self.pool(torch.relu(self.proj(x)).transpose(1, 2)).flatten(1))


def pooled_tokens(global_batch: int = 8, seq: int = 6):
    return PooledTokens(), torch.randn(global_batch, seq, 16), torch.randint(0, 3, (global_batch,)), F.cross_entropy


class ChannelFirstBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.conv = nn.Conv1d(width, width, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [batch, channels, seq]
        return self.conv(self.norm(h.permute(0, 2, 1)).permute(0, 2, 1))


class ChannelFirstBlocks(ReshapedBlocks):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ChannelFirstBlock(32) for _ in range(len(self.blocks)))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).permute(0, 2, 1)
        for block in self.blocks:
            h = block(h)
        return h.permute(0, 2, 1)


def channel_first_blocks(global_batch: int = 8, seq: int = 8):
    _, tokens, targets, loss = reshaped_blocks(global_batch, seq)
    return ChannelFirstBlocks(), tokens, targets, loss


class HalvesWrittenBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.left = nn.Linear(width, width // 2)
        self.right = nn.Linear(width, width - width // 2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x, half = self.norm(h), h.shape[-1] // 2
        update = h.new_empty(h.shape)
        update[..., :half].copy_(self.left(x))
        update[..., half:] = F.gelu(self.right(x))
        return h + update


class DenseFirstBlocks(ReshapedBlocks):
    def __init__(self, layers: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(HalvesWrittenBlock(32) if i else GatedBlock(32) for i in range(layers))


def dense_first_blocks(global_batch: int = 8, seq: int = 8, layers: int = 5):
    _, tokens, targets, loss = reshaped_blocks(global_batch, seq)
    return DenseFirstBlocks(layers), tokens, targets, loss


class MemoryReadingBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.cross = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return h + self.mix(F.gelu(self.norm(h))) + self.cross(memory)


class EncoderDecoderBlocks(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.encoder = nn.ModuleList(ReshapedBlock(width) for _ in range(layers))
        self.decoder = nn.ModuleList(MemoryReadingBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        memory = self.emb(idx)
        for block in self.encoder:
            memory = block(memory)
        h = self.emb(idx.flip(1))
        for block in self.decoder:
            h = block(h, memory)
        return self.head(h)


def encoder_decoder_blocks(global_batch: int = 8, seq: int = 8):
    _, tokens, targets, loss = reshaped_blocks(global_batch, seq)
    return EncoderDecoderBlocks(), tokens, targets, loss
