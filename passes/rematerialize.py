"""Recompute in backward the cheap pointwise values ``autopar/ir/rematerialize.py`` names, rather than keep them.

Which values: ``SavedTensors.recomputed`` (the rule and why are in ``ir/rematerialize.py``: SwiGLU's
``silu(gate)`` and its product with ``up``, a norm's normalized input, their views), the memory the
planner priced; and the moves of activations that make them larger on each rank (``regathered_moves``):
sequence parallelism's all_gather of a norm's output, whose copy the projections reading it would keep
whole until their weight gradients, and context parallelism's gather of keys and values. Such a move is
made again in backward from the shard, as Megatron-LM's sequence-parallel linear layers gather their
input again for the weight gradient (Korthikanti et al. 2022, on sequence parallelism) and torch's context parallelism
gathers keys and values again, so the step keeps the shard the memory model charges (in its producer's
placement); ``planning/pricing.moved_again`` charges the second collective. How, in the two runtimes:

* **DTensor program** (eager autograd): each such node runs through ``Remembered``, which records its
  output with the op and arguments that made it; ``Rematerialized`` runs the program under
  ``torch.autograd.graph.saved_tensors_hooks``: when autograd saves a recorded output (the tensor itself,
  as the op returned it), pack keeps its recipe instead, the arguments packed in turn (a recorded one as its
  own recipe, any other as the enclosing hooks pack it: a gathered parameter as its shard, ``reshard.py``),
  and unpack, in backward, runs the op again. Inside a layer that activation checkpointing recomputes,
  ``torch.utils.checkpoint``'s hooks take precedence (autograd uses the innermost), and the layer's own
  recomputation makes the value again, as the pricer assumes for such layers.
* **Lowered program** (AOT autograd's joint graph, ``lower.py``): hooks cannot run in a trace, so
  ``Remembered`` marks the ops it traces (``torch.fx.traceback.annotate``); the partition tags the marked
  forward ops ``MUST_RECOMPUTE`` (``tag_recomputed``), and AOT autograd's partitioner saves their inputs and
  recomputes them in the backward graph.

Where we diverge from ``torch.utils.checkpoint`` (which would also recompute): it keeps a region's inputs and
reruns the whole region once per backward; a region here would be each saved value's own chain of one to
``MAX_CHAIN`` ops, recorded as they run, with no region boundaries to draw in the program.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

import torch
from torch import fx
from torch.distributed.tensor import DTensor
from torch.fx import traceback as fx_traceback
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils._pytree import tree_map

from autopar.core.placement import grows_locally, strs_to_placements
from autopar.ir.capture import is_view

from .insert_redistributes import redistribute, value_name
from .layout import gradient_in_spec_layout, in_captured_layout
from .reshard import (ChainedHooks, DTensorSpecs, Geometry, Hooks, ProgramUnderHooks, active_hooks, geometry_of,
                      local_of, specs_of, storage_address, view_again)
from .sequence_layout import reorder

RECOMPUTED = "autopar_recomputed"
"""The ``torch.fx.traceback.annotate`` key ``Remembered`` marks a traced op with (``tag_recomputed`` reads it)."""


@dataclass(frozen=True)
class _Packed:
    """A tensor argument of a recipe, as the hooks packed it."""

    saved: Any


class _Recipe:
    """How to make a value again: its op, and its arguments as packed (``RecomputedValues.pack``). One for all
    the saved references to the value: made once, at the first of them backward reads, and kept until the last
    (``pending``) has been read (q, k and v's matmuls keep one normed input)."""

    def __init__(self, op: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.op, self.args, self.kwargs = op, args, kwargs
        self.pending = 0  # saved references not yet read by backward
        self.value: Any = None  # made and not yet read by every reference


@dataclass
class _Made:
    """A recorded value (weakly, to tell a reused id apart), what made it, and its recipe once saved."""

    value: "weakref.ref[torch.Tensor]"
    op: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    recipe: _Recipe | None = None


@dataclass(frozen=True)
class _View:
    """A saved view of a recorded DTensor: of its local tensor (what an op ``run_locally`` runs reads: context
    parallelism's attention keeps its gathered keys' and values' local views), or a DTensor view of it (a
    projection's ``view`` of sequence parallelism's gathered norm output, which its matmul keeps). The
    DTensor's recipe, the local view's geometry (size, stride, storage offset), and for a DTensor view its
    mesh, placements, shape and stride."""

    recipe: _Recipe
    geometry: Geometry
    spec: DTensorSpecs | None = None
    made_geometry: Geometry | None = None  # of the recorded DTensor's local tensor, which ``geometry`` is read against


class RecomputedValues(ChainedHooks):
    """Pack and unpack hooks that keep a recorded value (or a view of a recorded DTensor, ``_View``) as its
    recipe and make it again in backward."""

    def __init__(self, outer: Hooks | None = None) -> None:
        super().__init__(outer)
        self._made: dict[int, _Made] = {}
        self._by_local: dict[int, int] = {}  # a recorded DTensor's local storage address -> its key in ``_made``
        self.recomputed = 0  # ops run again in backward (for tests and reports)

    def remember(self, value: torch.Tensor, op: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        key = id(value)
        address = _new_storage(value, args)

        def forget(_: Any) -> None:
            self._made.pop(key, None)
            if address is not None and self._by_local.get(address) == key:
                del self._by_local[address]
        self._made[key] = _Made(weakref.ref(value, forget), op, args, kwargs)
        if address is not None:
            self._by_local[address] = key

    def pack(self, tensor: torch.Tensor) -> Any:
        made = self._made.get(id(tensor))
        if made is not None and made.value() is tensor:
            return self._recipe(made)
        made = self._viewed(tensor) if self._by_local else None
        if made is None:
            return self.pack_other(tensor)
        local = local_of(tensor) if isinstance(tensor, DTensor) else tensor
        spec = specs_of(tensor) if isinstance(tensor, DTensor) else None
        value = made.value()
        return _View(self._recipe(made), geometry_of(local), spec,
                     geometry_of(local_of(value) if isinstance(value, DTensor) else value))

    def _viewed(self, tensor: torch.Tensor) -> _Made | None:
        """The record of the live DTensor ``tensor`` is a view of (a DTensor view, or a view of its local
        tensor), if any."""
        address = storage_address(local_of(tensor) if isinstance(tensor, DTensor) else tensor)
        made = self._made.get(self._by_local.get(address, -1))
        value = made.value() if made is not None else None
        return made if value is not None and storage_address(local_of(value)) == address else None

    def _recipe(self, made: _Made) -> _Recipe:
        if made.recipe is None:
            made.recipe = _Recipe(made.op, tree_map(self._pack_argument, made.args),
                                  tree_map(self._pack_argument, made.kwargs))
        made.recipe.pending += 1
        return made.recipe

    def _pack_argument(self, value: Any) -> Any:
        return _Packed(self.pack(value)) if isinstance(value, torch.Tensor) else value

    def unpack(self, saved: Any) -> Any:
        if isinstance(saved, _View):
            return view_again(local_of(self.unpack(saved.recipe)), saved.geometry, saved.spec, saved.made_geometry)
        if not isinstance(saved, _Recipe):
            return self.unpack_other(saved)
        if saved.value is None:
            args, kwargs = tree_map(self._unpack_argument, saved.args), tree_map(self._unpack_argument, saved.kwargs)
            with torch.no_grad():
                saved.value = saved.op(*args, **kwargs)
            self.recomputed += 1
        value, saved.pending = saved.value, saved.pending - 1
        if saved.pending <= 0:
            saved.value = None
        return value

    def _unpack_argument(self, value: Any) -> Any:
        return self.unpack(value.saved) if isinstance(value, _Packed) else value

    @classmethod
    def active(cls) -> "RecomputedValues | None":
        return active_hooks(cls)


def _new_storage(value: torch.Tensor, args: tuple[Any, ...]) -> int | None:
    """The address of ``value``'s local storage where ``value`` is a DTensor whose op made that storage (a
    gather; not a view or a guard of one of its ``args``, whose views are that argument's), else None."""
    if not isinstance(value, DTensor):
        return None
    local = local_of(value)
    if not local.untyped_storage().nbytes():
        return None
    address = storage_address(local)
    shared = any(storage_address(local_of(a) if isinstance(a, DTensor) else a) == address
                 for a in args if isinstance(a, torch.Tensor))
    return None if shared else address


class Remembered:
    """A program node's target ``op``, its output recorded with how it was made for the hooks running the
    program (the module doc) and its traced ops marked for the lowered program's partition."""

    def __init__(self, op: Callable[..., Any]):
        self.op = op
        self.__name__ = f"remembered_{getattr(op, '__name__', type(op).__name__)}".replace(".", "_")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with fx_traceback.annotate({RECOMPUTED: True}):
            value = self.op(*args, **kwargs)
        hooks = RecomputedValues.active()
        if hooks is not None and isinstance(value, torch.Tensor) and not any(value is a for a in args):
            hooks.remember(value, self.op, args, kwargs)  # (a guard handing its input on as it is: that one's)
        return value


PASSED_THROUGH = (gradient_in_spec_layout, in_captured_layout)
"""Functions earlier passes put around a program's views that pass a value on as it is (``layout.py``): a
reader of a recomputed view reads it through them, so they are made again with it."""


def recompute_in_backward(gm: fx.GraphModule, names: Collection[str]) -> int:
    """Make ``gm``'s nodes named in ``names`` (``SavedTensors.recomputed``), and the layout guards that pass
    one of them on (``PASSED_THROUGH``), run through ``Remembered``, in place; returns how many. Run the
    result under ``Rematerialized``."""
    remembered: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and (node.name in names or node.target in PASSED_THROUGH
                                           and node.args[0] in remembered):
            node.target = Remembered(node.target)
            remembered.add(node)
    if remembered:
        gm.recompile()
    return len(remembered)


def recomputed_op(node: fx.Node) -> Any:
    """The callable a program node runs, through ``Remembered``."""
    return node.target.op if isinstance(node.target, Remembered) else node.target


def regathered_moves(gm: fx.GraphModule, produced: Mapping[str, Sequence[str]], parameters: Collection[str],
                     mesh_shape: Sequence[int], keeps: Callable[[str, str], bool],
                     in_recomputed_layers: Collection[str]) -> set[str]:
    """The names of ``gm``'s redistributes of activations (not of ``parameters``, which ``reshard.py``
    gathers again) whose move makes the value larger on each rank (``grows_locally``, from the
    ``produced`` placements) and that a reader keeps for backward (``keeps(reader, value)``, by the captured
    names: ``CapturedGraph.keeps_what_it_reads``, what pricing reads), with the load-balanced layout's
    reorders after them (``sequence_layout.py``): values for ``recompute_in_backward`` to make again from
    the shard. Not the nodes ``in_recomputed_layers`` (``checkpoint.recomputed_with_layer``), whose
    checkpointing makes them again."""
    moves: set[str] = set()
    for node in gm.graph.nodes:
        if (node.op != "call_function" or node.target is not redistribute or node.args[0].name in parameters
                or node.name in in_recomputed_layers):
            continue
        source = produced.get(value_name(node.args[0]))
        if source is None or not grows_locally(strs_to_placements(source), strs_to_placements(node.args[1]),
                                               mesh_shape):
            continue
        reorders = [user for user in node.users if user.target is reorder]
        readers = [reader for user in node.users for reader in (user.users if user in reorders else [user])]
        if any(keeps(reader.name, node.args[0].name) for reader in readers):
            moves |= {node.name} | {user.name for user in reorders}
    return moves


class Rematerialized(ProgramUnderHooks):
    """A program whose recorded values are made again in backward rather than kept (the module doc)."""

    hooks_type = RecomputedValues


def tag_recomputed(joint: fx.GraphModule) -> int:
    """Tag the forward ops of AOT autograd's ``joint`` graph that ``Remembered`` marked ``MUST_RECOMPUTE``
    (the lowered program's partition), and the views of their outputs (the trace views a DTensor's local
    tensor as it wraps it, outside the marked op); returns how many. Backward ops traced from a marked op
    carry the mark too: only ops no tangent reaches are forward ones."""
    backward = {node for node in joint.graph.nodes if node.op == "placeholder" and node.name.startswith("tangents")}
    tagged: set[fx.Node] = set()
    for node in joint.graph.nodes:
        if any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
        elif node.op == "call_function" and (node.meta.get("custom", {}).get(RECOMPUTED)
                                             or (is_view(node) and node.all_input_nodes[0] in tagged)):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged.add(node)
    return len(tagged)

