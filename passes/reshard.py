"""Reshard after forward: a parameter gathered for an op is not held until that op's backward.

Under FSDP / ZeRO-3 a parameter is sharded on the data-parallel dims and ``insert_redistributes``
gathers it (``redistribute``, ``S -> R``) right before each op that needs it whole. Left alone,
autograd would keep that gathered copy from the op's forward to its backward (``mm`` saves its
weight), so after the forward every layer's full parameters would be alive at once: the memory
sharding was meant to save, and more than the cost model charges. FSDP frees the gathered copy after
forward and gathers again in backward (Zhao et al., "PyTorch FSDP", VLDB 2023, ``reshard_after_forward``;
Rajbhandari et al., SC20, ZeRO-3); this pass does the same in autopar's flat program:

* each redistribute of a parameter (or of a view of one) becomes ``gather_parameter``, which does the
  same move and records the gathered tensor's storage with how to make it again;
* ``ResavedParameters`` runs the program under ``torch.autograd.graph.saved_tensors_hooks``: when
  autograd saves (a view of) a recorded gathered tensor, pack keeps the shard, the target placements
  and the view's geometry instead, and unpack, in backward, gathers again and rebuilds the view.

Every gathered parameter is resharded; there is no plan choice to hold them instead. Holding them
would cost the peak memory of ZeRO-2 (every full parameter alive during backward) for the
communication of ZeRO-3's forward gathers, and ZeRO-2 (``fsdp=2``), which the mesh search prices,
reaches that peak with one gather per step instead of one per use.

Only programs that gather parameters run under these hooks. Autograd uses only the innermost
``saved_tensors_hooks``, so hooks the caller runs the step under (``torch.autograd.graph.save_on_cpu``,
say) would no longer see the program's saved tensors; ours hand every tensor that is not a gathered
parameter to them. Torch has no public way to read the enclosing hooks: we read them with
``torch._C._autograd._top_saved_tensors_default_hooks`` (what AOTAutograd uses), where it exists.

Inside a layer that activation checkpointing recomputes, ``torch.utils.checkpoint``'s own hooks take
precedence and its recompute gathers again, so a parameter is gathered once more in backward in every
mode, which is what ``autopar.planning.pricing`` charges (``regathered`` edges). Where we diverge from FSDP2
(``fully_shard``): it gathers a module's parameters in hooks around the module; autopar's program is an
aten graph whose unit is the op and the saved tensor, so the saved tensor is what is made lazily.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from autopar.ir.capture import WEIGHT_KINDS, CapturedGraph

from .insert_redistributes import redistribute

_ACTIVE: list[Any] = []
"""The saved-tensor hooks of the programs running forward now (innermost last: ``ProgramUnderHooks``), where
``gather_parameter`` (and ``rematerialize.Remembered``) record what they made."""


Geometry = tuple[torch.Size, tuple[int, ...], int]
"""A view's size, stride and storage offset: what ``as_strided`` takes to make it again."""
DTensorSpecs = tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]]
"""A DTensor view's mesh, placements, global shape and stride: what wraps its local view again."""


@dataclass(frozen=True)
class _Gathered:
    """A gathered parameter: its local tensor (weakly, to tell a reused address apart) and its source."""

    local: "weakref.ref[torch.Tensor]"
    source: DTensor
    placements: tuple[str, ...]
    dtype: torch.dtype  # of the gathered copy (a mixed-precision program gathers a master's shard cast to it)
    geometry: Geometry  # of its local tensor, which a saved view's geometry is read against


@dataclass(frozen=True)
class _Regather:
    """What a saved (view of a) gathered parameter is replaced by until backward unpacks it."""

    source: DTensor
    placements: tuple[str, ...]
    dtype: torch.dtype
    local_geometry: Geometry  # of the local view
    spec: DTensorSpecs  # of the saved DTensor
    gathered_geometry: Geometry  # of the gathered local tensor it is a view of


Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]
"""A (pack, unpack) pair of ``torch.autograd.graph.saved_tensors_hooks``."""


