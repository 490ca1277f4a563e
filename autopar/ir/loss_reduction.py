"""How a step's loss reduces its batch, so that microbatches add up to the global batch's loss and gradients.

The runtime runs a step's batch as ``m`` microbatches (gradient accumulation, pipeline schedules), each
computing the captured loss on its piece, and accumulates ``w_i * loss_i`` (and its gradients). Which
weights make that sum the loss of the whole batch depends on how the loss reduces it:

* ``DIVIDED``, a sum divided by a count computed from the inputs alone: ``sum(terms) / divisor``, as
  ``F.cross_entropy`` averages over the targets it counts (``ignore_index`` leaves padding out) and a masked
  mean divides by its mask's sum; or a linear combination of such quotients over the same count
  (``label_smoothing``'s two terms). ``w_i = divisor_i / sum_j divisor_j`` makes ``sum_i w_i loss_i`` the sum of
  every term over every counted target (Megatron-Core's per-token loss and Hugging Face Trainer's
  ``num_items_in_batch`` fix the same for gradient accumulation). With ``w_i = 1/m`` the microbatches' means
  were averaged instead: tiny-gpt with padding spread unevenly over two microbatches ended three SGD steps
  2.6e-2 from single-process training. Where the quotients' divisors differ on a microbatch (two masks), no
  weights are exact, and it is weighted as ``AVERAGED``, with a warning.
* ``SUMMED``, a sum over the batch (``reduction='sum'``): ``w_i = 1``; with ``1/m`` the loss and every
  gradient came out ``m`` times too small.
* ``AVERAGED``, anything else (a mean over elements, which every microbatch holds as many of; a sum of
  several terms, such as a mixture-of-experts' auxiliary loss beside its cross-entropy): ``w_i = 1/m``.

A sum or a count qualifies only over a value with elements for every sample of the batch (its element
count a multiple of the batch size), so a constant divisor (a temperature) or a sum of the weights (a
regularizer) leaves the loss ``AVERAGED``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import fx

from autopar.core.batch import batch_size_of
from autopar.ir.capture import CapturedGraph

DIVIDED, SUMMED, AVERAGED = "divided", "summed", "averaged"

_aten = torch.ops.aten
_SUMS = (_aten.sum.default, _aten.sum.dim_IntList)
_SCALINGS = (_aten.mul.Scalar, _aten.div.Scalar, _aten.mul.Tensor, _aten.div.Tensor)  # by a number: args[1]
_PASS_THROUGH = (_aten._to_copy.default, _aten.clamp.default, _aten.clamp_min.default)
"""What a count passes through on its way to the division: dtype conversions, and a clamp from below
(``mask.sum().clamp(min=1)``, guarding a batch that counts nothing), which leaves any count it does not raise."""


@dataclass(frozen=True)
class LossReduction:
    """How the captured loss reduces the batch (the module docstring's kinds); for ``DIVIDED``, the graph of the
    divisors of its quotients (one, or one per term of a linear combination) and which user inputs (positions) it
    reads."""

    kind: str
    divisor: fx.GraphModule | None = None
    reads: tuple[int, ...] = ()

    def weights(self, pieces: Sequence[Sequence[torch.Tensor]],
                divisor: Callable[[Sequence[torch.Tensor]], torch.Tensor] | None = None) -> list[float]:
        """Each microbatch's weight in the step's loss: ``pieces`` are the microbatches' user inputs (in the
        captured order, each as the capture saw it, a whole microbatch). ``divisor`` computes a piece's divisors
        (one per quotient) where the pieces are something else (a rank's slices of the microbatches: the runtime
        runs the graph on them as DTensors); by default, ``divisor_of``."""
        m = len(pieces)
        if self.kind == SUMMED:
            return [1.0] * m
        if self.kind == AVERAGED or m == 1:
            return [1.0 / m] * m
        divisor = divisor or self.divisor_of
        per_term = torch.stack([divisor(piece).double().reshape(-1) for piece in pieces])  # [m, terms]
        if not bool((per_term == per_term[:, :1]).all()):
            warnings.warn("autopar: the loss adds quotients whose divisors differ on a microbatch, so no weights make "
                          "the microbatches' losses add up to the batch's: each is weighted 1/m", stacklevel=3)
            return [1.0 / m] * m
        divisors = per_term[:, 0]
        return (divisors / divisors.sum()).tolist()

    def divisor_of(self, piece: Sequence[torch.Tensor]) -> torch.Tensor:
        """The divisors (one per quotient) of one microbatch of user inputs ``piece`` (``DIVIDED`` only)."""
        return torch.stack([d.double().reshape(()) for d in self.divisor(*(piece[i] for i in self.reads))])


def loss_reduction(captured: CapturedGraph) -> LossReduction:
    """How ``captured``'s loss reduces its batch (``DIVIDED``, ``SUMMED`` or ``AVERAGED``)."""
    loss = captured.node(captured.loss_node)
    batch = batch_size_of([captured.node(name).meta["val"].shape for name in captured.user_inputs])
    kinds = captured.gradient_kinds()
    if batch and _sums_the_batch(loss, batch):
        return LossReduction(SUMMED)
    divisors = [_count_divisor(term, batch, kinds) for term in _linear_terms(loss)] if batch else [None]
    if all(d is not None for d in divisors):
        return _divided(captured, divisors)
    return LossReduction(AVERAGED)


