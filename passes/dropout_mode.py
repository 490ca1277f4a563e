"""Dropout that follows the module's mode: ``pm.eval()`` turns it off, as ``model.eval()`` does.

The step is captured in training mode, so its dropout is in the graph as ops that drop whatever mode the
module is in: ``aten.native_dropout(x, p, True)`` (``nn.Dropout``, ``F.dropout``) and fused attention's
``dropout_p`` (transformers passes its attention dropout there while training). ``follow_mode`` makes each
read the mode the runtime runs in (``in_mode``, set around each call from the module's ``training``): in eval
mode ``native_dropout`` runs with ``train=False`` (its input, and a mask of ones) and attention with
``dropout_p=0``. It rewrites an argument, not the op, so ``run_locally`` keeps it on the ops it runs on local
shards. The lowered runtime traces its graphs once, in training mode: a forward in eval mode runs the DTensor
program instead (``ParallelModule.forward``), and a training step in eval mode is refused.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
from torch import fx

from autopar.core.errors import BadInputError
from autopar.ir.capture import FUSED_ATTENTION
from autopar.ir.layers import ATTENTION_DROPOUT_ARG, attention_argument

_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
_TRAIN_ARG = 2  # native_dropout(input, p, train)

_TRAINING = contextvars.ContextVar("autopar_training", default=True)


@contextlib.contextmanager
def in_mode(training: bool) -> Iterator[None]:
    """Run the program's dropout as a module in this mode would (training: it drops)."""
    token = _TRAINING.set(training)
    try:
        yield
    finally:
        _TRAINING.reset(token)


def train_in_mode(train: bool) -> bool:
    """``native_dropout``'s ``train`` argument in the mode the program runs in."""
    return train and _TRAINING.get()


def dropout_p_in_mode(p: float) -> float:
    """Fused attention's ``dropout_p`` in the mode the program runs in."""
    return p if _TRAINING.get() else 0.0


def follow_mode(gm: fx.GraphModule) -> int:
    """Make the dropout of ``gm`` read the mode (``train_in_mode``, ``dropout_p_in_mode``); returns how many
    ops drop while training."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _NATIVE_DROPOUT and node.args[_TRAIN_ARG]:
            _read_in_mode(gm, node, _TRAIN_ARG, None, train_in_mode)
            rewritten += 1
        elif node.target is FUSED_ATTENTION and attention_argument(node, "dropout_p", ATTENTION_DROPOUT_ARG, 0.0):
            _read_in_mode(gm, node, ATTENTION_DROPOUT_ARG, "dropout_p", dropout_p_in_mode)
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _read_in_mode(gm: fx.GraphModule, node: fx.Node, position: int, keyword: str | None, reader: object) -> None:
    """Replace ``node``'s argument at ``position`` (or its ``keyword`` argument) with ``reader`` of it, a node
    of ``node``'s module (its layer: checkpointing and pipeline stages keep them together)."""
    by_keyword = keyword is not None and keyword in node.kwargs
    with gm.graph.inserting_before(node):
        read = gm.graph.call_function(reader, (node.kwargs[keyword] if by_keyword else node.args[position],))
    read.meta = {key: node.meta[key] for key in ("nn_module_stack", "stack_trace") if key in node.meta}
    if by_keyword:
        node.kwargs = {**node.kwargs, keyword: read}
    else:
        node.args = (*node.args[:position], read, *node.args[position + 1:])


def refuse_step_that_cannot_train(training: bool, dropout_ops: int) -> None:
    """A training step refused where it cannot train as captured: with gradients off (``torch.no_grad``,
    ``torch.inference_mode``: its backward has nothing to run, where torch would fail deep inside), or of a
    module in eval mode whose program drops (``dropout_ops`` ops; the lowered graphs drop as traced)."""
    if not torch.is_grad_enabled():
        raise BadInputError("step() runs forward and backward, and gradients are off here (torch.no_grad() or "
                            "torch.inference_mode()): call it with gradients on; for the loss alone, pm.eval() "
                            "and pm(inputs, targets) (a one-stage plan's)")
    if not training and dropout_ops:
        raise BadInputError(f"step() trains, and this module is in eval mode, which turns its dropout ({dropout_ops} "
                            "ops) off: call pm.train() before training (pm.eval() is for forward-only evaluation)")
