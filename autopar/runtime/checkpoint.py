"""Checkpoints of a running plan that any other plan can load: resharded training state and one
unsharded weights file.

* **Distributed checkpoints** (``save_checkpoint`` / ``load_checkpoint``): a directory written by
  ``torch.distributed.checkpoint`` (DCP) holding ``{"model": ..., "optimizer": ..., "step": int}``.
  Model entries are keyed by the model's own FQNs (``model.named_parameters()``, plus its persistent
  buffers) and are DTensors of the parameter's global shape, so DCP records which slice each rank
  wrote and reshards on load: a checkpoint saved under one plan (any mesh, world size, pipeline or
  ZeRO) loads under any other plan of the same model. A pipeline rank saves only its stages'
  entries, DCP writes each once, and a rank loads whatever its own stages hold.
* **Optimizer state** (``optimizer_state_dict``) in the flattened form of
  ``torch.distributed.checkpoint.state_dict`` (``StateDictOptions(flatten_optimizer_state_dict=True)``):
  ``"state.{fqn}.{name}"`` (momentum, Adam's moments and step) and ``"param_groups.{fqn}.{hyper}"``.
  Under ZeRO-1/2 the optimizer's parameters are dp- (and cp-) sharded copies (``passes/zero.py``) whose state is
  a DTensor of the parameter's global shape too, so a plan without ZeRO loads it.
* **One unsharded file** (``save_full_state_dict`` / ``load_full_state_dict``): ``torch.save`` of
  FQN -> full tensor, written by rank 0, which a plain ``nn.Module`` loads with ``load_state_dict``
  and any plan loads by slicing its own shard.
* **Restarts** (``checkpoint_path``, ``latest_checkpoint``): one DCP directory per step under a root;
  DCP writes ``.metadata`` last, so a save cut short is never taken for the latest.

Where we diverge from ``torch.distributed.checkpoint.state_dict`` (``get_optimizer_state_dict`` /
``set_optimizer_state_dict``): those find a parameter's FQN by walking the module tree with
``getattr`` (``_get_fqns``), and autopar's modules keep parameters in a flat ``ParameterDict``
(``ParallelModule``) or in stage chunks (``PipelineParallelModule``), where that walk finds nothing; so
the conversion to FQNs is made here from ``named_parameters()``, into the same form. The lazily
created optimizer state is made before a load as that module's ``_init_optim_state`` makes it: one
step with zero gradients and a zero learning rate, which leaves the parameters as they are.

A checkpoint directory is read by DCP, which unpickles its metadata and non-tensor entries: load only
checkpoints you trust (the unsharded file is read with ``weights_only=True``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.core.errors import BadInputError
from autopar.core.files import write_atomically
from autopar.runtime.loss_scale import DynamicLossScale
from autopar.runtime.weights_files import read_weights, write_weights

STEP_DIR = "step-{:08d}"
"""The name of step N's checkpoint under a root directory (``checkpoint_path``)."""
_STEP_DIR_RE = re.compile(r"step-\d{8}")
_METADATA = ".metadata"  # DCP's FileSystemWriter writes it after every rank's data


class PlannedModule(Protocol):
    """What this module needs of ``ParallelModule`` / ``PipelineParallelModule``."""

    mesh: DeviceMesh
    loss_scale: DynamicLossScale | None

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]: ...
    def state_dict(self) -> dict[str, DTensor]: ...
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None: ...


