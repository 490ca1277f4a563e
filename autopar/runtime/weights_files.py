"""Full (unsharded) weights files a planned module loads (``checkpoint.load_full_state_dict``), read so that a
rank holds at most one full tensor beside its shards, and writes (``checkpoint.save_full_state_dict``:
``torch.save``'s format, or safetensors for a ``.safetensors`` path, ``write_weights``).

* A ``torch.save`` file (``save_full_state_dict``'s, or ``torch.save(model.state_dict())``) is memory-mapped
  (``mmap=True``): a rank reads the pages of its own shards only, and the ranks of a host share them in the page
  cache (a 70B model's 140 GB file read whole by each of a node's 8 ranks held 1.1 TB). One in torch's legacy
  format, which cannot be mapped, is read whole.
* A ``.safetensors`` file, or a directory as Hugging Face's ``save_pretrained`` writes it (``model.safetensors``,
  or shards listed by ``model.safetensors.index.json``), is read one tensor at a time, as the load asks for it
  (``SafetensorsWeights``): pretrained weights load without the model ever whole in memory.

Both are read as tensors only (``weights_only=True``; safetensors holds nothing else).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping

import torch

from autopar.core.errors import BadInputError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"


def read_weights(path: Path) -> Mapping[str, torch.Tensor]:
    """The weights in ``path`` (a file or a ``save_pretrained`` directory) by name, read lazily where the format
    allows (module docstring)."""
    if path.is_dir():
        return SafetensorsWeights(_safetensors_in(path))
    if not path.is_file():
        raise BadInputError(f"{path}: no such weights file or directory")
    if path.suffix == ".safetensors":
        return SafetensorsWeights([path])
    return _torch_weights(path)


def write_weights(state: Mapping[str, torch.Tensor], path: Path) -> Callable[[BinaryIO], None]:
    """A writer of ``state`` into an open file, in the format ``path``'s suffix names: safetensors for
    ``.safetensors`` (its bytes made in memory first: the format is written whole; tensors sharing storage, a
    tied weight under two names, each written as its own copy, as safetensors requires), else ``torch.save``
    (streamed into the file)."""
    if path.suffix != ".safetensors":
        return lambda handle: torch.save(dict(state), handle)
    save = _safetensors("writing").torch.save
    seen: set[int] = set()
    separate = {}
    for name, tensor in state.items():
        tensor = tensor.contiguous()
        separate[name] = tensor.clone() if tensor.untyped_storage().data_ptr() in seen else tensor
        seen.add(tensor.untyped_storage().data_ptr())
    return lambda handle: handle.write(save(separate))


def _torch_weights(path: Path) -> Mapping[str, torch.Tensor]:
    try:
        state = _load_mapped(path)
    except Exception as exc:  # torch.load raises several types for a file that is not its own
        raise BadInputError(f"{path}: not a torch.save file of tensors ({exc.__class__.__name__}); "
                            f"give a file written by save_full_state_dict or torch.save(model.state_dict()), or "
                            "safetensors") from None
    if not isinstance(state, Mapping):
        raise BadInputError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
    return state


def _load_mapped(path: Path) -> Any:
    """``torch.load`` of ``path`` memory-mapped; a file in the legacy format, which cannot be, read whole."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def _safetensors(doing: str) -> Any:
    """The ``safetensors`` package (with its ``torch`` module), or a clear error for ``doing`` without it."""
    try:
        import safetensors.torch
    except ImportError:
        raise BadInputError(f"{doing} .safetensors weights needs the safetensors package: "
                            "pip install safetensors") from None
    return safetensors


def _safetensors_in(directory: Path) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory: the shards its index lists, or its one file."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BadInputError(f"{index}: not a safetensors index (no weight_map: {exc})") from None
        return [directory / shard for shard in shards]
    single = directory / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    raise BadInputError(f"{directory}: no {SAFETENSORS_INDEX} or {SAFETENSORS_FILE} (a directory of weights as "
                        "Hugging Face's save_pretrained writes it)")


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """Name -> tensor of safetensors ``files``, each tensor read from its file when asked (``safe_open``; the
    names from each file's header)."""

    def __init__(self, files: list[Path]) -> None:
        self._open = _safetensors("reading").safe_open
        self._handles: dict[Path, Any] = {}
        self._files = {name: path for path in files for name in self._handle(path).keys()}

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            try:
                self._handles[path] = self._open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for a file that is not one
                raise BadInputError(f"{path}: not a safetensors file ({exc.__class__.__name__}: {exc})") from None
        return self._handles[path]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handle(self._files[name]).get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)