class ChainedHooks:
    """Saved-tensor hooks that keep some tensors their own way and hand every other to the hooks they run
    inside (``outer``: the caller's, or another program's, ``enclosing_hooks``)."""

    def __init__(self, outer: Hooks | None = None) -> None:
        self._outer = outer

    def pack_other(self, tensor: torch.Tensor) -> Any:
        return self._outer[0](tensor) if self._outer else tensor

    def unpack_other(self, saved: Any) -> Any:
        return self._outer[1](saved) if self._outer else saved


class ParameterRegather(ChainedHooks):
    """Pack and unpack hooks that save a gathered parameter as its shard and gather it again in backward."""

    def __init__(self, outer: Hooks | None = None) -> None:
        super().__init__(outer)
        self._gathered: dict[int, _Gathered] = {}
        self.regathered = 0  # gathers run again in backward (for tests and reports)

    def remember(self, gathered: DTensor, source: DTensor, placements: tuple[str, ...]) -> None:
        local = local_of(gathered)
        self._gathered[storage_address(local)] = _Gathered(weakref.ref(local), source, placements, gathered.dtype,
                                                           geometry_of(local))

    def held(self) -> int:
        """How many of the parameters gathered in this forward are still alive (0 once it has returned:
        backward holds shards, not gathered copies)."""
        return sum(entry.local() is not None for entry in self._gathered.values())

    def pack(self, tensor: torch.Tensor) -> Any:
        local = local_of(tensor) if isinstance(tensor, DTensor) else None
        entry = self._gathered_entry(local) if local is not None else None
        if entry is None:
            return self.pack_other(tensor)
        return _Regather(entry.source, entry.placements, entry.dtype, geometry_of(local), specs_of(tensor),
                         entry.geometry)

    def _gathered_entry(self, local: torch.Tensor) -> _Gathered | None:
        """The record of the gathered parameter whose local tensor ``local`` is (a view of), if any."""
        entry = self._gathered.get(storage_address(local))
        base = entry.local() if entry is not None else None
        return entry if base is not None and storage_address(base) == storage_address(local) else None

    def unpack(self, saved: Any) -> Any:
        if not isinstance(saved, _Regather):
            return self.unpack_other(saved)
        with torch.no_grad():
            whole = local_of(redistribute(saved.source.to(saved.dtype), saved.placements))
        self.regathered += 1
        return view_again(whole, saved.local_geometry, saved.spec, saved.gathered_geometry)

    @classmethod
    def active(cls) -> "ParameterRegather | None":
        return active_hooks(cls)


def gather_parameter(x: DTensor, placements: tuple[str, ...], compute_dtype: torch.dtype | None = None,
                     reduce_dtype: torch.dtype | None = None) -> DTensor:
    """``redistribute`` for a parameter: the same move, recorded so that a saved copy is made again in backward.

    With ``compute_dtype`` (mixed precision, ``passes/mixed_precision.py``: ``x`` is, or is a view of, an
    fp32 master) the shard is cast before it moves, so the gather carries compute-dtype bytes, and the
    gradient goes back reduced in ``reduce_dtype`` onto the fp32 shard (``_CastThenMove``)."""
    if compute_dtype is not None and x.dtype != compute_dtype:
        moved = _CastThenMove.apply(x, placements, compute_dtype, reduce_dtype or x.dtype)
    else:
        moved = redistribute(x, placements)
    hooks = ParameterRegather.active()
    if hooks is not None and moved is not x:
        hooks.remember(moved, x, placements)
    return moved


