"""Capture a training step as an aten-level FX graph with shapes on every node.

We reuse ``torch.export`` (non-strict, so ordinary Python models trace) on a wrapper module that runs
forward and loss, then decompose to core aten ops, the level at which DTensor registers its sharding
strategies, but for the ops kept whole (``KEPT_WHOLE``: fused attention; ``KEPT_POINTWISE``: SiLU, so the
program saves for backward what eager PyTorch saves). Backward is not captured: autopar takes the
"forward graph + differentiable collectives" design (docs/architecture.md "Execution"), so the cost
model prices each forward op together with its backward, and at run time autograd derives the backward
of the sharded program.

Export runs on fake tensors, so a model built on the meta device (hundreds of billions of parameters) is
captured without allocating it. A tensor the model holds under several names (a tied embedding) becomes
one placeholder under the name ``named_parameters`` keeps (``CapturedGraph.aliases`` records the others),
and the checks export records as ops that return nothing are dropped (``_drop_assertions``). This
module is not for pricing or placing: it only records what the program is.

Planning traces what differs, once: a model's stack of identical layers (the longest ``ModuleList`` or
``Sequential`` whose children have the same class, parameter shapes and settings) is traced with
only its first ``TRACED_LAYERS`` layers, and the ``CapturedGraph`` records how many real layers each
traced one stands for (``LayerStack``; ``CapturedGraph.weight``): the first traced layer is the
model's first (it reads what comes before the stack), the last is the model's last (what follows
reads it), and the one between stands for all the others, which read their predecessor and feed
their successor. Every op and every edge of the real graph then has its counterpart, counted as
often as it occurs. Capturing a 126-layer model costs what a 3-layer one does. The trace
is kept only when its layers tie node for node (``_tie_repeated_layers``); otherwise the whole model
is captured. The runtime always captures the whole model and finds each op's strategy by its tie key
(``ir/bind.py``), which names the same op in both graphs.
"""

from __future__ import annotations

import hashlib
import inspect
import operator
import os
import re
import sys
import sysconfig
import traceback
import warnings
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx, nn

from autopar.core.errors import BadInputError, UnsupportedModelError, innermost_frame
from autopar.ir.autograd_functions import capturing_functions
from autopar.ir.buffer_writes import WRITE_BUFFER, keep_buffer_writes, written
from autopar.ir.dtensor_rules import register_derivative_rules
from autopar.ir.saved_tensors import SavedTensors, find_saved_tensors

_MODEL_PREFIX = "model."
_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")
_LAYER = re.compile(r"^(.*?\.\d+)(?=\.|$)")  # "layers.3.attn.q" -> "layers.3"

register_derivative_rules()  # the captured ops' derivatives DTensor has no rule for by itself (``dtensor_rules.py``)


