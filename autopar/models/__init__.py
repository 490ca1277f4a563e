"""Built-in model families (GPT, Llama, MLP) and the model registry.

Use :func:`build_model` to get a :class:`ModelBundle` for a preset name from
:data:`MODEL_PRESETS` (e.g. ``"gpt2"``, ``"llama3-8b"``, ``"tiny-gpt"``) or a
``package.module:factory`` spec. All models are written with plain,
export-friendly ops and can be constructed on the meta device.
"""

from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig, RMSNorm
from .mlp import MLP, MLPConfig
from .registry import (
    MODEL_PRESETS,
    ModelBundle,
    UnknownModelError,
    build_model,
    model_config,
    parse_overrides,
)

__all__ = [
    "ModelBundle",
    "build_model",
    "model_config",
    "MODEL_PRESETS",
    "UnknownModelError",
    "GPTConfig",
    "GPT",
    "LlamaConfig",
    "Llama",
    "MLP",
    "MLPConfig",
    "RMSNorm",
    "parse_overrides",
]