class _CastThenMove(torch.autograd.Function):
    """Forward: the shard cast to the compute dtype, then moved (gathered). Backward: the gradient, in
    ``reduce_dtype``, moved back to the shard's placements (reduce-scattered where it is partial over
    the ranks that gathered, as DTensor's own redistribute backward does) and handed back in the
    shard's dtype. FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` makes the same pair of
    collectives; a plain cast followed by ``redistribute`` would reduce in the compute dtype."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, placements: tuple[str, ...], compute_dtype: torch.dtype,
                reduce_dtype: torch.dtype) -> DTensor:
        ctx.source_placements, ctx.source_dtype, ctx.reduce_dtype = x.placements, x.dtype, reduce_dtype
        return redistribute(x.to(compute_dtype), placements)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None]:
        moved = grad.to(ctx.reduce_dtype).redistribute(grad.device_mesh, ctx.source_placements)
        return moved.to(ctx.source_dtype), None, None, None


class ProgramUnderHooks(nn.Module):
    """A program run under saved-tensor hooks of ``hooks_type`` (``pack``, ``unpack``), new for each forward
    (``last``), handed the caller's hooks for what they do not keep, and active while it runs
    (``active_hooks``)."""

    hooks_type: Callable[..., Any]

    def __init__(self, program: nn.Module):
        super().__init__()
        self.program = program
        self.last = self.hooks_type()

    def forward(self, *args: Any) -> Any:
        self.last = self.hooks_type(enclosing_hooks())
        with _recording(self.last), torch.autograd.graph.saved_tensors_hooks(self.last.pack, self.last.unpack):
            return self.program(*args)


def active_hooks(kind: type) -> Any:
    """The innermost hooks of ``kind`` a program running forward now is under, if any."""
    return next((hooks for hooks in reversed(_ACTIVE) if isinstance(hooks, kind)), None)


class ResavedParameters(ProgramUnderHooks):
    """A program whose gathered parameters are not kept for backward (see the module doc)."""

    hooks_type = ParameterRegather


def reshard_after_forward(gm: fx.GraphModule, parameter_values: set[str]) -> int:
    """Turn ``gm``'s redistributes of parameters (``parameter_values``: placeholders of parameters and
    views of them) into ``gather_parameter``, in place; returns how many. Run the result under
    ``ResavedParameters``."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is redistribute and node.args[0].name in parameter_values:
            node.target = gather_parameter
            changed += 1
    if changed:
        gm.recompile()
    return changed


def parameter_values(captured: CapturedGraph) -> set[str]:
    """Names of the values that are parameters or views of one (the same every microbatch): the
    redistributes ``reshard_after_forward`` turns into gathers."""
    return {name for name, kind in captured.gradient_kinds().items() if kind in WEIGHT_KINDS}


@contextlib.contextmanager
def _recording(hooks: Any) -> Iterator[None]:
    _ACTIVE.append(hooks)
    try:
        yield
    finally:
        _ACTIVE.pop()


def enclosing_hooks() -> Hooks | None:
    """The ``saved_tensors_hooks`` the caller runs under, if any (see the module doc)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        return top(True) if top is not None else None
    except TypeError:  # another signature in another torch version: run without chaining
        return None


def geometry_of(local: torch.Tensor) -> Geometry:
    return local.size(), local.stride(), local.storage_offset()


def specs_of(tensor: DTensor) -> DTensorSpecs:
    return tensor.device_mesh, tuple(tensor.placements), tensor.shape, tensor.stride()


def view_again(whole: torch.Tensor, geometry: Geometry, spec: DTensorSpecs | None = None,
               laid_out: Geometry | None = None) -> torch.Tensor:
    """A saved view made again from ``whole``, the local tensor it was a view of (gathered again): its
    ``geometry``, wrapped as the DTensor ``spec`` describes where it was one. ``laid_out``: the geometry the
    tensor it was a view of had, which ``geometry`` is read against; ``whole`` made again in another memory
    layout is first copied into that one (DTensor's gather outside autograd may return a column-major copy of
    what it returned row-major in forward: read with the forward's strides, it gave a transposed weight)."""
    if laid_out is not None and geometry_of(whole) != laid_out:
        whole = laid_out_as(whole, laid_out)
    local = whole.as_strided(*geometry)
    if spec is None:
        return local
    mesh, placements, shape, stride = spec
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def laid_out_as(tensor: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """``tensor``'s values in a new storage, at ``geometry`` (size, stride, storage offset) in it."""
    size, stride, offset = geometry
    extent = 1 + sum((n - 1) * step for n, step in zip(size, stride)) if all(size) else 0
    storage = torch.empty(offset + extent, dtype=tensor.dtype, device=tensor.device)
    return storage.as_strided(size, stride, offset).copy_(tensor)


def local_of(tensor: DTensor) -> torch.Tensor:
    with torch.no_grad():  # to_local outside autograd is the local tensor itself, no new graph node
        return tensor.to_local()


def storage_address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
