"""Which values of a captured training step autograd keeps for backward: the activation memory.

Between forward and backward a training step holds the tensors autograd saved, not every value the
forward computed: ``add`` saves nothing, ``mm`` saves its inputs (each one only if the other's
gradient is needed), ``relu`` and ``softmax`` their output, fused attention its inputs, its output
and the log-sum-exp of each row. Rather than tabulate such rules per op, we ask autograd itself: the
captured forward+loss graph runs once on meta tensors (nothing is allocated, so a 405B model takes
seconds), parameters requiring grad, under ``torch.autograd.graph.saved_tensors_hooks``, and every
tensor autograd packs is traced to the node that produced its storage. A saved view keeps its whole
base alive, so it is charged to the base's producer; a storage saved twice (one layer-norm output
read by three projections) is counted once.

What is not a node output is reported apart: saved placeholders (user inputs, buffers, constants,
parameters: memory the step holds anyway) in ``inputs``, and storages an op creates and saves
without returning them (fused attention's log-sum-exp) as extra bytes of that op's first output.

Attention: the captured ``scaled_dot_product_attention`` is the composite op, which on the meta
device falls back to the math path and would save the ``s x s`` scores. Training runs the fused
kernel (flash attention), so the recorder runs it as ``_scaled_dot_product_flash_attention_for_cpu``,
whose backward keeps what flash attention keeps on any device: q, k, v, the output and the
log-sum-exp. This is the ``5as/h`` term of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", §4.1: ``sbh(34 + 5as/h)`` bytes per layer) disappearing,
as that paper notes it does with fused attention.

Float8 linears (``float8``, under a float8 plan; ``ir/float8.py``) keep their weight as they read it and
their input as a one-byte float8 copy they make (``passes/float8.Float8Matmul``): the recorder runs them as a
matmul that saves its weight alone (``_KeepsWeightOnly``) and counts the copy against the node whose output
the input is (``float8_copies``, in copies of that output: one for all the readers of one tensor, q, k and v
of one normed input, ``ir/float8.activation_key``), which the pricer
charges at one byte a value in that output's placement, as the saved outputs above are charged in theirs.

What the runtime makes again in backward instead of keeping (cheap pointwise values: SwiGLU's, a norm's;
``ir/rematerialize.py``) is recorded as it runs: such a value, where an op saves it, counts as the tensors
it is made of (its recipe's, which their own ops keep anyway), and ``recomputed`` says how often backward
makes each again (once: its readers share what is made, ``passes/rematerialize.py``). The rule reads the
savers autograd reports without recomputation; no second run is needed.

An op that cannot run on the meta device (no meta kernel, data-dependent output) is assumed to save
its outputs and its inputs that need a gradient, and the walk goes on with outputs of its recorded
shapes, so one opaque op costs a conservative guess at its own memory, not the whole analysis.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

if TYPE_CHECKING:
    from autopar.ir.capture import CapturedGraph

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


@dataclass(frozen=True)
class SavedTensors:
    """What autograd keeps for backward, per node of a captured graph."""

    fractions: Mapping[str, tuple[float, ...]]  # op node -> per output: saved bytes / the output's bytes
    inputs: frozenset[str] = frozenset()  # placeholders autograd saves (not activations)
    opaque: frozenset[str] = frozenset()  # ops that could not run on meta (their memory is a guess)
    parameters_kept: frozenset[tuple[str, str]] = frozenset()  # (op, parameter placeholder): the op saves
    # (a view of) the parameter for its backward, so a gathered copy of it would be held until then
    savers: Mapping[str, frozenset[str]] = field(default_factory=dict)  # op node -> the ops whose backward
    # saves (a view of) one of its outputs: a recomputed op's output stays held while a saver is not recomputed
    float8_copies: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # op node -> per output, the
    # one-byte float8 copies of it float8 linears keep (in the output's numel: q, k and v reading one, 3)
    recomputed: frozenset[str] = frozenset()  # op nodes whose output backward makes again rather than keep it
    # (``ir/rematerialize.py``; views included), once for all its readers
    read_savers: Mapping[str, frozenset[str]] = field(default_factory=dict)  # ``savers`` as the ops read the
    # values, before a recomputed one is replaced by what it is made of: the ops that keep what they read

    def of(self, node: fx.Node) -> tuple[float, ...]:
        """Per output of ``node``, the share of its bytes saved for backward (0 when none is)."""
        return self.fractions.get(node.name, (0.0,) * len(_outputs(node.meta.get("val"))))

    def copies_of(self, node: fx.Node) -> tuple[float, ...]:
        """Per output of ``node``, how many one-byte float8 copies of it float8 linears keep (``float8_copies``)."""
        return self.float8_copies.get(node.name, (0.0,) * len(_outputs(node.meta.get("val"))))

    def saved_nodes(self) -> frozenset[str]:
        """Op nodes some of whose output bytes are saved."""
        return frozenset(name for name, fs in self.fractions.items() if any(f > 0 for f in fs))


def find_saved_tensors(captured: "CapturedGraph", float8: frozenset[str] = frozenset()) -> SavedTensors:
    """Run ``captured``'s forward+loss once on meta tensors and record what autograd saves; the ``float8``
    linears (node names) keep their weights alone (the module doc)."""
    recorder = _SavedTensorRecorder(captured.graph_module, float8, captured.gradient_kinds())
    args = [_placeholder_value(node, captured) for node in captured.graph.nodes if node.op == "placeholder"]
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpack):
        recorder.run(*args)
    return recorder.result(captured)


def _placeholder_value(node: fx.Node, captured: "CapturedGraph") -> torch.Tensor | Any:
    val = captured.constants.get(node.name, node.meta.get("val"))
    trainable = node.name in captured.params and node.name not in captured.frozen_parameters()
    return _meta_like(val, trainable) if isinstance(val, torch.Tensor) else val


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _SavedTensorRecorder(fx.Interpreter):
    """Runs a graph and remembers, per storage, the node that produced it, and what autograd packs."""

    def __init__(self, gm: fx.GraphModule, float8: frozenset[str] = frozenset(),
                 kinds: Mapping[str, str] | None = None):
        super().__init__(gm)
        self.float8, self.kinds = float8, kinds or {}
        self.producer: dict[StorageWeakRef, tuple[str, int]] = {}
        self.alive: list[torch.Tensor] = []  # every value stays referenced: no storage address is reused
        self.packed: list[tuple[torch.Tensor, str]] = []  # (saved tensor, node running when it was saved)
        self.opaque: list[str] = []
        self.running = ""
        self.current: fx.Node | None = None
        self.copied: list[torch.Tensor] = []  # the inputs float8 linears keep a float8 copy of
        self.cast: set[tuple[object, ...]] = set()  # their ``ir/float8.activation_key``s
        self.made: dict[int, str] = {}  # id of a node's one tensor output -> the node (``alive`` keeps ids unique)
        self.inputs_of: dict[str, list[torch.Tensor]] = {}  # such a node -> its tensor inputs' values

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.packed.append((tensor, self.running))
        return tensor

    def run_node(self, n: fx.Node) -> Any:
        self.running, self.current = n.name, n
        try:
            out = super().run_node(n)
        except (NotImplementedError, RuntimeError):
            if n.op != "call_function":
                raise
            out = self._opaque(n)
        for index, value in enumerate(_outputs(out)):
            if isinstance(value, torch.Tensor):
                self.producer.setdefault(_storage(value), (n.name, index))
                self.alive.append(value)
        if isinstance(out, torch.Tensor):
            self.made[id(out)] = n.name
            self.inputs_of[n.name] = [v for v in self.map_nodes_to_values(n.all_input_nodes, n)
                                      if isinstance(v, torch.Tensor)]
        return out

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if self.running in self.float8:
            return self._float8_linear(target, args)
        if target is _SDPA:
            return self._flash_attention(*args, **kwargs)
        if "device" in kwargs:  # a factory op (an attention mask's ``full``, ``arange``): made on meta like the rest
            kwargs = {**kwargs, "device": torch.device("meta")}
        return super().call_function(target, args, kwargs)

    def _flash_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                         *, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """The fused kernel's forward; with grouped-query attention, k and v are repeated to the query
        heads and the copies charged to the unrepeated k and v (what a native GQA kernel saves)."""
        if enable_gqa:
            key, value = (self._repeat_heads(t, query.shape[-3]) for t in (key, value))
        out, _logsumexp = _FLASH(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return out

    def _float8_linear(self, target: Any, args: tuple) -> torch.Tensor:
        """A float8 linear's product, autograd keeping its weight alone (its input's copy is the pricer's)."""
        from autopar.ir.float8 import LINEAR_OPS, activation_key, weight_first  # they read CapturedGraph, whose
        # module imports this

        slots, first = LINEAR_OPS[target], weight_first(self.current, self.kinds)
        weight, activation = (args[slots[0]], args[slots[1]]) if first else (args[slots[1]], args[slots[0]])
        key = activation_key(self.current, first)
        if weight.requires_grad and key not in self.cast:  # the weight's gradient reads the input's copy, one for
            self.cast.add(key)  # every linear reading the same tensor (``passes/float8.cast_once``)
            self.copied.append(activation)
        product = _KeepsWeightOnly.apply(args[slots[0]], args[slots[1]], first)
        return product + args[0] if target is torch.ops.aten.addmm.default else product

    def _repeat_heads(self, tensor: torch.Tensor, heads: int) -> torch.Tensor:
        repeated = tensor.repeat_interleave(heads // tensor.shape[-3], dim=-3)
        self.producer[_storage(repeated)] = self.producer[_storage(tensor)]
        return repeated

    def _opaque(self, n: fx.Node) -> Any:
        """Outputs of the recorded shapes for an op meta cannot run; its graded inputs count as saved."""
        self.opaque.append(n.name)
        inputs = [a for a in self.map_nodes_to_values(n.all_input_nodes, n) if isinstance(a, torch.Tensor)]
        graded = any(a.requires_grad for a in inputs)
        for tensor in inputs:
            if tensor.requires_grad:
                self.pack(tensor)
        out = _meta_like(n.meta.get("val"), graded)
        for value in _outputs(out):
            if isinstance(value, torch.Tensor) and graded:
                self.pack(value)
        return out

    def result(self, captured: "CapturedGraph") -> SavedTensors:
        from autopar.ir.rematerialize import recomputable_values  # it reads capture, whose module imports this

        saved: dict[str, set[int]] = defaultdict(set)
        extra: dict[str, float] = defaultdict(float)
        inputs: set[str] = set()
        parameters_kept: set[tuple[str, str]] = set()
        placeholders = {n.name for n in captured.graph.nodes if n.op == "placeholder"}
        read_savers = self._savers(self.packed, placeholders)
        recomputable = recomputable_values(captured.graph, read_savers)
        packed, recomputed = self._rematerialized(recomputable)
        savers = self._savers(packed, placeholders)
        seen: set[StorageWeakRef] = set()
        for tensor, running in packed:
            ref = _storage(tensor)
            owner = self.producer.get(ref)
            if owner is not None and owner[0] in captured.params:  # every op that keeps it, not only the first
                parameters_kept.add((running, owner[0]))
            if ref in seen:
                continue
            seen.add(ref)
            if owner is None:
                extra[running] += tensor.untyped_storage().nbytes()
            elif owner[0] in placeholders:
                inputs.add(owner[0])
            else:
                saved[owner[0]].add(owner[1])
        fractions = {}
        for node in captured.graph.nodes:
            if node.name in saved or node.name in extra:
                fractions[node.name] = _fractions(node, saved[node.name], extra[node.name])
        return SavedTensors(fractions, frozenset(inputs), frozenset(self.opaque), frozenset(parameters_kept),
                            savers, self._float8_copies(captured, placeholders), recomputed, read_savers)

    def _savers(self, packed: list[tuple[torch.Tensor, str]], placeholders: set[str]) -> dict[str, frozenset[str]]:
        """``SavedTensors.savers`` of the tensors ``packed`` (saved tensor, node that saved it)."""
        savers: dict[str, set[str]] = defaultdict(set)
        for tensor, running in packed:
            owner = self.producer.get(_storage(tensor))
            if owner is not None and owner[0] not in placeholders:
                savers[owner[0]].add(running)
        return {name: frozenset(nodes) for name, nodes in savers.items()}

    def _rematerialized(self, recomputable: frozenset[str]) -> tuple[list[tuple[torch.Tensor, str]], frozenset[str]]:
        """What autograd keeps with the ``recomputable`` values (``ir/rematerialize.py``) made again in
        backward: each saved one replaced by the values it is made of, and the ops that run again."""
        recomputed: set[str] = set()
        packed = [(leaf, running) for tensor, running in self.packed
                  for leaf in self._made_of(tensor, recomputable, recomputed)]
        return packed, frozenset(recomputed)

    def _made_of(self, tensor: torch.Tensor, recomputable: frozenset[str], recomputed: set[str]
                 ) -> list[torch.Tensor]:
        name = self.made.get(id(tensor))
        if name not in recomputable:
            return [tensor]
        recomputed.add(name)
        return [leaf for value in self.inputs_of[name] for leaf in self._made_of(value, recomputable, recomputed)]

    def _float8_copies(self, captured: "CapturedGraph", placeholders: set[str]) -> dict[str, tuple[float, ...]]:
        """``SavedTensors.float8_copies``: each copied input counted against its storage's producer, as the share
        of that output it spans (a view of part of it, less than one copy); none for placeholders (inputs)."""
        counts: dict[tuple[str, int], float] = defaultdict(float)
        for tensor in self.copied:
            owner = self.producer.get(_storage(tensor))
            if owner is not None and owner[0] not in placeholders:
                whole = _outputs(captured.node(owner[0]).meta.get("val"))[owner[1]]
                counts[owner] += tensor.numel() / max(whole.numel(), 1)
        copies: dict[str, list[float]] = {}
        for (name, index), count in counts.items():
            shares = copies.setdefault(name, [0.0] * len(_outputs(captured.node(name).meta.get("val"))))
            shares[index] += count
        return {name: tuple(shares) for name, shares in copies.items()}


class _KeepsWeightOnly(torch.autograd.Function):
    """``a @ b`` keeping only its weight operand for backward (``b``, or ``a`` with ``weight_first``): what a
    float8 linear keeps of its operands as they were read (its input's float8 copy is no node's output)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, weight_first: bool) -> torch.Tensor:
        ctx.save_for_backward(a if weight_first else b)
        return a @ b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        raise NotImplementedError("the saved-tensor recorder runs forward only")


def _fractions(node: fx.Node, saved: set[int], extra_bytes: float) -> tuple[float, ...]:
    outputs = _outputs(node.meta.get("val"))
    shares = [1.0 if i in saved else 0.0 for i in range(len(outputs))]
    first = outputs[0] if outputs else None
    if extra_bytes and isinstance(first, torch.Tensor) and first.numel():
        shares[0] += extra_bytes / (first.numel() * first.element_size())
    return tuple(shares)


def _outputs(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _storage(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


def _meta_like(val: Any, requires_grad: bool) -> Any:
    if isinstance(val, torch.Tensor):
        meta = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        return meta.requires_grad_(requires_grad and val.dtype.is_floating_point)
    if isinstance(val, (list, tuple)):
        return type(val)(_meta_like(v, requires_grad) for v in val)
    return val