# ---- the modules' state_dict / load_state_dict -----------------------------------------------------
def state_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each key of ``model.state_dict()`` (parameters, persistent buffers) -> every key naming the same
    tensor: itself, and a tied parameter's other names. A planned module holds a tied parameter under
    one of them (``named_parameters()``) and saves it under all, as ``nn.Module.state_dict`` does."""
    by_tensor: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for name, t in state.items():
        by_tensor.setdefault(id(t), []).append(name)
    return {name: tuple(by_tensor[id(t)]) for name, t in state.items()}


def module_state_dict(entries: Iterable[tuple[str, torch.Tensor]], names: Mapping[str, tuple[str, ...]]
                      ) -> dict[str, DTensor]:
    """FQN -> DTensor for every state key in ``names`` that ``entries`` (what the module holds) holds
    under one of its names; detached, sharing storage with the module's tensors, so ``dcp.load`` into
    the dict loads the module in place."""
    held = dict(entries)
    found = {name: next((held[a] for a in aliases if a in held), None) for name, aliases in names.items()}
    return {name: t.detach() for name, t in found.items() if t is not None}


def load_module_state_dict(own: Mapping[str, DTensor], given: Mapping[str, torch.Tensor],
                           names: Mapping[str, tuple[str, ...]], strict: bool = True) -> None:
    """Copy ``given`` (FQN -> full tensor, or DTensor of any placement) into ``own`` (a module's
    ``state_dict()``), each rank taking its shard. ``strict``: every entry of ``own`` must be given (a
    tied parameter under any of its names), and every given key must be one of the model's ``names``
    (a pipeline rank holds only its stages' entries). Keys that one prefix, added or taken away, makes names
    of the model are read so (``with_model_prefix``)."""
    given = with_model_prefix(given, names)
    source = {fqn: next((a for a in names[fqn] if a in given), None) for fqn in own}
    missing = sorted(fqn for fqn, a in source.items() if a is None)
    unexpected = sorted(given.keys() - names.keys())
    if strict and (missing or unexpected):
        raise BadInputError(f"load_state_dict: the state does not match the model: missing {missing[:5]} "
                            f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)}); load a state "
                            f"saved from this model, or pass strict=False")
    with torch.no_grad():
        for fqn, dest in own.items():
            if source[fqn] is not None:
                _copy_into(dest, given[source[fqn]], fqn)


def with_model_prefix(given: Mapping[str, torch.Tensor], names: Mapping[str, Any]) -> Mapping[str, torch.Tensor]:
    """``given`` keyed by the model's names where its keys are those names less, or plus, one prefix: a
    Hugging Face checkpoint (``model.layers.0...``) for the model wrapped in ``HFModel`` (``hf.model.layers.0...``),
    or the wrapper's file for the bare model. Only a prefix under which every key is a name of the model is
    taken; otherwise ``given`` as it is (the caller reports what does not match)."""
    stray = next((k for k in given if k not in names), None)
    if stray is None:
        return given
    for prefix, added in _prefixes_naming(stray, names):
        renamed = {(prefix + k if added else k[len(prefix):]): k for k in given if added or k.startswith(prefix)}
        if len(renamed) == len(given) and all(n in names for n in renamed):
            return _Renamed(given, renamed)
    return given


def _prefixes_naming(key: str, names: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """(prefix, added) such that ``prefix + key`` (added) or ``key`` less ``prefix`` is a name in ``names``: whole
    module paths ending in a dot."""
    for name in names:
        if name.endswith("." + key):
            yield name[:-len(key)], True
        elif key.endswith("." + name):
            yield key[:-len(name)], False


class _Renamed(Mapping[str, torch.Tensor]):
    """``given`` read under new keys (new -> old), each tensor fetched only when asked (a lazy file stays lazy)."""

    def __init__(self, given: Mapping[str, torch.Tensor], renamed: dict[str, str]) -> None:
        self._given, self._renamed = given, renamed

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._given[self._renamed[key]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._renamed)

    def __len__(self) -> int:
        return len(self._renamed)


def _copy_into(dest: DTensor, src: torch.Tensor, fqn: str) -> None:
    if tuple(src.shape) != tuple(dest.shape):
        raise BadInputError(f"load_state_dict: {fqn} has shape {list(src.shape)} in the state, "
                            f"{list(dest.shape)} in this model; load a state of the same model configuration")
    if isinstance(src, DTensor):
        if src.to_local().data_ptr() == dest.to_local().data_ptr():
            return  # already loaded in place (dcp.load into this module's state_dict())
        same_mesh = src.device_mesh == dest.device_mesh
        src = src.redistribute(dest.device_mesh, dest.placements) if same_mesh else src.full_tensor()
    if not isinstance(src, DTensor):  # a full tensor: every rank slices its own shard, no communication
        src = distribute_tensor(src.detach().to(dest.device), dest.device_mesh, dest.placements,
                                src_data_rank=None)
    dest.to_local().copy_(src.to_local())


# ---- optimizer state ---------------------------------------------------------------------------------
def optimizer_state_dict(pm: PlannedModule, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state keyed by FQN, flattened as ``torch.distributed.checkpoint.state_dict`` does:
    ``"state.{fqn}.{name}"`` and ``"param_groups.{fqn}.{hyperparameter}"``. Tensors are detached views
    of the live state (DTensors of the parameter's global shape)."""
    fqn_of = _fqns_by_id(pm)
    flat: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = _fqn(fqn_of, p)
            for name, value in optimizer.state.get(p, {}).items():
                flat[f"state.{fqn}.{name}"] = value.detach() if isinstance(value, torch.Tensor) else value
            for hyper, value in group.items():
                if hyper != "params":
                    flat[f"param_groups.{fqn}.{hyper}"] = value
    return flat


def _fqns_by_id(pm: PlannedModule) -> dict[int, str]:
    return {id(p): fqn for fqn, p in pm.named_parameters()}


def _fqn(fqn_of: Mapping[int, str], p: torch.Tensor) -> str:
    if id(p) not in fqn_of:
        raise BadInputError("the optimizer holds a parameter that is not one of the module's parameters(); "
                            "build it from pm.parameters()")
    return fqn_of[id(p)]


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s lazily made state, as torch's ``_init_optim_state`` does: one step with zero
    gradients at learning rate 0, which leaves the parameters unchanged; nothing if it has state."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, learning_rates):
        group["lr"] = lr
    for p in params:
        p.grad = None


def _stored_optimizer_state(pm: PlannedModule, optimizer: torch.optim.Optimizer, stored: set[str],
                            path: Path) -> dict[str, Any]:
    """The optimizer's state to load (``optimizer_state_dict``), its state created; a parameter of which
    the checkpoint holds no state (saved before the first step) gets none."""
    init_optimizer_state(optimizer)
    flat = optimizer_state_dict(pm, optimizer)
    fqn_of = _fqns_by_id(pm)
    for p in list(optimizer.state):
        keys = [f"state.{fqn_of[id(p)]}.{name}" for name in optimizer.state[p]]
        found = [k for k in keys if f"optimizer.{k}" in stored]
        if not found:
            del optimizer.state[p]
            for k in keys:
                del flat[k]
        elif len(found) < len(keys):
            raise BadInputError(f"{path}: the checkpoint lacks {sorted(set(keys) - set(found))} of this "
                                f"optimizer's state; was it saved with another optimizer?")
    return flat


def _apply_loaded_optimizer_values(pm: PlannedModule, optimizer: torch.optim.Optimizer,
                                   flat: Mapping[str, Any]) -> None:
    """Put what DCP loaded by value (hyperparameters, non-tensor state) back into ``optimizer``;
    tensors were loaded in place."""
    fqn_of = _fqns_by_id(pm)
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = fqn_of[id(p)]
            state = optimizer.state.get(p, {})
            for name, value in state.items():
                if not isinstance(value, torch.Tensor):
                    state[name] = flat[f"state.{fqn}.{name}"]
            for hyper in group:
                if hyper != "params" and f"param_groups.{fqn}.{hyper}" in flat:
                    group[hyper] = flat[f"param_groups.{fqn}.{hyper}"]


# ---- distributed checkpoints -------------------------------------------------------------------------
def save_checkpoint(pm: PlannedModule, optimizer: torch.optim.Optimizer | None, path: str | Path,
                    step: int = 0) -> None:
    """Save the module's parameters and persistent buffers, ``optimizer``'s state (if given) and ``step``
    to the DCP directory ``path``, each rank writing its shards. Collective: every rank calls it."""
    state: dict[str, Any] = {"model": pm.state_dict(), "step": step}
    if optimizer is not None:
        state["optimizer"] = optimizer_state_dict(pm, optimizer)
    if pm.loss_scale is not None:  # an fp16 plan's (``runtime/loss_scale.py``)
        state["loss_scale"] = pm.loss_scale.state_dict()
    dcp.save(state, checkpoint_id=str(path))


def load_checkpoint(pm: PlannedModule, optimizer: torch.optim.Optimizer | None, path: str | Path) -> int:
    """Load a ``save_checkpoint`` directory, saved under any plan of this model, into this rank's shards
    of the module and of ``optimizer``'s state (made first if the optimizer has not stepped); returns
    the saved step, from which the module's steps draw their dropout masks on (``runtime/randomness.py``).
    Collective: every rank calls it."""
    path = Path(path)
    stored = _stored_keys(path)
    state: dict[str, Any] = {"model": pm.state_dict(), "step": 0}
    _check_model_keys(state["model"], stored, path)
    if optimizer is not None:
        state["optimizer"] = _stored_optimizer_state(pm, optimizer, stored, path)
    resumes_scale = pm.loss_scale is not None and "loss_scale.scale" in stored  # saved by an fp16 plan
    if resumes_scale:
        state["loss_scale"] = pm.loss_scale.state_dict()
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is not None:
        _apply_loaded_optimizer_values(pm, optimizer, state["optimizer"])
    if resumes_scale:
        pm.loss_scale.load_state_dict(state["loss_scale"])
    pm.randomness.steps = int(state["step"])  # the dropout masks of the step it resumes at
    return int(state["step"])


def _stored_keys(path: Path) -> set[str]:
    if not (path / _METADATA).is_file():
        raise BadInputError(f"{path}: not a checkpoint (no {_METADATA}: not written by save_checkpoint, "
                            f"or its save did not finish); give a complete checkpoint directory")
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _check_model_keys(model_state: Mapping[str, torch.Tensor], stored: set[str], path: Path) -> None:
    missing = sorted(fqn for fqn in model_state if f"model.{fqn}" not in stored)
    if missing:
        raise BadInputError(f"{path}: the checkpoint has no {missing[:5]} ({len(missing)} of this model's "
                            f"entries missing); was it saved from another model?")


def checkpoint_path(root: str | Path, step: int) -> Path:
    """Where step ``step``'s checkpoint goes under ``root``."""
    return Path(root) / STEP_DIR.format(step)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint of the highest step under ``root`` (None if there is none)."""
    root = Path(root)
    found = [d for d in root.iterdir() if _STEP_DIR_RE.fullmatch(d.name) and (d / _METADATA).is_file()] \
        if root.is_dir() else []
    return max(found, key=lambda d: d.name, default=None)


# ---- one unsharded file ------------------------------------------------------------------------------
def _gather_full_state(pm: PlannedModule) -> dict[str, torch.Tensor]:
    """FQN -> full tensor, on the CPU, of every parameter and persistent buffer of the whole model (a pipeline's
    other stages' included) on rank 0; an empty dict on the other ranks. Collective.

    One tensor at a time: a stage's ranks gather each of its tensors in turn (``full_tensor`` over the stage's
    mesh) and the stage's first rank hands it to rank 0, so no rank holds more than one full tensor beside its
    shards (gathering the whole model on every rank first held it once per rank: a model that needed FSDP could
    not be saved), and rank 0 the whole model once, on the CPU. A name that several stages hold (a weight tied
    across them) is sent by the first of them."""
    state, rank = pm.state_dict(), dist.get_rank()
    first = int(pm.mesh.mesh.min())  # the stage's first rank (a one-stage plan's: rank 0)
    listed: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(listed, list(state) if rank == first else None)
    sends = _names_each_stage_sends(listed)
    full: dict[str, torch.Tensor] = {}
    for fqn in sends[first]:
        value = state[fqn].full_tensor()
        if rank == 0:
            full[fqn] = value.cpu()
        elif rank == first:
            dist.send_object_list([value.cpu()], dst=0)
        del value
    if rank == 0:
        for sender, names in sends.items():
            for fqn in names if sender != 0 else ():
                box: list[Any] = [None]
                dist.recv_object_list(box, src=sender)
                full[fqn] = box[0]
    return full


def _names_each_stage_sends(listed: list[list[str] | None]) -> dict[int, list[str]]:
    """Stage's first rank -> the names it sends: those of its stage no stage of a lower first rank holds."""
    sends: dict[int, list[str]] = {}
    taken: set[str] = set()
    for sender, names in enumerate(listed):
        if names is not None:
            sends[sender] = [n for n in names if n not in taken]
            taken.update(names)
    return sends


def save_full_state_dict(pm: PlannedModule, path: str | Path, without_prefix: str = "") -> None:
    """Write the whole model's parameters and persistent buffers, unsharded, to one file (rank 0 writes it
    atomically): ``torch.save``'s, which ``model.load_state_dict(torch.load(path))`` loads into the plain model,
    or safetensors where ``path`` ends in ``.safetensors`` (Hugging Face's format: with the model's config beside
    it, ``from_pretrained`` reads the directory). ``without_prefix``: the names are written without it where they
    start with it (``"hf."``: ``autopar.models.hf.HFModel``'s wrapped model under its own names). Collective:
    every rank calls it."""
    state = {_without(fqn, without_prefix): tensor for fqn, tensor in _gather_full_state(pm).items()}
    if dist.get_rank() == 0:
        write_atomically(path, write_weights(state, Path(path)))
    dist.barrier()


def _without(name: str, prefix: str) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def load_full_state_dict(pm: PlannedModule, source: str | Path | Mapping[str, torch.Tensor],
                         strict: bool = True) -> None:
    """Load full (unsharded) weights into the module, each rank slicing its own shards: a ``torch.save`` file
    (memory-mapped), a ``.safetensors`` file or a Hugging Face ``save_pretrained`` directory (its shards read a
    tensor at a time, ``runtime/weights_files.py``), or a dict such as a pretrained model's ``state_dict()``.
    Keys may lack or carry a prefix the module's names carry or lack (``autopar.models.hf.HFModel``'s
    ``hf.``), where one prefix makes every key one of the module's."""
    state = read_weights(Path(source)) if isinstance(source, (str, Path)) else source
    pm.load_state_dict(state, strict=strict)
