"""Hugging Face ``transformers`` models as autopar plans and runs them.

``transformers`` is an optional extra (``pip install autopar[hf]``), imported only inside the functions
that build a model, so importing this module needs nothing but torch. Nothing is downloaded: every
model is built from a config object with random weights.

``HFModel`` wraps a model so that its forward takes plain positional tensors, in the order of
``input_names`` (keyword arguments such as ``attention_mask`` and ``labels`` become positions: autopar
captures and shards positional inputs), and returns one tensor: the logits (``output="logits"``, the
loss then an ordinary ``loss_fn(logits, targets)``) or the loss the model computes itself from
``labels=`` (``output="loss"``, the labels then the last input and the loss function ``model_loss``).

The factories (``gpt2``, ``llama``, ``mistral``, ``mixtral``, ``qwen2``, ``bert``, ``t5``, ``vit``) build tiny
configurations and return what ``autopar.models.registry`` expects of ``package.module:factory``, so
``autopar plan autopar.models.hf:gpt2 --cluster 1x8xH100`` plans one. Each takes ``global_batch`` and
``seq``, ``layers``/``hidden``/``heads``/``vocab`` to size it, ``mask`` (pass an attention mask,
padding the end of each sequence) and ``own_loss`` (the model's loss from ``labels=``); ViT takes
``image``, ``patch`` and ``classes`` in place of ``seq``, ``vocab`` and ``mask``.

``use_permuted_experts`` sets up the experts of any transformers mixture-of-experts model (Mixtral's here, a
user's Qwen2-MoE, DeepSeek-V3 or gpt-oss) to run ``permuted_experts_forward`` (``models/moe.py``'s token
permutation, registered in transformers' ``ExpertsInterface``), so that expert parallelism splits them.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autopar.core.errors import BadInputError

from .moe import Routing, combine, dispatch, slots_per_expert

__all__ = ["HFModel", "model_loss", "padding_mask", "permuted_experts_forward", "token_loss", "unpermuted_experts",
           "use_permuted_experts",
           "gpt2", "llama", "mistral", "mixtral", "qwen2", "bert", "t5", "vit"]

Factory = tuple[Any, ...]
"""What a factory returns (``models/registry.py``): ``(model, inputs, targets, loss_fn)``, or
``(model, inputs, loss_fn)`` when the model returns its own loss."""


class HFModel(nn.Module):
    """A ``transformers`` model called with positional tensors named ``input_names``, returning its
    ``output`` (``"logits"`` or ``"loss"``) as one tensor. ``classes`` is the range of its class ids
    (token ids, labels): ``random_batch`` draws batches like the example one."""

    def __init__(self, model: nn.Module, input_names: Sequence[str], output: str, classes: int):
        super().__init__()
        if output not in ("logits", "loss"):
            raise BadInputError(f"HFModel output={output!r}: expected 'logits' or 'loss'")
        self.hf = model
        self.input_names = tuple(input_names)
        self.output = output
        self.classes = classes
        self.config = model.config

    def forward(self, *inputs: Tensor) -> Tensor:
        outputs = self.hf(**dict(zip(self.input_names, inputs)), **_no_cache(self.hf), return_dict=True)
        return getattr(outputs, self.output)

    def reset_parameters(self) -> None:
        """transformers' own initialization of the wrapped model (``init_weights``), as torch's convention
        names it: what a model built on the meta device gets on its shards (``runtime/deferred_init.py``)."""
        self.hf.init_weights()

    def random_batch(self, generator: torch.Generator, like: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """A batch shaped as ``like`` (the inputs, then the targets if any) drawn from ``generator``:
        class ids in ``[0, classes)``, attention masks padding each sequence to a random length
        (``padding_mask``), floats from a standard normal."""
        names = self.input_names + ("targets",) * (len(like) - len(self.input_names))
        return tuple(self._draw(name, t, generator) for name, t in zip(names, like))

    def _draw(self, name: str, like: Tensor, generator: torch.Generator) -> Tensor:
        if like.dtype.is_floating_point:
            return torch.randn(like.shape, generator=generator, dtype=like.dtype)
        if name.endswith("attention_mask"):
            return padding_mask(*like.shape, generator=generator).to(like.dtype)
        return torch.randint(0, self.classes, like.shape, generator=generator, dtype=like.dtype)


def _no_cache(model: nn.Module) -> dict[str, bool]:
    """``use_cache=False`` for a model that keeps a KV cache (training runs no generation)."""
    return {"use_cache": False} if getattr(model.config, "use_cache", None) is not None else {}


def model_loss(loss: Tensor) -> Tensor:
    """The loss function of a model that returns its own loss: the loss as it is."""
    return loss


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over every position: ``logits [..., C]``, ``targets [...]`` class ids."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def padding_mask(batch: int, seq: int, generator: torch.Generator | None = None) -> Tensor:
    """An attention mask ``[batch, seq]`` (1 attend, 0 padding) padding each sequence at its end to a
    random length in ``[1, seq]``, so that every position can attend to the first."""
    lengths = torch.randint(1, seq + 1, (batch, 1), generator=generator)
    return (torch.arange(seq) < lengths).long()


def _transformers() -> Any:
    """``transformers``, kept off the Hub (every model here is built from a config)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise BadInputError("the Hugging Face models need transformers: pip install 'autopar[hf]'") from None
    return transformers


