"""Models built on the meta device: each rank allocates only its own shards and initializes them there.

A model larger than one host's memory (Llama 3 70B: 280 GB of fp32 weights, for each of a node's eight ranks)
cannot be built whole on every rank and sliced (``passes/shard_parameters.py``'s way). Built under
``torch.device("meta")`` instead, it holds no values; ``autoparallelize`` then hands each of its runtimes
``ShardedInit``, which

1. replaces every meta parameter and buffer the rank's program reads by a DTensor with the plan's
   placements whose local shard alone is allocated, filled with a mark (NaN; an integer dtype's least value),
   tied parameters kept tied (one DTensor for every module that holds the tensor);
2. runs the model's initialization on them (``init_weights(model)`` where given; otherwise torch's
   convention, each module's ``reset_parameters()`` and, as autopar's models recompute their non-persistent
   buffers, ``reset_buffers()``, children before parents, so a model-wide initialization has the last word
   as when its constructor calls it after building its children). An initialization that copies a whole
   value into a tensor (``weight.copy_(value)``, as Hugging Face's does for rotary tables) copies this rank's
   slice of it (``FullValuesCopiedToShards``: DTensor refuses a plain tensor beside a DTensor);
3. refuses to go on, on every rank alike, where a shard still holds its mark: the initialization left that
   parameter unwritten, and training it would be training garbage.

Tensors the model holds with values (built off meta, or loaded) keep them, whatever the initialization did.

Random values: on CUDA, DTensor's own tracker (torch's ``OffsetBasedRNGTracker``) draws each shard as its
slice of the full tensor's draw, so the weights are those one process would draw from rank 0's state. torch
has none for CPU meshes (``is_rng_supported_mesh``: a CPU generator cannot skip ahead to a shard's offset), so
on them ``ShardSeededDraws`` seeds each random op from a seed every rank shares, the op's index and the
rank's shard coordinates: ranks that hold the same shard draw the same values and different shards
independent ones (the same distribution as one process's weights, not the same numbers).

The user's model is left on the meta device once the runtime has taken its shards (``ShardedInit.release``).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.tensor._random as dtensor_random
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import full as dtensor_full
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.overrides import TorchFunctionMode

from autopar.core.errors import BadInputError
from autopar.core.placement import strs_to_placements
from autopar.runtime.mesh import job_device_type

InitWeights = Callable[[nn.Module], None]


def holds_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (built with no values)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def initialize_by_convention(model: nn.Module) -> None:
    """torch's convention for a model built without values: every module's ``reset_parameters()`` and
    ``reset_buffers()`` where it has them, each module's children before it."""
    for module in _children_first(model):
        for method in ("reset_parameters", "reset_buffers"):
            if callable(getattr(module, method, None)):
                getattr(module, method)()


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module


class ShardedInit:
    """Gives a meta-device model's parameters and buffers this rank's shards, initialized (module docstring).

    ``params`` and ``buffers`` are the FQNs (``named_parameters()``'s, ``named_buffers()``'s) this rank's
    program reads, each with its placements on ``mesh``; the model's other meta tensors stay on meta."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, params: Mapping[str, Sequence[str]],
                 buffers: Mapping[str, Sequence[str]], init_weights: InitWeights | None) -> None:
        self.model, self.mesh = model, mesh
        self.init_weights = init_weights or initialize_by_convention
        self._params, self._buffers = dict(params), dict(buffers)
        self._meta: list[tuple[nn.Module, str, bool, torch.Tensor]] = []  # (module, name, is_param, meta tensor)

    def run(self) -> None:
        """Steps 1-3 of the module docstring, with this process's CPU generator restored afterwards."""
        held = [t for t in [*self.model.parameters(), *self.model.buffers()] if not t.is_meta]
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            kept = [(t, t.clone()) for t in held]  # values the model came with (rank 0's) stay
            self._allocate_shards()
            _share_rank_zero_generator()
            with _shard_seeded_draws(self.mesh), FullValuesCopiedToShards():
                self.init_weights(self.model)
            for tensor, value in kept:
                tensor.copy_(value)
            self._refuse_unwritten()

    def release(self) -> None:
        """Put the model's meta tensors back (the runtime holds its own shards now)."""
        for module, name, is_param, meta in self._meta:
            (module._parameters if is_param else module._buffers)[name] = meta

    def _allocate_shards(self) -> None:
        made: dict[int, torch.Tensor] = {}  # id of a meta tensor -> its DTensor (tied tensors share one)
        for is_param, wanted in ((True, self._params), (False, self._buffers)):
            for fqn, module, name, meta in _slots(self.model, is_param):
                if not meta.is_meta or (id(meta) not in made and fqn not in wanted):
                    continue
                if id(meta) not in made:
                    shard = _marked_shard(meta, self.mesh, wanted[fqn])
                    made[id(meta)] = nn.Parameter(shard, meta.requires_grad) if is_param else shard
                self._meta.append((module, name, is_param, meta))
                (module._parameters if is_param else module._buffers)[name] = made[id(meta)]

    def _refuse_unwritten(self) -> None:
        """Raise on every rank where any rank's shard of a parameter or buffer still holds its mark."""
        model = self.model
        named = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        unwritten = sorted(fqn for fqn in {**self._params, **self._buffers}
                           if isinstance(named.get(fqn), DTensor) and _still_marked(named[fqn].to_local()))
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, unwritten)
        left = sorted({fqn for names in everyone for fqn in names})
        if left:
            self.release()
            how = ("init_weights" if self.init_weights is not initialize_by_convention else
                   "the modules' reset_parameters()/reset_buffers() (none was given init_weights=)")
            raise BadInputError(
                f"the model was built on the meta device and {how} left {len(left)} of its tensors without values "
                f"({', '.join(left[:5])}{', ...' if len(left) > 5 else ''}): give autoparallelize an "
                "init_weights(model) that sets every parameter and buffer, or build the model on the CPU")


