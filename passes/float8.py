"""Float8 linears: the matmuls ``autopar/ir/float8.py`` names run as float8 matmuls (``precision.fp8``).

``run_in_float8`` rewrites each such ``mm``/``addmm`` of the program into ``float8_mm``/``float8_addmm``,
whose ``Float8Matmul`` does, with tensorwise scaling (``core.plan.FP8_RECIPES``; Micikevicius et al., "FP8
Formats for Deep Learning", 2022):

* **forward**: each operand scaled by ``max(e4m3) / amax`` (its absolute maximum), cast to e4m3, and
  multiplied by ``torch._scaled_mm`` with the inverse scales, into the compute dtype;
* **backward**: the output's gradient scaled likewise into e5m2 (five exponent bits: gradients span more
  range than they need precision); the input's gradient ``g @ w^T`` and the weight's ``x^T @ g`` as two more
  float8 matmuls.

What a linear keeps for backward is what Transformer Engine and torchao keep: its input as the e4m3 copy the
forward multiplied (one byte a value, where a plain matmul keeps two in bf16) and its weight's e4m3 copy.

**A weight is cast once a step** where the program reads it as it is stored (through views and mixed
precision's ``to_compute_dtype`` only: data, tensor, pipeline parallelism and ZeRO-1/2, whose weights the
program reads whole): ``cast_weights_once_a_step`` takes that cast out of the program, which reads it as two
more placeholders, and ``StepCasts`` makes it before the step's first microbatch, from the values the step
reads, as Transformer Engine does with ``is_first_microbatch`` (the weight does not change between
microbatches, so neither do its amax and its e4m3 copy). Every microbatch's forward and backward then read
that one copy: one byte a weight element held through the step, where casting per microbatch would redo the
amax, the cast and its all_reduce ``m`` times and the cast again in each backward. A weight gathered on its
way to the linear (FSDP) is cast per microbatch as it arrives, kept as it is read (under FSDP it is gathered
again for backward, so a kept float8 copy would hold the whole weight from forward to backward) and cast
again in backward with its forward scale. Linears reading one tensor (q, k and v
of one normed input) read it through one view and share its cast (``cast_once``): one amax, one e4m3 copy,
as Transformer Engine's fused QKV projection makes. The pricer charges the same
(``planning/pricing.py``, ``ir/saved_tensors.py``). Where we diverge from torchao's ``Float8Linear``: its amax
is each rank's own, so under data parallelism its numerics depend on the batch split; here ``amax`` runs on
the program's DTensors, whose maximum over a split tensor is a ``Partial("max")`` reduced to every rank (an
all_reduce of one number per mesh dim the operand is split on, priced), so a plan computes what one process
does, which the parity tests check (Megatron-Core also reduces its amaxes across ranks, over its amax group).
``scaled_mm`` wants its second operand column-major on CUDA: ``_column_major``.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor, Replicate

from autopar.ir.capture import is_view
from autopar.ir.float8 import LINEAR_OPS, activation_key, activation_slot, weight_first

from .mixed_precision import to_compute_dtype

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
AMAX_FLOOR = 1e-12
"""The least absolute maximum a scale is taken from: an all-zero tensor scales by a finite number."""
_CASTS: dict[int, tuple[weakref.ref, tuple[torch.Tensor, torch.Tensor]]] = {}
"""id of an activation -> (a weak reference to it, its ``cast_e4m3``), while it lives (``cast_once``)."""


def run_in_float8(program: fx.GraphModule, linears: Collection[str], kinds: Mapping[str, str]) -> int:
    """Rewrite the program's ``linears`` (node names, ``ir/float8.float8_linears``) into float8 matmuls, each
    told which operand is its weight (``ir/float8.weight_first`` by ``kinds``, ``CapturedGraph.gradient_kinds``);
    returns how many."""
    rewritten = 0
    readers: dict[tuple[object, ...], fx.Node] = {}  # activation_key -> the node the first such linear reads
    for node in program.graph.nodes:
        if node.name in linears and node.target in LINEAR_OPS:
            first = weight_first(node, kinds)
            earlier = readers.setdefault(activation_key(node, first), node.args[activation_slot(node, first)])
            _read_as_before(node, earlier, first)
            node.kwargs = {"weight_first": first}
            node.target = float8_addmm if node.target is torch.ops.aten.addmm.default else float8_mm
            rewritten += 1
    if rewritten:
        program.recompile()
    return rewritten


def _read_as_before(node: fx.Node, earlier: fx.Node, first: bool) -> None:
    """Make ``node`` read its activation as ``earlier`` (the same view of the same value an earlier float8
    linear reads), so one tensor reaches both and ``cast_once`` casts it once."""
    mine = node.args[activation_slot(node, first)]
    if mine is not earlier:
        node.replace_input_with(mine, earlier)
        if not mine.users:
            node.graph.erase_node(mine)


def cast_weights_once_a_step(program: fx.GraphModule, params: Collection[str]) -> "StepCasts":
    """Take the cast of every float8 linear's weight that ``program`` reads as it is stored (``params``: the
    parameters' placeholder names; the module doc) out of the program: the weight's (scale, e4m3 copy) become
    two placeholders after the others, which its linears read (``weight_cast``) and the returned ``StepCasts``
    makes each step. A weight that reaches its linear otherwise (gathered, sliced) is left to it."""
    graph = program.graph
    last = [node for node in graph.nodes if node.op == "placeholder"][-1]
    made: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}
    casts: dict[tuple[str, str], tuple[str, fx.GraphModule]] = {}
    for node in list(graph.nodes):
        first = _FLOAT8_LINEARS.get(node.target) if node.op == "call_function" else None
        if first is None:
            continue
        weight = node.args[first if node.kwargs.get("weight_first") else first + 1]
        chain = _read_as_stored(weight, params)
        if chain is None:
            continue
        if weight not in made:
            with graph.inserting_after(last):
                scale = graph.placeholder(f"{weight.name}_float8_scale")
            with graph.inserting_after(scale):
                last = graph.placeholder(f"{weight.name}_float8")
            made[weight] = (scale, last)
            casts[scale.name, last.name] = (chain[0].name, _cast_program(chain))
        node.kwargs = {**node.kwargs, "weight_cast": made[weight]}
    if made:
        graph.lint()
        program.recompile()
    return StepCasts(casts)


def _read_as_stored(weight: fx.Node, params: Collection[str]) -> list[fx.Node] | None:
    """The nodes from a parameter's placeholder to ``weight``, in order, where each is a view or mixed precision's
    cast to the compute dtype; None where another op (a redistribute) is on the way, or no parameter."""
    chain = [weight]
    while chain[-1].op == "call_function" and (is_view(chain[-1]) or chain[-1].target is to_compute_dtype) \
            and len(chain[-1].all_input_nodes) == 1:
        chain.append(chain[-1].all_input_nodes[0])
    if chain[-1].op != "placeholder" or chain[-1].name not in params:
        return None
    return chain[::-1]


def _cast_program(chain: Sequence[fx.Node]) -> fx.GraphModule:
    """A program from the parameter (``chain[0]``) to the (scale, e4m3 copy) of the weight ``chain[-1]`` is."""
    graph = fx.Graph()
    env = {chain[0]: graph.placeholder(chain[0].name)}
    for node in chain[1:]:
        env[node] = graph.node_copy(node, env.__getitem__)
    made = graph.call_function(cast_e4m3, (env[chain[-1]],))
    graph.output((graph.call_function(operator.getitem, (made, 0)), graph.call_function(operator.getitem, (made, 1))))
    return fx.GraphModule(nn.Module(), graph)


@dataclass(frozen=True)
class StepCasts:
    """The float8 weights a program reads cast once a step (``cast_weights_once_a_step``): per pair of its
    placeholders (scale, e4m3 copy), the parameter's placeholder it is made from and the program that makes it."""

    casts: Mapping[tuple[str, str], tuple[str, fx.GraphModule]] = field(default_factory=dict)

    def made_from(self, value_of: Callable[[str], torch.Tensor], wanted: Collection[str]) -> dict[str, torch.Tensor]:
        """This step's casts that a program reading placeholders ``wanted`` reads, by placeholder name, each
        made from ``value_of(parameter placeholder)``, the value the step's program reads for it (call it once
        a step, before the first microbatch, after the parameters are ready: ``ProgramParameters.begin_step``)."""
        made: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for (scale, copy), (param, cast) in self.casts.items():
                if scale in wanted:
                    made[scale], made[copy] = cast(value_of(param))
        return made