class TrainingStep(nn.Module):
    """The forward half of one training step, the one place its form is decided: ``loss_fn(model(*inputs),
    targets)`` with targets, ``loss_fn(model(*inputs))`` without, and ``model(*inputs, targets)`` (or
    ``model(*inputs)``) without a ``loss_fn``, the model then returning the loss itself."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, has_targets: bool):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.has_targets = has_targets

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is None:
            return self.model(*args)
        if not self.has_targets:
            return self.loss_fn(self.model(*args))
        *inputs, targets = args
        return self.loss_fn(self.model(*inputs), targets)


WEIGHT_KINDS = ("param", "frozen")
"""The gradient kinds (``CapturedGraph.gradient_kinds``) of weights: a parameter or a view of one, the same every
microbatch, trainable or frozen."""


@dataclass
class CapturedGraph:
    """The decomposed forward+loss graph and what each placeholder stands for."""

    graph_module: fx.GraphModule
    params: dict[str, str]  # placeholder name -> parameter fqn (model-relative)
    buffers: dict[str, str]  # placeholder name -> buffer fqn
    constants: dict[str, torch.Tensor]  # placeholder name -> lifted constant tensor
    user_inputs: list[str]  # placeholder names of example inputs, then targets (if any)
    loss_node: str  # name of the node whose value is the scalar loss
    tie_keys: dict[str, str] = field(default_factory=dict)  # node name -> key shared by repeated layers
    stack: LayerStack | None = None  # the repeated layers, when only some of them were traced
    aliases: dict[str, str] = field(default_factory=dict)  # tied fqn -> the fqn whose placeholder stands for both
    autocast: str | None = None  # the dtype of the torch.autocast the step was traced under (its casts are ops)
    frozen: frozenset[str] = frozenset()  # parameter placeholders whose every real parameter has requires_grad False
    leading_layers: tuple[str, ...] = ()  # the first layers, which do not repeat, before those that do

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def node(self, name: str) -> fx.Node:
        return self._nodes_by_name()[name]

    def has_node(self, name: str) -> bool:
        return name in self._nodes_by_name()

    def _nodes_by_name(self) -> dict[str, fx.Node]:
        if not hasattr(self, "_by_name"):
            self._by_name = {n.name: n for n in self.graph.nodes}
        return self._by_name

    def param_shapes(self) -> dict[str, torch.Size]:
        """Every parameter of the model (traced or stood for by a traced layer) and its shape."""
        return {real: self.node(name).meta["val"].shape
                for name, fqn in self.params.items() for real in self.real_fqns(fqn)}

    def num_params(self) -> int:
        return sum(int(shape.numel()) for shape in self.param_shapes().values())

    def weight(self, name: str) -> float:
        """How many occurrences in the real model node ``name`` stands for (``LayerStack.weight`` for a
        node of a traced layer, its parameters included; else 1)."""
        index = self.traced_layer(name)
        return 1.0 if index is None else self.stack.weight(index)

    def traced_layer(self, name: str) -> int | None:
        """The index of the traced layer node ``name`` belongs to (None: outside a traced stack)."""
        if self.stack is None:
            return None
        if not hasattr(self, "_traced_layer"):
            self._traced_layer = {n.name: self.stack.split(path)[0] for n in self.graph.nodes
                                  if self.stack.holds(path := self._path_of(n))}
        return self._traced_layer.get(name)

    def _path_of(self, node: fx.Node) -> str:
        if node.op == "placeholder":
            return self.params.get(node.name) or self.buffers.get(node.name) or ""
        return module_path(node)

    def real_fqns(self, fqn: str) -> list[str]:
        """The real model's names that a traced parameter or buffer ``fqn`` stands for: itself, or that
        name in every real layer its traced layer stands for (``LayerStack.real_layers``)."""
        if self.stack is None or not self.stack.holds(fqn):
            return [fqn]
        index, rest = self.stack.split(fqn)
        return [f"{self.stack.path}.{j}{rest}" for j in self.stack.real_layers(index)]

    def gradient_kinds(self) -> dict[str, str]:
        """Per node: ``param`` (a parameter, or a view of one: its gradient is a weight gradient),
        ``frozen`` (a frozen parameter, or a view of one: a weight without a gradient, ``frozen_parameters``),
        ``activation`` (depends on a trainable parameter, so it gets a gradient), or ``none`` (no gradient:
        inputs, buffers, what is computed from them and frozen parameters alone, and what the model cut
        gradients from, ``KEPT_GRADIENT_CUTS``)."""
        if not hasattr(self, "_grad_kinds"):
            frozen = self.frozen_parameters()
            kinds: dict[str, str] = {}
            for node in self.graph.nodes:
                sources = [kinds.get(a.name, "none") for a in node.all_input_nodes]
                if node.target in KEPT_GRADIENT_CUTS:
                    kinds[node.name] = "none"
                elif node.name in self.params:
                    kinds[node.name] = "frozen" if node.name in frozen else "param"
                elif getattr(node.target, "is_view", False) and sources in (["param"], ["frozen"]):
                    kinds[node.name] = sources[0]
                else:
                    kinds[node.name] = "activation" if any(k in ("param", "activation") for k in sources) else "none"
            self._grad_kinds = kinds
        return self._grad_kinds

    def written_buffers(self) -> frozenset[str]:
        """The buffer placeholders the step writes (``buffer_writes.py``), with their repeated-layer twins (same tie
        key): a decision they share is placed as the written ones must be."""
        if not hasattr(self, "_written_planned"):
            names = written(self.graph)
            keys = {self.tie_keys.get(p, p) for p, fqn in self.buffers.items() if fqn in names}
            self._written_planned = frozenset(p for p in self.buffers if self.tie_keys.get(p, p) in keys)
        return self._written_planned

    def frozen_parameters(self) -> frozenset[str]:
        """The parameter placeholders planned as frozen: those of ``frozen`` whose repeated-layer twins (same tie
        key) are all frozen too. Their decisions are shared, and so are their prices: a layer frozen beside
        trainable twins (the first layers of a partly frozen stack) is priced as trainable, which overstates
        its memory and gradient sync, never understates them; the runtime gives it no gradient all the same."""
        if not self.frozen:
            return frozenset()
        if not hasattr(self, "_frozen_planned"):
            trainable_keys = {self.tie_keys.get(name, name) for name in self.params if name not in self.frozen}
            self._frozen_planned = frozenset(name for name in self.frozen
                                             if self.tie_keys.get(name, name) not in trainable_keys)
        return self._frozen_planned

    def saved_for_backward(self, float8: frozenset[str] = frozenset()) -> SavedTensors:
        """What autograd keeps for backward, per node, with ``float8`` (node names) run as float8 linears
        (``saved_tensors.py``; one meta run each, cached)."""
        if not hasattr(self, "_saved"):
            self._saved: dict[frozenset[str], SavedTensors] = {}
        if float8 not in self._saved:
            self._saved[float8] = find_saved_tensors(self, float8)
        return self._saved[float8]

    def keeps_what_it_reads(self, consumer: fx.Node, arg: fx.Node, float8: frozenset[str] = frozenset()) -> bool:
        """Whether ``consumer`` saves for its backward the value its input ``arg`` carries (the value itself
        or a view of it), or is a view whose readers do (``t`` of a weight that ``mm`` keeps), with ``float8``
        (node names) run as float8 linears (which keep a float8 copy of their input instead): a copy moved to
        a larger placement for ``consumer`` (a parameter gathered under FSDP, an activation gathered under
        sequence parallelism) would then be held from forward to backward, which the runtime avoids by
        moving it again in backward (``passes/reshard.py``, ``passes/rematerialize.py``)."""
        root = view_root(arg)
        saved = self.saved_for_backward(float8)
        readers = through_views(consumer)
        if root.name in self.params:
            return any((reader.name, root.name) in saved.parameters_kept for reader in readers)
        producer = root.args[0] if root.op == "call_function" and root.target is operator.getitem else root
        keepers = saved.read_savers.get(producer.name, frozenset())
        return any(reader.name in keepers for reader in readers)


@dataclass(frozen=True)
class LayerStack:
    """A stack of identical layers of which capture traced the first ``traced`` (at least 3) of ``layers``."""

    path: str  # model-relative module path of the stack ("blocks", "model.layers")
    layers: int
    traced: int

    def weight(self, index: int) -> float:
        """Real layers traced layer ``index`` stands for: the first and the last one each, those between
        share the rest."""
        if index in (0, self.traced - 1):
            return 1.0
        return (self.layers - 2) / (self.traced - 2)

    def real_layers(self, index: int) -> range:
        """The real layers traced layer ``index`` stands for."""
        if index == 0:
            return range(0, 1)
        if index == self.traced - 1:
            return range(self.layers - 1, self.layers)
        return range(index, self.layers - 1, self.traced - 2)

    def holds(self, path: str) -> bool:
        """Whether module or parameter path ``path`` lies inside a layer of the stack."""
        head = self.path + "."
        return path.startswith(head) and path[len(head):].split(".", 1)[0].isdigit()

    def split(self, path: str) -> tuple[int, str]:
        """(layer index, the rest of the path after it, with its leading dot) of a path it holds."""
        index, _, rest = path[len(self.path) + 1:].partition(".")
        return int(index), "." + rest if rest else ""


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is an aten view op (its output shares its input's storage)."""
    return node.op == "call_function" and getattr(node.target, "is_view", False)


