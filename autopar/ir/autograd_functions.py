"""A model's own ``torch.autograd.Function``s captured with their own backward.

``torch.export`` traces through ``Function.apply`` into the forward's ops and records nothing of the
Function's ``backward``: the captured step's gradient would be the derivative of those ops, which a
straight-through estimator (``round`` forward, identity backward), a gradient reversal or scale, or Phi-MoE's
router estimator do not compute. Silently, a wrong gradient; and where the backward is the derivative (Bloom's
GELU), a correct one only by that coincidence.

So while the step is traced (``capturing_functions``), each call of a Function defined outside torch is recorded
as one op, ``autopar::function_forward(tensors, key)``: its tensor arguments, and ``key``, which names the
Function and its other arguments in this process's ``_CALLS`` (equal calls, one key). Its derivative is another
op, ``autopar::function_backward(tensors, grads, key)``, which runs the Function again under autograd and asks
autograd for its inputs' gradients: the Function's own ``backward`` computes them (its forward runs twice a
step, as under recomputation, and needs no state saved beside its inputs; a forward that draws random numbers,
which would draw others the second time, is refused, naming the Function and the draws). Both ops are opaque
(``torch.library.custom_op``), so the planner runs them replicated as any op DTensor has no strategy for, and a
lowered program keeps them as calls. Every rank captures the same model in the same order, so a key names the
same call on every rank. torch's own Functions (reentrant checkpointing's) are traced as before: their backward
is their forward's derivative. A gradient hook the forward registers on a tensor (``Tensor.register_hook``),
which the captured step cannot keep, is refused, naming where.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch.autograd.function import Function
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.core.errors import UnsupportedModelError


@dataclass(frozen=True)
class _Call:
    """A Function and its arguments but the tensors (``spec``: the arguments' tree; ``constants``: each
    leaf that is not a tensor, ``_TENSOR`` where one is)."""

    function: type[Function]
    spec: pytree.TreeSpec
    constants: tuple[Any, ...]

    def arguments(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        given = iter(tensors)
        leaves = [next(given) if c is _TENSOR else c for c in self.constants]
        return pytree.tree_unflatten(leaves, self.spec)

    def run(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        outputs = _ORIGINAL_APPLY(self.function, *self.arguments(tensors))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise UnsupportedModelError(
                f"{_name(self.function)}.forward returns {[type(o).__name__ for o in outputs]}: autopar captures a "
                "torch.autograd.Function returning a tensor or a tuple of tensors")
        return outputs


_TENSOR = object()  # the mark of a tensor leaf in ``_Call.constants``
_CALLS: list[_Call] = []
_ORIGINAL_APPLY = Function.apply.__func__  # type: ignore[attr-defined]


@contextlib.contextmanager
def capturing_functions() -> Iterator[None]:
    """While the step is traced, a call of a Function defined outside torch runs as ``function_forward``."""
    def apply(cls: type[Function], *args: Any, **kwargs: Any) -> Any:
        if cls.__module__.startswith("torch."):
            return _ORIGINAL_APPLY(cls, *args, **kwargs)
        if kwargs:
            raise UnsupportedModelError(f"{_name(cls)}.apply is called with keyword arguments "
                                        f"({', '.join(kwargs)}): autopar captures positional ones")
        leaves, spec = pytree.tree_flatten(list(args))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        call = _Call(cls, spec, tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves))
        outputs = function_forward(tensors, _key(call))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    register_hook = torch.Tensor.register_hook
    Function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
    torch.Tensor.register_hook = _refuse_gradient_hook  # type: ignore[method-assign]
    try:
        yield
    finally:
        Function.apply = classmethod(_ORIGINAL_APPLY)  # type: ignore[method-assign, assignment]
        torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]


def _refuse_gradient_hook(tensor: torch.Tensor, hook: Any) -> Any:
    """``Tensor.register_hook`` in the traced forward: refused, naming where (the captured step records no hooks,
    so the gradient would silently not be what the hook makes it)."""
    caller = next((f for f in reversed(traceback.extract_stack()[:-1])
                   if "/torch/" not in f.filename and "/autopar/" not in f.filename), None)
    where = f" at {os.path.basename(caller.filename)}:{caller.lineno} in {caller.name}" if caller else ""
    raise UnsupportedModelError(
        f"the model's forward registers a gradient hook on a tensor{where}: the captured step keeps no hooks, so "
        "the gradient would not be what the hook makes it; write the hook as a torch.autograd.Function (its "
        "forward returning its input, its backward the hook), whose backward autopar keeps")


def _key(call: _Call) -> int:
    """The key of ``call``: that of an equal call made before (so repeated layers calling a Function alike are
    alike ops, which pipelines and the layer stack read), or a new one."""
    for key, made in enumerate(_CALLS):
        if made == call:
            return key
    _CALLS.append(call)
    return len(_CALLS) - 1


@torch.library.custom_op("autopar::function_forward", mutates_args=())
def function_forward(tensors: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """The outputs of the recorded call ``key`` on ``tensors`` (copies: an op's outputs may not alias its inputs,
    and a gradient reversal returns its input's view)."""
    with torch.no_grad():
        return [o.clone() for o in _CALLS[key].run(tensors)]


@function_forward.register_fake
def _(tensors: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    with torch.no_grad(), _RandomDraws() as draws:
        outputs = _CALLS[key].run(tensors)
    if draws.ops:
        raise UnsupportedModelError(
            f"{_name(_CALLS[key].function)}.forward draws random numbers ({', '.join(sorted(draws.ops))}): "
            "autopar runs a Function's forward again to compute its backward, which would draw others, so its "
            "gradient would not match its forward; draw them outside the Function and pass them in as an argument")
    return [torch.empty_like(o) for o in outputs]


class _RandomDraws(TorchDispatchMode):
    """The random ops (``torch.Tag.nondeterministic_seeded``: rand, bernoulli, dropout...) run while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.ops.add(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@torch.library.custom_op("autopar::function_backward", mutates_args=())
def function_backward(tensors: list[torch.Tensor], grads: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """The gradient of every tensor argument of call ``key`` (zeros for one autograd gives none or that takes
    none), computed by the Function's own backward: its forward run again under autograd."""
    inputs = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in tensors]
    with torch.enable_grad():
        outputs = _CALLS[key].run(inputs)
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    wanted = [i for i in inputs if i.requires_grad]
    found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                 if pairs and wanted else [None] * len(wanted))
    got = [next(found) if i.requires_grad else None for i in inputs]
    return [torch.zeros_like(i) if g is None else g.clone(memory_format=torch.contiguous_format)
            for i, g in zip(inputs, got)]  # copies: the backward may return a gradient it was given


@function_backward.register_fake
def _(tensors: list[torch.Tensor], grads: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    tensors, key = inputs
    ctx.save_for_backward(*tensors, *output)
    ctx.key, ctx.count = key, len(tensors)


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], None]:
    saved = ctx.saved_tensors
    tensors, outputs = list(saved[:ctx.count]), saved[ctx.count:]
    filled = [torch.zeros_like(o) if g is None else g for o, g in zip(outputs, grads)]
    computed = function_backward(tensors, filled, ctx.key)
    return [g if t.is_floating_point() or t.is_complex() else None for t, g in zip(tensors, computed)], None


function_forward.register_autograd(_backward, setup_context=_setup_context)


def _name(function: type[Function]) -> str:
    return f"{function.__module__}.{function.__qualname__}"