def float8_mm(a: torch.Tensor, b: torch.Tensor, weight_first: bool = False,
              weight_cast: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``a @ b`` as a float8 matmul (the module doc), in ``a``'s dtype; the weight is ``b`` (``a`` with
    ``weight_first``); ``weight_cast``: its (scale, e4m3 copy), made once a step (``StepCasts``)."""
    return Float8Matmul.apply(a, b, weight_first, weight_cast)


def float8_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight_first: bool = False,
                 weight_cast: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``bias + a @ b``, the product a float8 matmul: a linear layer with its bias."""
    return Float8Matmul.apply(a, b, weight_first, weight_cast) + bias


_FLOAT8_LINEARS = {float8_mm: 0, float8_addmm: 1}
"""The float8 matmuls ``run_in_float8`` writes, and the ``args`` slot of their first matrix operand."""


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` as a float8 matmul: rows ``x.reshape(-1, in)`` times ``weight^T``,
    what the captured step of an ``nn.Linear`` multiplies (``float8_eager`` runs a model so)."""
    rows = x.reshape(-1, x.shape[-1])
    out = float8_mm(rows, weight.t()) if bias is None else float8_addmm(bias, rows, weight.t())
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Float8Matmul(torch.autograd.Function):
    """``a @ b`` with both operands in e4m3, the output's gradient in e5m2, each scaled tensorwise; one
    operand is a weight (``b``, or ``a`` with ``weight_first``), the other kept in e4m3. The weight is kept as
    its e4m3 copy where the step made it (``weight_cast``: (scale, copy), ``StepCasts``), else as it is read,
    cast here each forward and again in backward."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, weight_first: bool,
                weight_cast: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        cast_weight = (lambda w: weight_cast) if weight_cast is not None else cast_e4m3
        (scale_a, a8), (scale_b, b8) = ((cast_weight(a), cast_once(b)) if weight_first
                                        else (cast_once(a), cast_weight(b)))
        weight, weight8, activation8 = (a, a8, b8) if weight_first else (b, b8, a8)
        weight_needs_grad = ctx.needs_input_grad[0 if weight_first else 1]
        ctx.weight_first, ctx.out_dtypes, ctx.weight_cast = weight_first, (a.dtype, b.dtype), weight_cast is not None
        ctx.save_for_backward(weight8 if weight_cast is not None else weight,
                              activation8 if weight_needs_grad else None, scale_a, scale_b)
        return scaled_matmul(a8, scale_a, b8, scale_b, a.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        weight, activation8, scale_a, scale_b = ctx.saved_tensors
        weight8 = weight if ctx.weight_cast else as_float8(weight, scale_a if ctx.weight_first else scale_b, E4M3)
        a8, b8 = (weight8, activation8) if ctx.weight_first else (activation8, weight8)
        scale_g = tensorwise_scale(grad, E5M2)
        grad8 = as_float8(grad, scale_g, E5M2)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = scaled_matmul(grad8, scale_g, b8.t(), scale_b, ctx.out_dtypes[0])
        if ctx.needs_input_grad[1]:
            grad_b = scaled_matmul(a8.t(), scale_a, grad8, scale_g, ctx.out_dtypes[1])
        return grad_a, grad_b, None, None


def cast_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, e4m3 copy) of ``x``, scaled tensorwise."""
    scale = tensorwise_scale(x, E4M3)
    return scale, as_float8(x, scale, E4M3)


def cast_once(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cast_e4m3`` of a float8 linear's activation, made once for every float8 linear reading the same
    tensor while it lives (q, k and v, which ``run_in_float8`` makes read one view): one amax, one cast, one
    e4m3 copy kept for their backward (the same one, so no more memory than one linear's)."""
    key = id(x)
    entry = _CASTS.get(key)
    if entry is not None and entry[0]() is x:
        return entry[1]
    made = cast_e4m3(x)
    _CASTS[key] = (weakref.ref(x, lambda _: _CASTS.pop(key, None)), made)
    return made


def tensorwise_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``max(dtype) / amax(|x|)`` in fp32, over the whole tensor: a DTensor's maximum is reduced over every
    mesh dim it is split on (``Partial("max")`` to ``Replicate``), so each rank scales by the same number."""
    amax = x.detach().abs().amax().to(torch.float32)
    if isinstance(amax, DTensor):
        amax = amax.redistribute(amax.device_mesh, [Replicate()] * amax.device_mesh.ndim)
    return torch.finfo(dtype).max / amax.clamp(min=AMAX_FLOOR)


def as_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` saturated to ``dtype``'s range and cast to it."""
    top = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(-top, top).to(dtype)


def scaled_matmul(a8: torch.Tensor, scale_a: torch.Tensor, b8: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """``(a8 / scale_a) @ (b8 / scale_b)`` by ``torch._scaled_mm``, in ``out_dtype``."""
    return torch._scaled_mm(a8.contiguous(), _column_major(b8), scale_a=scale_a.reciprocal(),
                            scale_b=scale_b.reciprocal(), out_dtype=out_dtype)


def _column_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def float8_eager(model: nn.Module, weights: Collection[str]) -> list[str]:
    """Make ``model``'s ``nn.Linear`` layers whose weight is named in ``weights`` run as float8 matmuls
    (``float8_linear``), in place, for eager PyTorch: the single-process reference the parity tests hold a
    float8 plan to. Returns the modules' names."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and f"{name}.weight" in weights:
            module.forward = _float8_forward(module)
            changed.append(name)
    return changed


def _float8_forward(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: float8_linear(x, module.weight, module.bias)