def view_root(node: fx.Node) -> fx.Node:
    """The value ``node`` is a view of (through any chain of views), or ``node`` itself."""
    while is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def through_views(node: fx.Node) -> list[fx.Node]:
    """``node`` and, if it is a view, every node that reads it through views (views included)."""
    return [node] + ([n for user in node.users for n in through_views(user)] if is_view(node) else [])


TRACED_LAYERS = 3
"""Layers of a repeated stack that planning traces: the first, one between and the last
(``LayerStack.weight``), whose tie keys must match node for node."""


def capture(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    example_targets: torch.Tensor | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    traced_layers: int | None = None,
    dtype: torch.dtype | None = None,
) -> CapturedGraph:
    """Export ``loss_fn(model(*example_inputs), example_targets)`` and decompose it to core aten.

    With ``traced_layers`` (planning), a stack of identical layers is traced that many layers deep and
    the graph records the rest (``LayerStack``); the whole model is captured when it has no such stack,
    or when the short trace does not tie node for node. Without it (the runtime), the whole model.

    With ``dtype`` (a mixed-precision plan's compute dtype, for the runtime's program), the step is
    traced as the model runs in that dtype: its floating-point parameters and buffers, inputs and
    targets in ``dtype`` (``_in_dtype``), so masks, casts and constants it makes follow them.

    A model or ``loss_fn`` that cannot be called with these arguments raises BadInputError; an error
    the model raises while torch traces it, UnsupportedModelError naming the source line."""
    if dtype is not None:
        cast = lambda t: t.to(dtype) if t is not None and t.is_floating_point() else t  # noqa: E731
        with _in_dtype(model, dtype):
            return capture(model, [cast(t) for t in example_inputs], cast(example_targets), loss_fn,
                           traced_layers=traced_layers)
    _check_arguments(model, len(example_inputs), example_targets is not None, loss_fn)
    stack = repeated_stack(model) if traced_layers else None
    if stack is not None and stack[1] > traced_layers:
        path, layers = stack
        try:
            with _shortened(model, path, traced_layers):
                captured = _export(model, example_inputs, example_targets, loss_fn)
        except UnsupportedModelError:
            captured = None  # the model's forward needs all its layers: capture them all
        if captured is not None and _ties_node_for_node(captured, path, traced_layers):
            captured.stack = LayerStack(path, layers, traced_layers)
            return _with_frozen(captured, model)
    return _with_frozen(_export(model, example_inputs, example_targets, loss_fn), model)


def _with_frozen(captured: CapturedGraph, model: nn.Module) -> CapturedGraph:
    """``captured`` knowing its frozen parameters (``CapturedGraph.frozen``): those whose every real parameter
    in ``model`` has ``requires_grad=False`` (a traced layer's parameter stands for one in each layer it
    stands for)."""
    real = dict(model.named_parameters(remove_duplicate=False))
    captured.frozen = frozenset(name for name, fqn in captured.params.items()
                                if all(r in real and not real[r].requires_grad for r in captured.real_fqns(fqn)))
    return captured