def _ids(classes: int, *shape: int) -> Tensor:
    return torch.randint(0, classes, shape)


def _result(model: nn.Module, inputs: dict[str, Tensor], targets: Tensor, classes: int, own_loss: bool) -> Factory:
    """What a factory returns: the wrapped model, its positional inputs, and the targets with
    ``token_loss``; with ``own_loss`` the targets are the last input, ``labels``, and the loss the model's."""
    if own_loss:
        inputs = {**inputs, "labels": targets}
        return HFModel(model, list(inputs), "loss", classes), tuple(inputs.values()), model_loss
    return HFModel(model, list(inputs), "logits", classes), tuple(inputs.values()), targets, token_loss


def _token_inputs(vocab: int, global_batch: int, seq: int, mask: bool) -> dict[str, Tensor]:
    inputs = {"input_ids": _ids(vocab, global_batch, seq)}
    if mask:
        inputs["attention_mask"] = padding_mask(global_batch, seq)
    return inputs


def _language_model(auto_class: str, config: Any, global_batch: int, seq: int, mask: bool,
                    own_loss: bool) -> Factory:
    """A model of ``transformers.<auto_class>`` from ``config`` on ``(input_ids[, attention_mask])``, its
    targets one token id per position."""
    model = getattr(_transformers(), auto_class).from_config(config, attn_implementation="sdpa")
    vocab = config.vocab_size
    return _result(model, _token_inputs(vocab, global_batch, seq, mask), _ids(vocab, global_batch, seq), vocab,
                   own_loss)


def _decoder_config(name: str, layers: int, hidden: int, heads: int, vocab: int, seq: int, **extra: Any) -> Any:
    """A Llama-style decoder config ``transformers.<name>`` (grouped-query attention with half the heads)."""
    return getattr(_transformers(), name)(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), intermediate_size=2 * hidden, vocab_size=vocab,
        max_position_embeddings=max(seq, 16), bos_token_id=0, eos_token_id=1, pad_token_id=None, **extra)


def gpt2(global_batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
         vocab: int = 128, mask: bool = False, own_loss: bool = False) -> Factory:
    """GPT-2, its ``lm_head`` tied to the token embedding ``wte``."""
    config = _transformers().GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=max(seq, 16),
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
    return _language_model("AutoModelForCausalLM", config, global_batch, seq, mask, own_loss)


def llama(global_batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
          vocab: int = 128, mask: bool = False, own_loss: bool = False) -> Factory:
    """Llama with its output layer tied to the input embedding, as the small Llama 3.2 models."""
    config = _decoder_config("LlamaConfig", layers, hidden, heads, vocab, seq, tie_word_embeddings=True)
    return _language_model("AutoModelForCausalLM", config, global_batch, seq, mask, own_loss)


def mistral(global_batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
            vocab: int = 128, mask: bool = False, own_loss: bool = False) -> Factory:
    """Mistral (untied output layer)."""
    config = _decoder_config("MistralConfig", layers, hidden, heads, vocab, seq, sliding_window=None)
    return _language_model("AutoModelForCausalLM", config, global_batch, seq, mask, own_loss)


PERMUTED_EXPERTS = "autopar_permuted"
"""The ``experts_implementation`` ``use_permuted_experts`` sets: ``permuted_experts_forward``, registered in
transformers' ``ExpertsInterface``."""


def mixtral(global_batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
            vocab: int = 128, experts: int = 4, mask: bool = False, own_loss: bool = False) -> Factory:
    """Mixtral: Mistral with a mixture of ``experts`` MLPs, two per token, set up by ``use_permuted_experts``
    so that a pinned ``ep`` splits them on their expert dim."""
    config = _decoder_config("MixtralConfig", layers, hidden, heads, vocab, seq, num_local_experts=experts,
                             num_experts_per_tok=2, sliding_window=None)
    built = _language_model("AutoModelForCausalLM", config, global_batch, seq, mask, own_loss)
    use_permuted_experts(built[0], seq)
    return built