def _slots(model: nn.Module, parameters: bool) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """(FQN, module, attribute name, tensor) of every parameter (or buffer) slot, tied ones each time."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        held = module._parameters if parameters else module._buffers
        for name, tensor in held.items():
            if tensor is not None:
                yield (f"{prefix}.{name}" if prefix else name), module, name, tensor


def _marked_shard(meta: torch.Tensor, mesh: DeviceMesh, placements: Sequence[str]) -> DTensor:
    """A DTensor of ``meta``'s shape and dtype with ``placements``, its local shard alone allocated on the mesh's
    device (DTensor's own factory) and filled with the mark ``_still_marked`` looks for."""
    return dtensor_full(meta.shape, _mark(meta.dtype), dtype=meta.dtype, device_mesh=mesh,
                        placements=strs_to_placements(placements))


def _mark(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _still_marked(local: torch.Tensor) -> bool:
    """A float shard with any NaN left, or an integer shard holding nothing but its dtype's least value (a
    boolean shard cannot tell)."""
    if local.numel() == 0 or local.dtype == torch.bool:
        return False
    if local.dtype.is_floating_point or local.dtype.is_complex:
        return bool(torch.isnan(local).any())
    return bool((local == torch.iinfo(local.dtype).min).all())


def _share_rank_zero_generator() -> None:
    """Every rank's CPU generator in rank 0's state: plain (not DTensor) random ops of the initialization, and
    ``ShardSeededDraws``'s seed, then agree."""
    on_device = torch.get_rng_state().to(job_device_type())  # the backend's device (NCCL's: the rank's GPU)
    dist.broadcast(on_device, src=0)
    torch.set_rng_state(on_device.cpu())


@contextlib.contextmanager
def _shard_seeded_draws(mesh: DeviceMesh) -> Iterator[None]:
    """``ShardSeededDraws`` as DTensor's RNG tracker while the initialization runs, on a CPU mesh (module
    docstring); on CUDA, torch's own tracker."""
    if mesh.device_type != "cpu":
        yield
        return
    before = dtensor_random._rng_tracker
    dtensor_random._rng_tracker = ShardSeededDraws(int(torch.randint(0, 2 ** 62, ()).item()))
    try:
        yield
    finally:
        dtensor_random._rng_tracker = before


class FullValuesCopiedToShards(TorchFunctionMode):
    """``shard.copy_(value)`` of a plain tensor ``value`` of the whole tensor's shape (broadcast to it) into a
    DTensor copies the rank's slice of it (``distribute_tensor`` slices locally); other calls run as they are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and isinstance(args[0], DTensor) and not isinstance(args[1], DTensor):
            shard, value = args[0], args[1]
            whole = value.to(shard.device).expand(shard.shape)
            args = (shard, distribute_tensor(whole, shard.device_mesh, shard.placements, src_data_rank=None),
                    *args[2:])
        return func(*args, **kwargs)


class ShardSeededDraws:
    """DTensor's RNG tracker for CPU meshes, which torch lacks: each random op on a DTensor draws its local
    shard from a generator seeded by ``seed``, the op's index and the rank's coordinates on the mesh dims the
    tensor is sharded over. DTensor's dispatch asks a tracker for ``distribute_region_enabled`` and enters its
    ``_distribute_region(spec, generator)`` around the local op (``torch/distributed/tensor/_dispatch.py``)."""

    distribute_region_enabled = True

    def __init__(self, seed: int) -> None:
        self.seed, self.ops = seed, 0

    @contextlib.contextmanager
    def _distribute_region(self, spec: DTensorSpec, generator: torch.Generator | None = None) -> Iterator[None]:
        coordinate = spec.mesh.get_coordinate() or []
        shard = tuple(c if p.is_shard() else 0 for c, p in zip(coordinate, spec.placements))
        key = hashlib.blake2b(repr((self.seed, self.ops, shard)).encode(), digest_size=8).digest()
        self.ops += 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int.from_bytes(key, "little") >> 1)
            yield