def _export(model: nn.Module, example_inputs: Sequence[torch.Tensor], example_targets: torch.Tensor | None,
            loss_fn: Callable[..., torch.Tensor] | None) -> CapturedGraph:
    step = TrainingStep(model, loss_fn, example_targets is not None)
    args = tuple(example_inputs) + ((example_targets,) if example_targets is not None else ())
    try:
        with warnings.catch_warnings(), capturing_functions():  # the model's autograd.Functions keep their backward
            warnings.simplefilter("ignore")
            exported = torch.export.export(step, args, strict=False)
            _cut_gradients_out_of_no_grad_regions(exported.graph_module)
            exported = exported.run_decompositions(_decompositions())
    except Exception as exc:
        where = _raised_in(exc)
        if where is not None and _is_autopar_code(where.filename):
            raise  # autopar's own code failed while torch traced the step: a bug, keep its traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        at = f" (raised at {where.filename}:{where.lineno} in {where.name}{_module_at(exc, where, model)})" \
            if where is not None else ""
        raise UnsupportedModelError(
            f"could not capture {type(model).__name__} with torch.export: {first}{at}{_what_to_change(exc)}"
        ) from exc
    _check_static_shapes(exported.graph_module.graph)
    captured = _describe(exported)
    captured.autocast = _autocast_around(args)
    return captured


def _autocast_around(args: Sequence[torch.Tensor | None]) -> str | None:
    """The dtype of the ``torch.autocast`` on for the inputs' device while the step is traced (torch.export
    then records its casts as ops of the graph), else None."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    on = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)  # none on meta
    return str(torch.get_autocast_dtype(device)) if on else None


DATA_DEPENDENT = ("the step branches on, or sizes a tensor by, the values of a tensor (data-dependent control flow): "
                  "compute both branches and pick with torch.where, keep masks at a fixed shape instead of "
                  "boolean indexing or nonzero, or branch on shapes and settings, which capture sees")
"""What to change where a model's control flow or shapes depend on tensor values, which planning on fake
tensors cannot know."""


def _what_to_change(exc: BaseException) -> str:
    """A hint for the errors torch.export raises on data-dependent control flow; else nothing."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    chain = [exc, exc.__cause__, exc.__context__]
    return f"; {DATA_DEPENDENT}" if any(isinstance(e, GuardOnDataDependentSymNode) for e in chain) else ""


def _module_at(exc: BaseException, where: traceback.FrameSummary, model: nn.Module) -> str:
    """`` of module PATH (Class)`` for the model's submodule whose method raised at ``where``, or ''."""
    error: BaseException | None = exc
    while error is not None:
        for frame, lineno in traceback.walk_tb(error.__traceback__):
            if (frame.f_code.co_filename, lineno) == (where.filename, where.lineno):
                owner = frame.f_locals.get("self")
                path = next((p for p, m in model.named_modules() if m is owner), None)
                if path is not None:
                    return f" of {'module ' + path if path else 'the model'} ({type(owner).__name__})"
        error = error.__cause__ or error.__context__
    return ""


def _check_static_shapes(graph: fx.Graph) -> None:
    """Refuse a step whose tensors' shapes depend on tensor values (boolean indexing, ``nonzero``): the
    planner prices and shards shapes it knows. Names the model's source line that made the first one."""
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape):
            line = (node.meta.get("stack_trace") or "").strip().splitlines()
            at = f" at {line[-2].strip()}: {line[-1].strip()}" if len(line) >= 2 else ""
            module = f" in module {module_path(node)}" if module_path(node) else ""
            raise UnsupportedModelError(f"{node.target}{module} makes a tensor of shape {list(val.shape)}, known only "
                                        f"at run time{at}; {DATA_DEPENDENT}")


def _check_arguments(model: nn.Module, inputs: int, has_targets: bool,
                     loss_fn: Callable[..., torch.Tensor] | None) -> None:
    """Refuse a model or loss that cannot take the training step's arguments (``TrainingStep``)."""
    model_args = inputs + (1 if has_targets and loss_fn is None else 0)
    what = f"{inputs} example input(s)" + (" and the targets (no loss_fn: the model gets them last)"
                                           if model_args > inputs else "")
    _check_callable(model.forward, model_args, f"{type(model).__name__}.forward cannot take {what}")
    if loss_fn is not None:
        fn = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
        form = "loss_fn(output, targets)" if has_targets else "loss_fn(output), as no example_targets were given"
        _check_callable(fn, 1 + has_targets, f"loss_fn {getattr(fn, '__qualname__', fn)} cannot be called as {form}")