TOP_K_NAMES = ("num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k")
"""What transformers configs call the experts each token is routed to (in 5.25: 73, 3, 1 and 2 config classes;
Aria's and Hunyuan's ``moe_topk``)."""


def use_permuted_experts(model: nn.Module, seq: int, top_k: int | None = None,
                         capacity_factor: float | None = None) -> nn.Module:
    """Run every experts module of a transformers mixture-of-experts model with ``permuted_experts_forward``,
    so that autopar can split its experts over an ``ep`` dim; returns ``model`` (a transformers model or an
    ``HFModel`` around one).

    The experts modules are those transformers' ``use_experts_implementation`` decorates (Mixtral, Qwen2/3-MoE,
    DeepSeek-V3, OLMoE, gpt-oss and the other families of its ``ExpertsInterface``); their own implementations
    pick each expert's tokens with data-dependent shapes (``eager``) or read the weights through one op that
    hides the expert dim (``grouped_mm``). Each module routes groups of ``seq`` tokens (a sequence: build it
    with the sequence length it trains on) and states that routing for the plan (``Plan.model["moe"]``) with
    ``top_k`` experts a token (by default the config's, ``TOP_K_NAMES``). A token's ``top_k`` choices are taken to
    be distinct experts, as top-k routing makes them: a routing that sends a token to one expert twice (DeepSeek-V4's
    hash layers with an untrained, all-zero table) takes two of its slots, so dropless holds only for distinct ones.

    ``capacity_factor`` None (the default): a slot per token of its group in every expert, so no token is
    dropped, as in transformers' own; the experts' matmuls then run on ``E`` times a group's tokens, ``E / k``
    times the routed work (4x for Mixtral, 32x for gpt-oss). A factor: ``ceil(capacity_factor * k * seq / E)``
    slots per (group, expert), as autopar's own mixture of experts (``models/moe.py``, GShard's policy): a
    choice past its expert's capacity is dropped, the residual carrying its token, and the plan prices the
    matmuls and all_to_alls at that capacity. Expert biases (gpt-oss) are not expert weights to the planner (it
    finds those by the batched matmuls that read them): they stay whole on every ep rank, small beside them."""
    if capacity_factor is not None and not capacity_factor > 0:
        raise BadInputError(f"use_permuted_experts: capacity_factor must be > 0 (None: no token dropped), "
                            f"got {capacity_factor!r}")
    transformers = _transformers()
    transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS.register(PERMUTED_EXPERTS, permuted_experts_forward)
    hf_model = model.hf if isinstance(model, HFModel) else model
    experts = [module for module in hf_model.modules() if hasattr(module, "is_transposed")]  # the decorator's
    if not experts:
        raise BadInputError(f"{type(hf_model).__name__} has no experts module of transformers' ExpertsInterface "
                            "(a class decorated with use_experts_implementation): nothing to permute")
    hf_model.set_experts_implementation(PERMUTED_EXPERTS)
    for module in experts:
        k = top_k or next((getattr(module.config, name) for name in TOP_K_NAMES
                           if getattr(module.config, name, None)), None)
        if not k:
            raise BadInputError(f"{type(module).__name__}'s config has none of {', '.join(TOP_K_NAMES)}: pass "
                                "use_permuted_experts(model, seq, top_k=...) the experts each token is routed to")
        experts_count = int(module.down_proj.shape[0])
        module.group_tokens = seq
        module.expert_slots = slots_per_expert(capacity_factor, int(k), experts_count, seq)
        module.routing = _routing(Routing(experts_count, int(k), seq, module.expert_slots, capacity_factor))
    return model


def unpermuted_experts(model: nn.Module) -> list[str]:
    """The classes of ``model``'s transformers experts modules (``ExpertsInterface``'s, as ``use_permuted_experts``
    finds them) that run an implementation of transformers' own, not ``permuted_experts_forward``: their tokens
    are picked with data-dependent shapes or their weights read through one grouped op, which no mesh dim splits
    (those ops run replicated on every rank)."""
    return sorted({type(module).__name__ for module in model.modules() if hasattr(module, "is_transposed")
                   and getattr(getattr(module, "config", None), "_experts_implementation", None) != PERMUTED_EXPERTS})


