"""Model registry: named presets, ``--set`` style overrides and user factories.

``build_model(name, ...)`` returns a :class:`ModelBundle` holding the module,
example inputs/targets of the requested global batch and a picklable loss.

``name`` is either a key of :data:`MODEL_PRESETS` or ``package.module:factory``.
A user factory is imported and called with no positional arguments, inside
``with torch.device(device)`` and after ``torch.manual_seed(seed)`` (unless the
device is meta). Keyword arguments passed to it: every override, plus
``global_batch`` and ``seq`` (only when not None) if its signature names them
(or takes ``**kwargs``). It must return either

* ``(model, example_inputs, example_targets, loss_fn)`` with
  ``loss_fn(output, targets) -> scalar``; or
* ``(model, example_inputs, loss_fn)`` with ``loss_fn(output) -> scalar``.
  The bundle then has ``example_targets=None`` and a ``loss_fn`` that still
  takes ``(output, targets)`` and ignores ``targets``.

``example_inputs`` may be a single tensor or a tuple/list of tensors; the model
and tensors are moved to ``device``. ``bundle.config`` is ``model.config`` if
the model has one, else None.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sysconfig
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn

from autopar.core.constraints import split_pairs
from autopar.core.errors import AutoparError, BadInputError, innermost_frame

from .common import lm_loss, mse_loss
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .mlp import MLP, MLPConfig
from .moe import MoE, MoEConfig, moe_loss

__all__ = [
    "ModelBundle",
    "MODEL_PRESETS",
    "UnknownModelError",
    "build_model",
    "model_config",
    "parse_overrides",
]

OverrideValue = int | float | bool | str


class UnknownModelError(BadInputError):
    """Raised for a model name that is neither a preset nor a loadable factory."""


@dataclass
class ModelBundle:
    """A model plus everything needed to run one training step on it."""

    name: str  # preset name or ``package.module:factory``
    model: nn.Module = field(repr=False)  # the module (on the requested device)
    example_inputs: tuple[Tensor, ...] = field(repr=False)  # positional inputs, global batch
    example_targets: Tensor | None = field(repr=False)  # targets for loss_fn (None: output-only loss)
    loss_fn: Callable[[Tensor, Tensor], Tensor] = field(repr=False)  # (output, targets) -> scalar
    config: Any = None  # the config dataclass (None for factories without one)

    def num_params(self) -> int:
        """Number of distinct parameter elements (tied weights counted once)."""
        return sum(p.numel() for p in self.model.parameters())


MODEL_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt", dict(layers=12, hidden=768, heads=12, vocab=50257, seq=1024)),
    "gpt2-medium": ("gpt", dict(layers=24, hidden=1024, heads=16, vocab=50257, seq=1024)),
    "gpt2-large": ("gpt", dict(layers=36, hidden=1280, heads=20, vocab=50257, seq=1024)),
    "gpt2-xl": ("gpt", dict(layers=48, hidden=1600, heads=25, vocab=50257, seq=1024)),
    "gpt3-175b": ("gpt", dict(layers=96, hidden=12288, heads=96, vocab=50257, seq=2048)),
    # GPT as Megatron-LM ran it in its published runs (SC21): unfused attention, vocabulary 51,200
    "gpt-megatron": ("gpt", dict(vocab=51200, seq=2048, attention="eager")),
    "llama3-8b": (
        "llama",
        dict(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=128256, ffn_hidden=14336, seq=8192),
    ),
    "llama3-70b": (
        "llama",
        dict(layers=80, hidden=8192, heads=64, kv_heads=8, vocab=128256, ffn_hidden=28672, seq=8192),
    ),
    "llama3-405b": (
        "llama",
        dict(layers=126, hidden=16384, heads=128, kv_heads=8, vocab=128256, ffn_hidden=53248, seq=8192),
    ),
    "tiny-gpt": ("gpt", dict(layers=2, hidden=64, heads=4, vocab=256, seq=32)),
    "tiny-llama": (
        "llama",
        dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, ffn_hidden=128, seq=32),
    ),
    "mlp": ("mlp", dict(in_dim=64, hidden=256, layers=3, out_dim=64)),
    # Mixtral 8x7B's published dims (Jiang et al., 2024): 8 SwiGLU experts a layer, 2 per token, the
    # capacity per sequence
    "mixtral-8x7b": (
        "moe",
        dict(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=32000, ffn_hidden=14336, seq=32768,
             experts=8, top_k=2),
    ),
    "tiny-moe": (
        "moe",
        dict(layers=2, hidden=32, heads=4, kv_heads=2, vocab=128, ffn_hidden=64, seq=16, experts=4, top_k=2),
    ),
}


# --------------------------------------------------------------------------- families


def _lm_data(
    cfg: Any, batch: int, seq: int, device: torch.device
) -> tuple[tuple[Tensor, ...], Tensor]:
    """Random token ids in ``[0, vocab)`` for inputs and targets, ``[batch, seq]``."""
    idx = torch.randint(0, cfg.vocab, (batch, seq), dtype=torch.long, device=device)
    targets = torch.randint(0, cfg.vocab, (batch, seq), dtype=torch.long, device=device)
    return (idx,), targets


def _mlp_data(
    cfg: MLPConfig, batch: int, seq: int, device: torch.device
) -> tuple[tuple[Tensor, ...], Tensor]:
    """Random float inputs ``[batch, in_dim]`` and targets ``[batch, out_dim]``."""
    x = torch.randn(batch, cfg.in_dim, device=device)
    y = torch.randn(batch, cfg.out_dim, device=device)
    return (x,), y


def _build_mlp(cfg: MLPConfig) -> MLP:
    """Construct an MLP from its config (the MLP module takes plain dims)."""
    model = MLP(cfg.dims)
    model.config = cfg
    return model


@dataclass(frozen=True)
class _Family:
    """How to build one model family from its config."""

    config_cls: type
    build: Callable[[Any], nn.Module]
    make_data: Callable[[Any, int, int, torch.device], tuple[tuple[Tensor, ...], Tensor]]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    uses_seq: bool = True


_FAMILIES: dict[str, _Family] = {
    "gpt": _Family(GPTConfig, GPT, _lm_data, lm_loss),
    "llama": _Family(LlamaConfig, Llama, _lm_data, lm_loss),
    "mlp": _Family(MLPConfig, _build_mlp, _mlp_data, mse_loss, uses_seq=False),
    "moe": _Family(MoEConfig, MoE, _lm_data, moe_loss),
}


# --------------------------------------------------------------------------- overrides

def _parse_value(text: str) -> OverrideValue:
    """``true/false`` -> bool, then int, then float, else the text itself (a choice such as
    ``mlp=squared-relu``; the config field's type checks it when the model is built, ``_coerce``)."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_overrides(text: str | None) -> dict[str, OverrideValue]:
    """Parse ``"layers=2,hidden=64,bias=false,mlp=squared-relu"`` into a dict of typed values.

    Values are ``true``/``false`` (bool), ints, floats (``1e-6``) or else text (``squared-relu``):
    whether a value suits its field is checked against the model's config when it is built. Empty or
    None text gives ``{}``. A malformed or repeated item raises BadInputError naming it
    (the ``key=value,...`` text of ``--set`` is that of ``--fix``: ``split_pairs``).
    """
    return {key: _parse_value(raw) for key, raw in split_pairs(text, "override").items()}


def _coerce(key: str, value: Any, kind: Any) -> Any:
    """Check/convert an override value to the config field's type."""
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise BadInputError(f"override {key}={value!r}: expected {kind.__name__}")


def _make_config(
    name: str, family: _Family, base: Mapping[str, Any], overrides: Mapping[str, Any]
) -> Any:
    """Build ``family.config_cls`` from preset kwargs updated by overrides."""
    hints = typing.get_type_hints(family.config_cls)
    names = [f.name for f in fields(family.config_cls)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise BadInputError(
            f"unknown override(s) {', '.join(unknown)} for model {name!r}: "
            f"valid keys are {', '.join(names)}"
        )
    kwargs = dict(base)
    kwargs.update({k: _coerce(k, v, hints[k]) for k, v in overrides.items()})
    required = [f.name for f in fields(family.config_cls) if _is_required(f)]
    missing = [k for k in required if k not in kwargs]
    if missing:
        raise BadInputError(
            f"model {name!r} needs overrides for: {', '.join(missing)} (e.g. --set layers=24,...)"
        )
    return family.config_cls(**kwargs)


def _is_required(f: Any) -> bool:
    """True for a dataclass field without a default."""
    return f.default is MISSING and f.default_factory is MISSING


def _unknown_model(name: str) -> UnknownModelError:
    """The error for a name that is neither a preset nor ``module:factory``."""
    known = ", ".join(MODEL_PRESETS)
    return UnknownModelError(f"unknown model {name!r}: known models are {known} or package.module:factory")


def model_config(name: str, overrides: Mapping[str, Any] | None = None) -> Any:
    """Return the config dataclass of preset ``name`` with ``overrides`` applied."""
    if name not in MODEL_PRESETS:
        raise _unknown_model(name)
    family_name, base = MODEL_PRESETS[name]
    return _make_config(name, _FAMILIES[family_name], base, overrides or {})


# --------------------------------------------------------------------------- building


def _resolve_seq(name: str, cfg: Any, seq: int | None) -> int:
    """Example sequence length: ``seq`` or the config's max, never above the max."""
    max_seq = getattr(cfg, "seq", None)
    if seq is None:
        return max_seq if max_seq is not None else 1
    if seq < 1:
        raise BadInputError(f"seq must be >= 1, got {seq}")
    if max_seq is not None and seq > max_seq:
        raise BadInputError(
            f"seq {seq} exceeds the maximum sequence length {max_seq} of {name!r}; "
            f"raise it with the override seq={seq}"
        )
    return seq


def _seed_for(device: torch.device, seed: int) -> None:
    """Seed the global RNG unless building on meta (where nothing is random)."""
    if device.type != "meta":
        torch.manual_seed(seed)


def _build_preset(
    name: str,
    overrides: Mapping[str, Any],
    global_batch: int,
    seq: int | None,
    device: torch.device,
    seed: int,
) -> ModelBundle:
    """Build a preset: config, seeded construction under ``device``, example data."""
    cfg = model_config(name, overrides)
    family = _FAMILIES[MODEL_PRESETS[name][0]]
    seq_len = _resolve_seq(name, cfg, seq) if family.uses_seq else 1
    _seed_for(device, seed)
    with torch.device(device):
        model = family.build(cfg)
    inputs, targets = family.make_data(cfg, global_batch, seq_len, device)
    return ModelBundle(name, model, inputs, targets, family.loss_fn, cfg)


class _OutputOnlyLoss:
    """Adapts ``loss(output)`` to the ``loss(output, targets)`` signature."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        self.fn = fn

    def __call__(self, output: Tensor, targets: Tensor | None = None) -> Tensor:
        return self.fn(output)


def _load_factory(spec: str) -> Callable[..., Any]:
    """Import ``package.module:attr[.attr]`` and return the callable."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise _unknown_model(spec)
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownModelError(f"cannot load model factory {spec!r}: {exc}") from exc
    if not callable(obj):
        raise UnknownModelError(f"model factory {spec!r} is not callable")
    return obj


def _factory_kwargs(
    spec: str, factory: Callable[..., Any], overrides: Mapping[str, Any], global_batch: int, seq: int | None
) -> dict[str, Any]:
    """Overrides plus ``global_batch``/``seq`` when the factory accepts them; an override the factory has
    no keyword for is refused, naming those it has."""
    kwargs = dict(overrides)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return kwargs
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    keywords = [name for name, p in params.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    unknown = sorted(set(overrides) - set(keywords))
    if unknown and not var_kw:
        raise BadInputError(f"unknown override(s) {', '.join(unknown)} for model factory {spec!r}: "
                            f"it takes {', '.join(keywords) or 'no keyword arguments'}")
    extras = {"global_batch": global_batch, "seq": seq}
    for key, value in extras.items():
        if value is not None and key not in kwargs and (var_kw or key in params):
            kwargs[key] = value
    return kwargs


def _to_device(x: Tensor | None, device: torch.device) -> Tensor | None:
    """Move a tensor (or None) to ``device``."""
    return None if x is None else x.to(device)


def _bundle_from_result(spec: str, result: Any, device: torch.device) -> ModelBundle:
    """Normalise a factory's 3- or 4-tuple into a ModelBundle on ``device``."""
    if not isinstance(result, (tuple, list)) or len(result) not in (3, 4):
        raise BadInputError(
            f"model factory {spec!r} must return (model, inputs, targets, loss_fn) "
            f"or (model, inputs, loss_fn), got {type(result).__name__}"
        )
    if len(result) == 4:
        model, inputs, targets, loss_fn = result
    else:
        model, inputs, loss_fn = result
        targets, loss_fn = None, _OutputOnlyLoss(loss_fn)
    if isinstance(inputs, Tensor):
        inputs = (inputs,)
    inputs = tuple(_to_device(t, device) for t in inputs)
    model = model.to(device)
    config = getattr(model, "config", None)
    return ModelBundle(spec, model, inputs, _to_device(targets, device), loss_fn, config)


def _build_custom(
    spec: str,
    overrides: Mapping[str, Any],
    global_batch: int,
    seq: int | None,
    device: torch.device,
    seed: int,
) -> ModelBundle:
    """Build from a ``package.module:factory`` spec (see the module docstring)."""
    factory = _load_factory(spec)
    kwargs = _factory_kwargs(spec, factory, overrides, global_batch, seq)
    _seed_for(device, seed)
    try:
        with torch.device(device):
            result = factory(**kwargs)
    except AutoparError:
        raise
    except Exception as exc:  # the factory refused its arguments (or failed): say so, and where, in one message
        raise _factory_failed(spec, factory, overrides, exc) from exc
    return _bundle_from_result(spec, result, device)


def _factory_failed(spec: str, factory: Callable[..., Any], overrides: Mapping[str, Any], exc: Exception
                    ) -> BadInputError:
    """The error of a factory that raised ``exc``: its type and message, the overrides it was given, and the
    innermost line of code outside the libraries that raised it (the factory's own file counts wherever it
    is installed), such as a config's validation of ``--set heads=7``."""
    libraries = tuple({sysconfig.get_paths()[key] + os.sep for key in ("stdlib", "purelib", "platlib")}) + ("<",)
    try:
        source = inspect.getsourcefile(factory)
    except TypeError:
        source = None
    where = innermost_frame(exc, lambda frame: frame.filename == source or not frame.filename.startswith(libraries))
    given = f" with {', '.join(f'{k}={v!r}' for k, v in overrides.items())}" if overrides else ""
    at = f" (raised at {where.filename}:{where.lineno} in {where.name})" if where is not None else ""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines()) or "no message"
    return BadInputError(f"model factory {spec!r} failed{given}: {type(exc).__name__}: {text}{at}")


def build_model(
    name: str,
    *,
    overrides: Mapping[str, Any] | None = None,
    global_batch: int = 8,
    seq: int | None = None,
    device: str | torch.device = "meta",
    seed: int = 0,
) -> ModelBundle:
    """Build preset ``name`` (or ``package.module:factory``) as a ModelBundle.

    ``overrides`` are config field names -> values (see :func:`parse_overrides`);
    ``seq`` is the example sequence length (default: the config's ``seq``, which
    bounds it; ignored by ``mlp``). On ``device="meta"`` nothing is allocated and
    the example tensors are meta too; otherwise ``torch.manual_seed(seed)`` runs
    first so equal seeds give identical weights and data.
    """
    if global_batch < 1:
        raise BadInputError(f"global_batch must be >= 1, got {global_batch}")
    device = torch.device(device)
    overrides = dict(overrides or {})
    if ":" in name:
        return _build_custom(name, overrides, global_batch, seq, device, seed)
    return _build_preset(name, overrides, global_batch, seq, device, seed)