def _check_callable(fn: Callable[..., Any], positional: int, what: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the trace will tell
    try:
        signature.bind(*range(positional))
    except TypeError as exc:
        raise BadInputError(f"{what}: {exc}") from None


def _raised_in(exc: BaseException | None) -> traceback.FrameSummary | None:
    """The innermost frame outside torch, the standard library and ``_export`` itself in which ``exc``
    (or, first, the error it wraps) was raised: the model's (or autopar's) line that failed."""
    skipped = (os.path.dirname(torch.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep, "<")
    return innermost_frame(exc, lambda frame: not frame.filename.startswith(skipped)
                           and (frame.filename, frame.name) != (__file__, "_export"))


def _is_autopar_code(filename: str) -> bool:
    """Whether ``filename`` is autopar's own code; its model zoo is not: a built-in model is the user's
    model here, traced with the user's inputs."""
    own = tuple(os.path.dirname(sys.modules[name].__file__) + os.sep  # loaded by ``import autopar``: ir
                for name in ("autopar", "autopar.cost_models", "autopar.passes"))  # imports none of them
    return filename.startswith(own) and not filename.startswith(os.path.join(own[0], "models") + os.sep)


def repeated_stack(model: nn.Module) -> tuple[str, int] | None:
    """(module path, length) of the model's longest ``ModuleList``/``Sequential`` of at least three
    alike layers (``_layer_signature``), or None."""
    best: tuple[str, int] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 3:
            continue
        if best is not None and len(module) <= best[1]:
            continue
        if len(set(_layer_signatures(list(module)))) == 1:
            best = (path, len(module))
    return best


def _layer_signatures(layers: list[nn.Module]) -> list[tuple]:
    """What must match for layers to compute alike: each submodule's class and settings (plain
    attributes, except one that counts the layers: ``layer_idx``), parameter and buffer shapes."""
    settings = [{(sub_path, k): v for sub_path, sub in layer.named_modules() for k, v in vars(sub).items()
                 if not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple, type(None)))}
                for layer in layers]
    counters = {k for k in settings[0] if [s.get(k) for s in settings] == list(range(len(layers)))}
    return [(tuple((p, type(m).__name__) for p, m in layer.named_modules()),
             tuple((n, tuple(t.shape), t.dtype) for n, t in layer.named_parameters()),
             tuple((n, tuple(t.shape), t.dtype) for n, t in layer.named_buffers()),
             tuple(sorted((k, repr(v)) for k, v in s.items() if k not in counters)))
            for layer, s in zip(layers, settings)]


@contextmanager
def _shortened(model: nn.Module, path: str, layers: int) -> Iterator[None]:
    """The model with its stack at ``path`` cut to its first ``layers`` layers (restored after)."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    whole = getattr(parent, name)
    setattr(parent, name, type(whole)(*list(whole)[:layers]) if isinstance(whole, nn.Sequential)
            else nn.ModuleList(list(whole)[:layers]))
    try:
        yield
    finally:
        setattr(parent, name, whole)


@contextmanager
def _in_dtype(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """The model with its floating-point parameters and buffers replaced by uninitialized tensors of
    ``dtype`` (restored after): export only reads their metadata. A tensor held under several names
    (a tied weight) gets one replacement, so the tie is kept. The replacements are allocated like the
    originals, which costs a copy of the model at ``dtype`` while the trace runs."""
    replaced: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict, str, torch.Tensor]] = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if id(t) not in replaced:
                    new = torch.empty_like(t, dtype=dtype)
                    replaced[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
                saved.append((table, name, t))
                table[name] = replaced[id(t)]
    try:
        yield
    finally:
        for table, name, t in saved:
            table[name] = t


def _ties_node_for_node(captured: CapturedGraph, path: str, traced: int) -> bool:
    """Whether every node of the traced layers shares its tie key with one node of each other traced
    layer (so one traced layer prices them all)."""
    stack = LayerStack(path, traced, traced)
    groups = Counter(captured.tie_keys[n.name] for n in captured.graph.nodes
                     if n.op == "call_function" and stack.holds(module_path(n)))
    return bool(groups) and all(count == traced for count in groups.values())


FUSED_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default
ATTENTION_QUERY_DIM = 2
"""The sequence dim of fused attention's queries and output, ``[batch, heads, seq, head_dim]``."""
VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
"""The reshaping views of a captured graph (a sequence split moves through them: ``planning/strategies.py``)."""
KEPT_WHOLE = (FUSED_ATTENTION,)
"""Ops captured whole rather than decomposed (fused attention: its math decomposition would
materialize the s x s score matrix that the fused kernel never stores). Planning gives each a local
sharding rule (``planning/strategies.py``, ``LOCAL_RULES``)."""
KEPT_POINTWISE = (torch.ops.aten.silu.default,)
"""Pointwise ops captured whole because their decomposition keeps more for backward than the op does, as
eager PyTorch runs them: ``aten.silu`` saves only its input (its derivative in torch's
``tools/autograd/derivatives.yaml`` is ``silu_backward(grad, self)``), while core aten's ``x * sigmoid(x)``
(``torch/_decomp/decompositions.py``, ``silu``) keeps ``sigmoid(x)`` too, and in 16-bit keeps the input and
the sigmoid upcast to fp32 (``pw_cast_for_opmath``). ``silu`` and ``silu_backward`` carry
``torch.Tag.pointwise``, from which DTensor registers its pointwise strategy (``_ops/_pointwise_ops.py``),
so planning and the runtime shard them as any pointwise op, with no rule of ours."""


KEPT_GRADIENT_CUTS = (torch.ops.aten.detach.default,)
"""Kept, not decomposed: core aten makes ``detach`` an ``alias``, a view gradients flow through, where the model
cut them (``x.detach()``: a stop-gradient, a target computed from the model's own output). The runtimes run
the captured step under autograd, which reads a ``detach`` as the model did."""


def _decompositions() -> dict:
    """Core aten decompositions, except the ops of ``KEPT_WHOLE``, ``KEPT_POINTWISE`` and ``KEPT_GRADIENT_CUTS``."""
    table = torch.export.default_decompositions()
    for op in (*KEPT_WHOLE, *KEPT_POINTWISE, *KEPT_GRADIENT_CUTS):
        table.pop(op, None)
    return table