def permuted_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                             top_k_weights: Tensor) -> Tensor:
    """A transformers experts module (stacked weights ``gate_up_proj``, or ``up_proj`` without a gate, and
    ``down_proj``: ``[E, out, in]``, or ``[E, in, out]`` where ``is_transposed``, each with an ``[E, out]``
    bias where ``has_bias``) on ``hidden_states [n, d]`` routed to ``top_k_index [n, k]`` with weights
    ``top_k_weights [n, k]``, as ``models/moe.py`` runs its own: tokens permuted into ``[E, groups x C, d]``
    slots per group of ``group_tokens`` (a sequence), ``expert_slots`` of them (``C``: the group's tokens, none
    dropped, or a capacity; ``use_permuted_experts``),
    batched matmuls, the module's own gate (``_apply_gate``) or activation and post-expert norm between them,
    and combined back. ``use_permuted_experts`` sets the modules up."""
    n, d = hidden_states.shape
    s = getattr(self, "group_tokens", None)
    if s is None:
        raise BadInputError(f"{type(self).__name__} runs autopar's permuted experts without a group size: set the "
                            "model up with autopar.models.hf.use_permuted_experts(model, seq)")
    if n % s:
        raise BadInputError(f"this {type(self).__name__} routes tokens in groups of its seq ({s}); got {n} tokens, "
                            "not a multiple: set it up with the sequence length it runs on")
    g, k = n // s, top_k_index.shape[-1]
    routed, where = dispatch(hidden_states.reshape(g, s, d), top_k_index.reshape(g, s, k),
                             self.down_proj.shape[0], self.expert_slots)
    if getattr(self, "has_gate", True):
        hidden = self._apply_gate(_experts_linear(self, routed, "gate_up_proj"))
    else:
        hidden = self.act_fn(_experts_linear(self, routed, "up_proj"))
    out = _experts_linear(self, hidden, "down_proj")
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    return combine(out, where, top_k_weights.reshape(g, s, k).to(out.dtype)).reshape(n, d)


def _experts_linear(experts: nn.Module, x: Tensor, name: str) -> Tensor:
    """``x [E, slots, in]`` through the experts' stacked weight ``name`` and its ``name_bias``, if any."""
    weight = getattr(experts, name)
    y = torch.bmm(x, weight if getattr(experts, "is_transposed", False) else weight.transpose(1, 2))
    return y + getattr(experts, f"{name}_bias").unsqueeze(1) if getattr(experts, "has_bias", False) else y


def _routing(routing: Routing) -> Callable[[int], Routing]:
    """An experts module's ``routing`` (``moe.routing_facts``): the one ``use_permuted_experts`` set up."""
    return lambda seq: routing


def qwen2(global_batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
          vocab: int = 128, mask: bool = False, own_loss: bool = False) -> Factory:
    """Qwen2 (biases on q, k and v), its output layer tied to the input embedding as in Qwen2-0.5B."""
    config = _decoder_config("Qwen2Config", layers, hidden, heads, vocab, seq, tie_word_embeddings=True)
    return _language_model("AutoModelForCausalLM", config, global_batch, seq, mask, own_loss)


def bert(global_batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
         vocab: int = 128, mask: bool = False, own_loss: bool = False) -> Factory:
    """BERT as a masked language model, its decoder tied to the word embedding; targets at every
    position."""
    config = _transformers().BertConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=2 * hidden,
        vocab_size=vocab, max_position_embeddings=max(seq, 16), hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0)
    return _language_model("AutoModelForMaskedLM", config, global_batch, seq, mask, own_loss)


def t5(global_batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
       vocab: int = 128, mask: bool = False, own_loss: bool = False) -> Factory:
    """T5, encoder-decoder: inputs ``(input_ids[, attention_mask], decoder_input_ids)``; the encoder's,
    the decoder's and the output embedding are one tied matrix. With ``own_loss`` the model makes its
    decoder inputs from the labels (shifted right), so ``decoder_input_ids`` is not an input."""
    config = _transformers().T5Config(
        num_layers=layers, num_decoder_layers=layers, d_model=hidden, num_heads=heads, d_kv=hidden // heads,
        d_ff=2 * hidden, vocab_size=vocab, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1)
    model = _transformers().AutoModelForSeq2SeqLM.from_config(config, attn_implementation="sdpa")
    inputs = _token_inputs(vocab, global_batch, seq, mask)
    if not own_loss:
        inputs["decoder_input_ids"] = _ids(vocab, global_batch, seq)
    return _result(model, inputs, _ids(vocab, global_batch, seq), vocab, own_loss)


def vit(global_batch: int = 4, image: int = 16, patch: int = 4, layers: int = 2, hidden: int = 64,
        heads: int = 4, classes: int = 10, own_loss: bool = False) -> Factory:
    """ViT classifying ``image`` x ``image`` RGB images into ``classes``: inputs ``(pixel_values,)``."""
    config = _transformers().ViTConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=2 * hidden,
        image_size=image, patch_size=patch, num_channels=3, num_labels=classes, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    model = _transformers().AutoModelForImageClassification.from_config(config, attn_implementation="sdpa")
    pixels = {"pixel_values": torch.randn(global_batch, 3, image, image)}
    return _result(model, pixels, _ids(classes, global_batch), classes, own_loss)