def _count_divisor(node: fx.Node, batch: int, kinds: dict[str, str]) -> fx.Node | None:
    """The divisor of ``node`` where it is a sum over the batch divided by a count of it computed from the inputs
    alone, else None."""
    if node.target is not _aten.div.Tensor or not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return None
    numerator, divisor = node.args[:2]
    count = _through_passes(divisor)
    if _sums_the_batch(numerator, batch) and _sums_the_batch(count, batch) and kinds[divisor.name] == "none":
        return divisor
    return None


def _linear_terms(node: fx.Node) -> list[fx.Node]:
    """The terms of ``node`` as a linear combination: through sums, differences and scalings by numbers."""
    if node.target in (_aten.add.Tensor, _aten.sub.Tensor) and all(isinstance(a, fx.Node) for a in node.args[:2]):
        return _linear_terms(node.args[0]) + _linear_terms(node.args[1])
    if node.target in _SCALINGS and isinstance(node.args[0], fx.Node) and isinstance(node.args[1], (int, float)):
        return _linear_terms(node.args[0])
    return [node]


def _divided(captured: CapturedGraph, divisors: list[fx.Node]) -> LossReduction:
    """``DIVIDED`` with the graph of ``divisors`` over the user inputs they read; ``AVERAGED`` where they read
    other placeholders (buffers, parameters: not a count of the batch's)."""
    ancestors = set().union(*(_ancestors(d) for d in divisors))
    placeholders = [n for n in ancestors if n.op == "placeholder"]
    if any(n.name not in captured.user_inputs and n.name not in captured.constants for n in placeholders):
        return LossReduction(AVERAGED)
    reads = [n for n in captured.graph.nodes if n in ancestors and n.name in captured.user_inputs]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {n: graph.placeholder(n.name) for n in reads}
    for node in captured.graph.nodes:
        if node in ancestors and node not in env:
            if node.op == "placeholder":  # a lifted constant
                env[node] = graph.get_attr(node.name)
            else:
                env[node] = graph.node_copy(node, env.__getitem__)
    graph.output([env[d] for d in divisors])
    _whole_sums_as_sum(graph)
    _made_beside(graph, env[reads[0]] if reads else None)
    root = torch.nn.Module()
    for node in placeholders:
        if node.name in captured.constants:
            root.register_buffer(node.name, captured.constants[node.name], persistent=False)
    return LossReduction(DIVIDED, fx.GraphModule(root, graph),
                         tuple(captured.user_inputs.index(n.name) for n in reads))


def _made_beside(graph: fx.Graph, first_input: fx.Node | None) -> None:
    """Tensors the divisor graph makes from nothing (``scalar_tensor``, ``full``...) made on its first input's
    device, not on the device recorded at capture: a model built on the meta device is captured there, and the
    runtime computes the divisors on the inputs as a step is given them, or on their shards."""
    made = [n for n in graph.nodes if isinstance(n.kwargs.get("device"), torch.device)]
    if not made or first_input is None:
        return
    with graph.inserting_after(first_input):
        device = graph.call_function(getattr, (first_input, "device"))
    for node in made:
        node.kwargs = {**node.kwargs, "device": device}


def _whole_sums_as_sum(graph: fx.Graph) -> None:
    """``sum.dim_IntList(x, [])`` (the decomposition's sum over every dim) as ``sum.default(x)``, the same value:
    DTensor's sharding propagation reads the empty list as no dim reduced and keeps a split on the 0-dim result
    (the runtime runs the divisor on DTensors where a rank holds its slice of the batch)."""
    for node in graph.nodes:
        if node.target is _aten.sum.dim_IntList and list(node.args[1]) == [] and not _keeps_dims(node):
            with graph.inserting_before(node):
                whole = graph.call_function(_aten.sum.default, (node.args[0],), {"dtype": node.kwargs.get("dtype")})
            node.replace_all_uses_with(whole)
            graph.erase_node(node)


def _keeps_dims(node: fx.Node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen


def _through_passes(node: fx.Node) -> fx.Node:
    while node.target in _PASS_THROUGH and isinstance(node.args[0], fx.Node) and _no_upper_clamp(node):
        node = node.args[0]
    return node


def _no_upper_clamp(node: fx.Node) -> bool:
    """Whether ``node`` (of ``_PASS_THROUGH``) leaves large values alone: not a clamp with a maximum."""
    if node.target is not _aten.clamp.default:
        return True
    return (node.args[2] if len(node.args) > 2 else node.kwargs.get("max")) is None


def _sums_the_batch(node: fx.Node, batch: int) -> bool:
    """Whether ``node`` sums a value holding elements for every sample (its count a multiple of ``batch``) into
    one number."""
    if node.target not in _SUMS or not isinstance(node.args[0], fx.Node):
        return False
    summed, out = node.args[0].meta.get("val"), node.meta.get("val")
    return isinstance(summed, torch.Tensor) and isinstance(out, torch.Tensor) and out.numel() == 1 \
        and summed.numel() >= batch and summed.numel() % batch == 0