def _cut_gradients_out_of_no_grad_regions(graph_module: fx.GraphModule) -> None:
    """Each value computed under ``torch.no_grad()`` in the model's forward (exported as a
    ``wrap_with_set_grad_enabled(False, ...)`` region, which decomposition inlines and forgets) leaves its
    region through a ``detach``: as in the model, no gradient flows back into the region."""
    regions = [n for n in graph_module.graph.nodes if n.target is torch.ops.higher_order.wrap_with_set_grad_enabled
               and n.args and n.args[0] is False]
    for region in regions:
        outputs = [u for u in region.users if u.target is operator.getitem] or [region]
        for value in outputs:
            with graph_module.graph.inserting_after(value):
                cut = graph_module.graph.call_function(torch.ops.aten.detach.default, (value,))
            value.replace_all_uses_with(cut, delete_user_cb=lambda user: user is not cut)
    if regions:
        graph_module.recompile()


def _describe(exported: torch.export.ExportedProgram) -> CapturedGraph:
    from torch.export.graph_signature import InputKind  # torch.export loads dynamo: only capture needs it

    gm = exported.graph_module
    _drop_assertions(gm.graph)
    _drop_unit_restrides(gm.graph)
    aliases = _merge_tied(exported)
    params, buffers, constants, user_inputs = {}, {}, {}, []
    for spec in exported.graph_signature.input_specs:
        if _strip_prefix(spec.target or "") in aliases:
            continue  # a tied name: its placeholder is gone, its uses read the kept one's
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            params[name] = _strip_prefix(spec.target)
        elif spec.kind == InputKind.BUFFER:
            buffers[name] = _strip_prefix(spec.target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constants[name] = exported.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(name)
    outputs = exported.graph_signature.output_specs
    _refuse_writes(outputs)
    keep_buffer_writes(gm, {i: _strip_prefix(spec.target) for i, spec in enumerate(outputs)
                            if spec.kind.name == "BUFFER_MUTATION"})
    returned = [spec for spec in outputs if spec.kind.name == "USER_OUTPUT"]
    loss = returned[0].arg.name
    _check_scalar_loss(gm, loss, len(returned))
    captured = CapturedGraph(gm, params, buffers, constants, user_inputs, loss, aliases=aliases)
    captured.tie_keys, captured.leading_layers = _tie_repeated_layers(gm.graph, params, buffers)
    return captured


def _refuse_writes(outputs: Sequence[Any]) -> None:
    """Refuse a step that writes into its parameters or inputs (torch.export lists each write as an output
    beside the loss: ``x.add_`` on an input, a parameter changed in the forward), naming them. Writes into
    buffers are kept (``buffer_writes.py``); a parameter or input written in place is not something the
    planner can place or the runtime write back, and would leave the written tensors stale."""
    writes = [spec for spec in outputs if spec.kind.name not in ("USER_OUTPUT", "BUFFER_MUTATION")]
    if not writes:
        return
    named = ", ".join(f"{_WRITTEN.get(spec.kind.name, spec.kind.name.lower())} {_strip_prefix(spec.target or '?')}"
                      for spec in writes)
    raise UnsupportedModelError(
        f"the training step writes into tensors in place ({named}): autopar plans steps that write only into "
        "their buffers (BatchNorm's running statistics, counters); compute the new value out of place instead, "
        "or keep the written tensor in a buffer (register_buffer)")


_WRITTEN = {"PARAMETER_MUTATION": "parameter", "USER_INPUT_MUTATION": "input"}
"""How a write's kind (``OutputKind`` name) is said in ``_refuse_writes``'s message."""


def _returns_nothing(target: Any) -> bool:
    """Whether ``target`` is an aten op whose schema returns nothing."""
    return isinstance(target, torch._ops.OpOverload) and not target._schema.returns


def _drop_assertions(graph: fx.Graph) -> None:
    """Erase the ops that return nothing and that nothing reads: the checks torch.export records
    (``aten._assert_tensor_metadata`` of a ``.to(dtype)``, ``_assert_async``, ``_assert_scalar``,
    ``sym_constrain_range``). They held on the fake tensors of the trace; in the runtime's program their
    arguments are DTensors, whose global metadata such a check was not written for, and an op with no
    output has no placement to plan. A data-dependent assertion of the model's is dropped with them: it
    is the model's check of its inputs, which single-process training of the same batches runs."""
    for node in list(graph.nodes):
        if node.op == "call_function" and not node.users and _returns_nothing(node.target):
            graph.erase_node(node)
    graph.owning_module.recompile()


def _drop_unit_restrides(graph: fx.Graph) -> None:
    """Read each ``as_strided`` that restrides only dims of size 1 as its input: the same shape, the same elements
    in the same order (a memory-format relabel of nothing: adaptive pooling's ``[b, c, 1, 1]`` output,
    FocalNet's and Swinv2's poolers), which DTensor has no strategy for, so it ran replicated, gathering the
    batch."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.as_strided.default \
                and _restrides_unit_dims_only(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.owning_module.recompile()


def _restrides_unit_dims_only(node: fx.Node) -> bool:
    """Whether ``as_strided(x, size, stride, storage_offset)`` keeps ``x``'s shape, offset and, on every dim
    longer than 1, stride."""
    x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    size, stride = node.args[1], node.args[2]
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
    if not isinstance(x, torch.Tensor) or list(size) != list(x.shape):
        return False
    return offset in (None, x.storage_offset()) and all(s == t for n, s, t in zip(size, stride, x.stride()) if n > 1)


def _merge_tied(exported: torch.export.ExportedProgram) -> dict[str, str]:
    """Make each tied parameter or buffer (one tensor under several names, as GPT-2's ``lm_head.weight``
    is its ``wte.weight``) one placeholder, and return the names dropped -> the name kept.

    torch.export lifts a tied tensor once per name, each use reading one of the placeholders, where
    ``nn.Module.named_parameters`` keeps the first name only. Keeping that name's placeholder for every
    use gives planning one parameter to place and the runtime one tensor to shard, whose gradient
    autograd sums over both uses, as in the unsharded model."""
    from torch.export.graph_signature import InputKind

    kept: dict[int, fx.Node] = {}
    aliases: dict[str, str] = {}
    nodes = {n.name: n for n in exported.graph_module.graph.nodes if n.op == "placeholder"}
    for spec in exported.graph_signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            continue
        tensor = exported.state_dict.get(spec.target, exported.constants.get(spec.target))
        if tensor is None:
            continue
        node = nodes[spec.arg.name]
        first = kept.setdefault(id(tensor), node)
        if first is not node:
            node.replace_all_uses_with(first)
            exported.graph_module.graph.erase_node(node)
            aliases[_strip_prefix(spec.target)] = _strip_prefix(_target_of(exported, first.name))
    exported.graph_module.recompile()
    return aliases


def _target_of(exported: torch.export.ExportedProgram, placeholder: str) -> str:
    return next(s.target for s in exported.graph_signature.input_specs if s.arg.name == placeholder)


def _check_scalar_loss(gm: fx.GraphModule, loss: str, returned: int) -> None:
    """Refuse a step whose loss (its first returned value, of ``returned``: a model returning
    ``(loss, logits)`` is trained on its loss) is not a scalar."""
    val = next(n for n in gm.graph.nodes if n.name == loss).meta.get("val")
    if not isinstance(val, torch.Tensor) or val.numel() != 1:
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
        first = f"the first of the {returned} values it returns, " if returned > 1 else ""
        raise UnsupportedModelError(
            f"the training step must return a scalar loss, got {first}{shape}: pass loss_fn (and targets)"
        )


def _strip_prefix(fqn: str) -> str:
    return fqn[len(_MODEL_PREFIX):] if fqn.startswith(_MODEL_PREFIX) else fqn


def module_path(node: fx.Node) -> str:
    """Model-relative path of the innermost module that produced ``node`` ('' for the loss)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = path[len("model"):].lstrip(".") if path.startswith("model") else path
    return path


def _tie_repeated_layers(graph: fx.Graph, params: dict[str, str], buffers: dict[str, str]
                         ) -> tuple[dict[str, str], tuple[str, ...]]:
    """Give every node a structural key, shared by the nodes of repeated layers (``layers.0.*``,
    ``layers.1.*``...), and name the leading layers that do not repeat (``CapturedGraph.leading_layers``).

    An op's key is its module path with layer indices replaced by ``*``, the op, and the node's ordinal
    among nodes of the same path and op; a parameter's or buffer's is its name with layer indices
    replaced. Keys do not depend on node names, so a graph traced with fewer layers names its ops as
    the whole model's graph does (``ir/bind.py``). Nodes whose groups disagree on shapes or
    arguments are keyed again with only the first index replaced (a layer's own numbered parts, such as
    the two ``Linear``s of an ``nn.Sequential`` block, ``blocks.*.1`` and ``blocks.*.3``, then tie
    layer by layer), and those that still disagree are told apart by their signature (the layers of a
    stack of two kinds, Jamba's, whose residual adds differ in shape: each kind's tie with its kind's),
    so tying never changes what a node computes, only how many decisions the solver makes. The leading
    layers are keyed apart (``_LEADING``): they tie among themselves, never with the repeating layers, whose
    share of a pipeline stage scales their price while the leading layers' is the first stage's whole.
    """
    signature_of = {n.name: _signature(n) for n in graph.nodes}
    coarse = _structural_keys(graph, params, buffers, lambda path: _LAYER_INDEX.sub(".*", path))
    finer = _structural_keys(graph, params, buffers, lambda path: _LAYER_INDEX.sub(".*", path, count=1))
    keys = _consistent(coarse, finer, signature_of)
    leading = _leading_layers(tie_keys_by_layer(graph, keys))
    if not leading:
        return keys, leading
    apart = {n.name for n in graph.nodes if _layer_of_node(n, params, buffers) in leading}
    marked = lambda table: {name: _LEADING + key if name in apart else key for name, key in table.items()}  # noqa: E731
    return _consistent(marked(coarse), marked(finer), signature_of), leading


_LEADING = "leading:"
"""What the tie keys of the leading layers' nodes begin with (``_tie_repeated_layers``)."""


def _consistent(keys: dict[str, str], finer: dict[str, str], signature_of: dict[str, tuple[Any, ...]]
                ) -> dict[str, str]:
    """``keys`` where every group's nodes agree on their signature: a disagreeing group's nodes keyed ``finer``,
    and those that still disagree told apart by their signature's digest."""
    keys = dict(keys)
    for rekeyed in _inconsistent(keys, signature_of):
        keys[rekeyed] = finer[rekeyed]
    for apart in _inconsistent(keys, signature_of):
        keys[apart] = f"{keys[apart]}|{hashlib.sha1(repr(signature_of[apart]).encode()).hexdigest()[:10]}"
    return keys


def _structural_keys(graph: fx.Graph, params: dict[str, str], buffers: dict[str, str],
                     indices: Callable[[str], str]) -> dict[str, str]:
    """Every node's key, its path's layer indices rewritten by ``indices`` (``_tie_repeated_layers``)."""
    keys: dict[str, str] = {}
    ordinal: Counter = Counter()
    for node in graph.nodes:
        if node.op == "placeholder":
            fqn = params.get(node.name) or buffers.get(node.name)
            kind = "param:" if node.name in params else "buffer:"
            keys[node.name] = kind + indices(fqn) if fqn else node.name
        elif node.op == "call_function":
            path = module_path(node)
            ordinal[(path, node.target)] += 1
            keys[node.name] = f"{indices(path)}|{node.target}|{ordinal[(path, node.target)]}"
        else:
            keys[node.name] = node.name
    return keys


def tie_keys_by_layer(graph: fx.Graph, keys: dict[str, str]) -> dict[str, Counter]:
    """Per repeated-layer instance (``layers.3``), in the order the graph runs them, its ops' tie keys."""
    by_layer: dict[str, Counter] = {}
    for node in graph.nodes:
        if node.op == "call_function" and (layer := layer_of(node)) is not None:
            by_layer.setdefault(layer, Counter())[keys[node.name]] += 1
    return by_layer


def layer_of(node: fx.Node) -> str | None:
    """The repeated-layer instance a node belongs to (``layers.3``), or None outside layers."""
    if node.op == "placeholder":
        return None
    return layer_of_path(module_path(node))


def _layer_of_node(node: fx.Node, params: dict[str, str], buffers: dict[str, str]) -> str | None:
    """``layer_of``, and for a parameter or buffer the repeated-layer instance its name is in."""
    if node.op == "placeholder":
        return layer_of_path(params.get(node.name) or buffers.get(node.name) or "")
    return layer_of(node)


def layer_of_path(path: str) -> str | None:
    """The repeated-layer instance a module or parameter path is in (``layers.3.attn.q`` -> ``layers.3``),
    or None outside layers."""
    match = _LAYER.match(path)
    return match.group(1) if match else None


def repetition_period(keys: Sequence[Counter]) -> int:
    """The fewest consecutive layers that repeat alike through layers whose ops' tie keys are ``keys``: 1
    where every layer is alike the next, their number where none repeats (1 for no layers)."""
    return next(p for p in range(1, len(keys) + 1)
                if len(keys) % p == 0 and all(keys[i] == keys[i + p] for i in range(len(keys) - p))) if keys else 1


def _leading_layers(by_layer: dict[str, Counter]) -> tuple[str, ...]:
    """The fewest first layers after which the rest repeat at least twice (``repetition_period``): DeepSeek-V3's
    dense first layers before its mixture-of-experts ones; none where the layers repeat from the first, or
    where no tail of them does."""
    names, keys = list(by_layer), list(by_layer.values())
    for first in range(len(names) - 1):
        if (len(names) - first) // repetition_period(keys[first:]) >= 2:
            return tuple(names[:first])
    return ()


def _inconsistent(keys: dict[str, str], signature_of: dict[str, tuple[Any, ...]]) -> list[str]:
    """The nodes whose key groups them with nodes of other shapes or arguments (``signature_of``: each node's
    ``_signature``)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in signature_of:
        groups[keys[name]].append(name)
    return [name for members in groups.values()
            if len(members) > 1 and len({signature_of[m] for m in members}) > 1 for name in members]


def _signature(node: fx.Node) -> tuple[Any, ...]:
    """What tied nodes must share: op, the shapes of its inputs and outputs, and constant arguments other
    than floats. A float is a factor (DiffLlama's per-layer ``lambda_init``, a dropout probability), never
    a dim or a size, so it changes no strategy and no price; each node still computes with its own."""
    shapes = (_shapes(node.meta.get("val")), tuple(_shapes(a.meta.get("val")) for a in node.all_input_nodes))
    consts = tuple(a for a in node.args if not isinstance(a, (fx.Node, list, tuple, float)))
    if node.target is WRITE_BUFFER:  # the buffer it writes: each layer writes its own, as each reads its own
        consts = tuple(_LAYER_INDEX.sub(".*", name) for name in consts)
    op = str(node.target) if node.op == "call_function" else node.op  # placeholders' targets are their names
    return (op, shapes, repr(consts))


def _shapes(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), str(val.dtype))
    if isinstance(val, (list, tuple)):
        return tuple(_shapes(v) for v in val)
    return None
