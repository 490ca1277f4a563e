"""Activation memory from what autograd saves for backward (``autopar.ir.saved_tensors``).

* hand-checkable graphs: a Linear+ReLU MLP saves exactly ReLU's output (and its input ``x`` and the
  second weight, which are not activations); an add-only chain saves nothing; fused attention saves
  its output plus the log-sum-exp, an extra output the graph does not show;
* against autograd on a real eager run of the same model (real tensors, the same hooks): tiny-gpt's
  and tiny-llama's saved bytes match, the latter in fp32 and bf16 (SiLU captured whole, as eager runs it);
* against the closed form of Korthikanti et al. 2022 for a GPT layer: ``34 sbh`` bytes in 16-bit
  with fused attention, ``32 sbh + 2 as^2 b`` without (no dropout, so their masks and dropout
  outputs are absent), plus the small layer-norm statistics and log-sum-exp, counted by hand here;
* an unfused attention's causal mask, made by factory ops on CPU, runs on meta with the rest;
* an op that cannot run on meta is charged its outputs and graded inputs, and the walk goes on;
* the planner charges saved bytes, not every output: predicted activations drop, plans still fit,
  and on one device they are the saved bytes, the inputs and one working set, to the byte.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

import autopar
from autopar.ir.capture import CapturedGraph, capture
from autopar.models import build_model
from autopar.ir.saved_tensors import SavedTensors
from autopar.ir.layers import layer_of
from autopar.ir.layers import output_vals, tensor_inputs
from autopar.passes.program import copy_graph
from autopar.passes.rematerialize import Rematerialized, recompute_in_backward


def _capture(model: nn.Module, inputs, targets=None, loss_fn=None) -> CapturedGraph:
    return capture(model, inputs, targets, loss_fn)


def _capture_bundle(bundle) -> CapturedGraph:
    return capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)


def _saved_bytes(captured: CapturedGraph, nodes=None, float_bytes: int | None = None) -> float:
    """Saved bytes of ``nodes`` (default: all), floats at ``float_bytes`` each (default: their own size)."""
    saved = captured.saved_for_backward()
    total = 0.0
    for node in captured.graph.nodes:
        if node.op != "call_function" or (nodes is not None and node not in nodes):
            continue
        for val, share in zip(output_vals(node), saved.of(node)):
            if isinstance(val, torch.Tensor):
                size = float_bytes if float_bytes and val.dtype.is_floating_point else val.element_size()
                total += share * val.numel() * size
    return total


def _eager_saved_bytes(bundle, captured: CapturedGraph) -> int:
    """Bytes of the storages autograd saves in a real eager forward+loss of ``captured``'s step as the runtime
    runs it (its recomputed values made again in backward: ``passes/rematerialize.py``), less parameters,
    buffers and inputs (the same hooks ``saved_tensors.py`` uses, on real tensors, around the runtime's)."""
    model = bundle.model
    held = {name: model.get_parameter(fqn) for name, fqn in captured.params.items()}
    held |= {name: model.get_buffer(fqn) for name, fqn in captured.buffers.items()} | dict(captured.constants)
    held |= dict(zip(captured.user_inputs, [*bundle.example_inputs, bundle.example_targets]))
    excluded = {StorageWeakRef(t.untyped_storage()) for t in held.values()}
    saved: dict[StorageWeakRef, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in excluded:
            saved[ref] = t.untyped_storage().nbytes()
        return t

    program = fx.GraphModule(captured.graph_module, copy_graph(captured.graph))
    recompute_in_backward(program, captured.saved_for_backward().recomputed)
    args = [held[n.name] for n in program.graph.nodes if n.op == "placeholder"]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        (loss,) = Rematerialized(program)(*args)
    assert loss.requires_grad
    return sum(saved.values())


def _base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` views (itself if it is no view)."""
    while getattr(node.target, "is_view", False):
        node = node.args[0]
    return node


def _ops(captured: CapturedGraph, target) -> list[fx.Node]:
    return [n for n in captured.graph.nodes if n.op == "call_function" and n.target == target]


# ---- hand-checkable graphs ----------------------------------------------------------------------------
class ReluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).sum()


class AddChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4, 8))
        self.b = nn.Parameter(torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.a + self.b).sum()


def test_linear_relu_saves_relu_output_only():
    """fc1 saves its input x (for fc1's weight gradient; x itself needs none, so fc1's weight is
    not saved); ReLU saves its output; fc2 saves that same output and its weight (for the gradient
    of its input); sum saves nothing. The only activation is ReLU's output."""
    captured = _capture(ReluMLP(), (torch.randn(4, 16),))
    saved = captured.saved_for_backward()
    (relu,) = _ops(captured, torch.ops.aten.relu.default)
    assert saved.saved_nodes() == {relu.name}
    assert saved.of(relu) == (1.0,)
    assert {captured.params.get(n, n) for n in saved.inputs} == {captured.user_inputs[0], "fc2.weight"}
    assert _saved_bytes(captured) == 4 * 32 * 4


def test_add_chain_saves_nothing():
    captured = _capture(AddChain(), (torch.randn(4, 8),))
    saved = captured.saved_for_backward()
    assert saved.fractions == {} and saved.inputs == frozenset()
    assert all(share == 0.0 for n in captured.graph.nodes if n.op == "call_function" for share in saved.of(n))


def test_fused_attention_saves_output_and_logsumexp():
    """The flash kernel keeps its output and one float per query row and head (the log-sum-exp): the
    output's bytes times ``1 + 1/head_dim``; q, k and v are charged to the projections they view."""
    captured = _capture_bundle(build_model("tiny-gpt"))
    saved = captured.saved_for_backward()
    sdpa = _ops(captured, torch.ops.aten.scaled_dot_product_attention.default)
    head_dim = sdpa[0].meta["val"].shape[-1]
    assert len(sdpa) == 2 and all(saved.of(n) == (1.0 + 1.0 / head_dim,) for n in sdpa)
    for node in sdpa:
        for base in map(_base, tensor_inputs(node)):
            assert base.target == torch.ops.aten.addmm.default and saved.of(base) == (1.0,)


# ---- against autograd on real tensors -------------------------------------------------------------------
def test_tiny_gpt_matches_an_eager_run():
    """Same totals as autograd's own saved tensors on a real CPU run (whose SDPA is the CPU flash
    kernel); the captured cross-entropy also keeps two target-sized index tensors (a few KB)."""
    bundle = build_model("tiny-gpt", device="cpu")
    captured = _capture_bundle(bundle)
    assert _saved_bytes(captured) == pytest.approx(_eager_saved_bytes(bundle, captured), rel=2e-3)


def test_unfused_attention_of_a_cpu_model_matches_an_eager_run():
    """A model built on CPU makes its causal mask with factory ops on CPU (``full``, ``arange``): they run
    on meta like the rest, so the masked ``where`` is no opaque op charged the whole scores twice."""
    bundle = build_model("tiny-gpt", device="cpu", overrides={"attention": "eager"})
    captured = _capture_bundle(bundle)
    assert not captured.saved_for_backward().opaque
    assert _saved_bytes(captured) == pytest.approx(_eager_saved_bytes(bundle, captured), rel=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_llama_matches_an_eager_run(dtype):
    """SiLU is captured whole (``capture.KEPT_POINTWISE``), keeping only its input as eager SiLU does: no
    ``sigmoid`` is left to keep ``sigmoid(x)`` (nor, in bf16, fp32 copies of ``x`` and ``sigmoid(x)``), so
    ours are autograd's own saved bytes, in fp32 and as a bf16 plan's program runs (``capture(dtype=)``)."""
    bundle = build_model("tiny-llama", device="cpu")
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn, dtype=dtype)
    bundle.model.to(dtype)
    (silu, *_) = _ops(captured, torch.ops.aten.silu.default)
    assert not _ops(captured, torch.ops.aten.sigmoid.default)
    assert silu.name in captured.saved_for_backward().savers[_base(silu.args[0]).name]
    assert _saved_bytes(captured) == pytest.approx(_eager_saved_bytes(bundle, captured), rel=2e-3)


def test_values_made_again_in_backward_give_the_same_gradients_each_made_once() -> None:
    """tiny-llama's step as the runtime runs it: RMSNorm's normalized input and its product with the weight,
    SwiGLU's SiLU and product are made again in backward (``ir/rematerialize.py``), each once however many
    ops read it (q, k and v one normed input), and the gradients are those of the step keeping them, to the
    bit (the same kernels on the same inputs)."""
    bundle = build_model("tiny-llama", device="cpu")
    captured = _capture_bundle(bundle)
    recomputed = captured.saved_for_backward().recomputed
    ops = {captured.node(n).target for n in recomputed}
    assert {torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor} <= ops
    model = bundle.model
    values = {**{name: model.get_parameter(fqn) for name, fqn in captured.params.items()},
              **{name: model.get_buffer(fqn) for name, fqn in captured.buffers.items()}, **captured.constants,
              **dict(zip(captured.user_inputs, [*bundle.example_inputs, bundle.example_targets]))}
    grads = []
    for remade in (False, True):
        program = fx.GraphModule(captured.graph_module, copy_graph(captured.graph))
        if remade:
            recompute_in_backward(program, recomputed)
            program = Rematerialized(program)
        model.zero_grad(set_to_none=True)
        (loss,) = program(*[values[n.name] for n in captured.graph.nodes if n.op == "placeholder"])
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
    assert program.last.recomputed == len(recomputed)  # views included: each made once


# ---- against Korthikanti et al. 2022 ----------------------------------------------------------------------
S, B, H, A = 128, 2, 256, 4


@pytest.mark.parametrize("attention", ["fused", "eager"])
def test_gpt_layer_matches_korthikanti_closed_form(attention):
    """Per layer, 16-bit floats: ``34 sbh`` with fused attention (q, k, v, the output and its merged copy
    replace the scores), ``32 sbh + 2 as^2 b`` without (the softmax output); both plus the two layer
    norms' mean and rstd (``4 sb`` floats), fused attention's log-sum-exp (``asb`` floats) and, unfused,
    the causal mask (``s^2`` bools); less the GELU output the second MLP matmul keeps (``8 sbh``), which
    the runtime makes again in backward from the GELU input GELU keeps (``ir/rematerialize.py``)."""
    bundle = build_model("gpt-megatron", overrides=dict(layers=2, hidden=H, heads=A, seq=S, attention=attention),
                         global_batch=B, seq=S)
    captured = _capture_bundle(bundle)
    layer = [n for n in captured.graph.nodes if layer_of(n) == "blocks.0"]
    sbh, stats = S * B * H, 2 * 4 * S * B  # the paper's terms are bytes; layer-norm statistics in 16-bit
    if attention == "fused":
        expected = 34 * sbh + stats + 2 * A * S * B
    else:
        expected = 32 * sbh + 2 * A * S * S * B + stats + S * S
    (gelu,) = [n for n in layer if n.target is torch.ops.aten.gelu.default]
    assert gelu.name in captured.saved_for_backward().recomputed
    assert _saved_bytes(captured, layer, float_bytes=2) == pytest.approx(expected - 8 * sbh, rel=1e-9)


# ---- ops meta cannot run ----------------------------------------------------------------------------------
@torch.library.custom_op("autopar_saved_test::no_meta", mutates_args=())
def _no_meta(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def test_op_without_meta_kernel_is_charged_its_graded_inputs_and_outputs():
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x.meta["val"], w.meta["val"] = torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta")
    mul = graph.call_function(torch.ops.aten.mul.Tensor, (x, w))
    opaque = graph.call_function(torch.ops.autopar_saved_test.no_meta.default, (mul,))
    relu = graph.call_function(torch.ops.aten.relu.default, (opaque,))
    loss = graph.call_function(torch.ops.aten.sum.default, (relu,))
    for node in (mul, opaque, relu):
        node.meta["val"] = torch.empty(4, 8, device="meta")
    loss.meta["val"] = torch.empty((), device="meta")
    graph.output((loss,))
    captured = CapturedGraph(fx.GraphModule(nn.Module(), graph), {"w": "w"}, {}, {}, ["x"], loss.name)
    saved = captured.saved_for_backward()
    assert saved.opaque == {opaque.name}
    assert saved.saved_nodes() == {opaque.name, relu.name}  # the walk went on past the opaque op
    # the opaque op's graded input, a product of placeholders (mul saves x for w's gradient), is made again
    # in backward from them (ir/rematerialize.py)
    assert saved.recomputed == {mul.name} and saved.inputs == {"x", "w"}


# ---- the planner ------------------------------------------------------------------------------------------
def _everything_saved(captured: CapturedGraph, float8: frozenset[str] = frozenset()) -> SavedTensors:
    """The rule before saved tensors: every op output counts as activation memory."""
    ops = [n for n in captured.graph.nodes if n.op == "call_function"]
    return SavedTensors({n.name: tuple(1.0 for _ in output_vals(n)) for n in ops})


def _plan(bundle, cluster: str, constraints=None):
    return autopar.plan(bundle.model, bundle.example_inputs, cluster=cluster, loss_fn=bundle.loss_fn,
                        example_targets=bundle.example_targets, constraints=constraints)


def test_planner_charges_saved_bytes_not_every_output(monkeypatch):
    bundle = build_model("tiny-gpt")
    saved = _plan(bundle, "1x4xcpu").predicted
    monkeypatch.setattr(CapturedGraph, "saved_for_backward", _everything_saved)
    everything = _plan(bundle, "1x4xcpu").predicted
    assert saved["memory_bytes"]["activations"] < 0.9 * everything["memory_bytes"]["activations"]
    for p in (saved, everything):
        assert 0 < p["peak_memory_bytes"] <= p["memory_capacity_bytes"]


def test_one_device_activations_are_saved_bytes_inputs_and_one_working_set():
    """On one CPU device (fp32, nothing sharded, one microbatch): the saved bytes of every op, the
    user inputs and buffers (the position ids), and the largest working set of one op (outputs and non-parameter
    inputs, those backward makes again twice: here the MLP's output projection) counted once."""
    bundle = build_model("tiny-gpt")
    plan = _plan(bundle, "1x1xcpu", {"microbatches": 1})
    captured = _capture_bundle(bundle)
    kinds = captured.gradient_kinds()

    def nbytes(val):
        return val.numel() * val.element_size()

    remade = captured.saved_for_backward().recomputed

    def working_set(node):
        outs = sum(nbytes(v) for v in output_vals(node) if isinstance(v, torch.Tensor))
        return outs + sum(nbytes(a.meta["val"]) * (2 if a.name in remade else 1) for a in tensor_inputs(node)
                          if kinds[a.name] != "param")

    ops = [n for n in captured.graph.nodes if n.op == "call_function"
           and not getattr(n.target, "is_view", False) and n.target.__name__ != "getitem"]
    widest = max(ops, key=working_set)
    assert widest.target is torch.ops.aten.addmm.default  # the MLP's output projection
    inputs = sum(nbytes(captured.node(n).meta["val"]) for n in [*captured.user_inputs, *captured.buffers])
    expected = _saved_bytes(captured) + inputs + working_set(widest)
    assert plan.predicted["memory_bytes"]["activations"] == pytest.approx(expected, abs=8)
