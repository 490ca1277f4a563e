"""Unit tests of ``passes/lower_eager.py``: the rewrites of a forward graph run under eager autograd, and
when a lowered program may run so. (Its runs, on gloo pipelines against single-process training:
``tests/test_pipeline_runtime.py``'s lowered chunks.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.passes.checkpoint import CheckpointedLayer
from autopar.passes.lower_buckets import launch_from_inputs_first
from autopar.passes.lower_eager import (EagerRefused, defer_reduced_output, eager_refusal, fuse_linear_layers,
                                       fuse_token_losses, with_local_gradients)
from autopar.testing.launch import run_on_ranks
from autopar.passes.lower_simplify import simplify_local_ops

aten = torch.ops.aten


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _grads(fn, *tensors: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves)
    out.sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def _two_layers(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """A linear layer with bias on a 3-d input, then one without bias on its output flattened to a matrix."""
    hidden = torch.relu(F.linear(x, w1, b1))
    return F.linear(hidden.reshape(-1, hidden.shape[-1]), w2)


def test_decomposed_linear_layers_fuse_to_one_op_with_the_same_values_and_gradients() -> None:
    torch.manual_seed(0)
    x, w1, b1, w2 = torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(6), torch.randn(3, 6)
    with torch.no_grad():
        traced = make_fx(_two_layers)(x, w1, b1, w2)
    assert aten.addmm.default in _targets(traced) and aten.mm.default in _targets(traced)
    reference = _grads(traced, x, w1, b1, w2)

    assert fuse_linear_layers(traced) == 2
    simplify_local_ops(traced, under_autograd=True)

    targets = _targets(traced)
    assert targets.count(aten.linear.default) == 2, traced.code
    assert not {aten.addmm.default, aten.mm.default, aten.t.default, aten.permute.default} & set(targets), traced.code
    out, grads = _grads(traced, x, w1, b1, w2)
    torch.testing.assert_close(out, reference[0], rtol=0, atol=0)
    for got, want in zip(grads, reference[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_decomposed_cross_entropy_fuses_its_token_losses_with_the_same_values_and_gradients() -> None:
    """The capture's decomposition of ``cross_entropy`` (log-softmax, targets gathered, ignored ones zeroed,
    mean over the counted ones): its per-token losses become one ``nll_loss_forward``; the mean stays."""
    from torch._decomp import core_aten_decompositions

    torch.manual_seed(0)
    logits, targets = torch.randn(12, 7), torch.randint(0, 7, (12,))
    targets[[2, 5]] = -100  # ignored

    def loss(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.view(-1, 7), t.view(-1))

    with torch.no_grad():
        traced = make_fx(loss, decomposition_table=core_aten_decompositions())(logits, targets)
    assert aten.gather.default in _targets(traced)
    reference = _grads(traced, logits, targets)
    assert fuse_token_losses(traced) == 1
    simplify_local_ops(traced, under_autograd=True)
    targets_of = _targets(traced)
    assert aten.nll_loss_forward.default in targets_of and aten.gather.default not in targets_of, traced.code
    out, grads = _grads(traced, logits, targets)
    torch.testing.assert_close(out, reference[0], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], reference[1][0], rtol=0, atol=0)
    torch.testing.assert_close(out, F.cross_entropy(logits, targets))


def test_a_matmul_that_is_not_a_linear_layer_is_left_alone() -> None:
    """A weight that is not transposed (``x @ w``), or a product not viewed back to the input's leading dims,
    stays as traced."""
    def not_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.reshape(-1, 4) @ w).reshape(5, 2, 3)  # rows regrouped: not x's leading dims

    with torch.no_grad():
        traced = make_fx(not_linear)(torch.randn(2, 5, 4), torch.randn(4, 3))
    assert fuse_linear_layers(traced) == 0
    assert aten.linear.default not in _targets(traced)


def test_simplifying_under_autograd_keeps_detaches() -> None:
    """A graph run under autograd keeps its ``detach``: it cuts the gradient (AOT's graphs, which run without
    autograd, drop theirs)."""
    def cut(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.detach() * y

    with torch.no_grad():
        under, without = make_fx(cut)(torch.randn(3), torch.randn(3)), make_fx(cut)(torch.randn(3), torch.randn(3))
    simplify_local_ops(under, under_autograd=True)
    simplify_local_ops(without)
    assert aten.detach.default in _targets(under) and aten.detach.default not in _targets(without)
    _, (x_grad, y_grad) = _grads(under, torch.randn(3), torch.randn(3))
    assert x_grad is None and y_grad is not None


def _graphs(forward: dict | None = None, backward: dict | None = None) -> tuple[dict, dict]:
    gm = fx.GraphModule(nn.Module(), fx.Graph())
    return {"forward": gm, "backward": gm}, {"forward": forward or {}, "backward": backward or {}}


def test_a_program_runs_eagerly_only_without_backward_collectives_recomputation_or_dtensor_parameters() -> None:
    """Forward gathers and sums (a loss over data parallelism) have local gradients where the backward graph
    runs no collective; a backward collective, another forward collective, recomputation, inductor or a
    parameter read as a DTensor keep the AOT graphs."""
    graphs, none = _graphs()
    program = nn.Sequential(nn.Linear(2, 2))
    local = {0: object(), 1: object()}
    assert eager_refusal(program, graphs, none, [0, 1], local, compiled=False) is None
    loss_over_dp = _graphs(forward={"all_reduce": 2, "all_gather": 1})
    assert eager_refusal(program, *loss_over_dp, [0, 1], local, compiled=False) is None
    assert "inductor" in eager_refusal(program, graphs, none, [0, 1], local, compiled=True)
    assert "backward graph runs" in eager_refusal(program, *_graphs(backward={"all_reduce": 1}), [0, 1], local,
                                                  compiled=False)
    assert "reduce_scatter" in eager_refusal(program, *_graphs(forward={"reduce_scatter": 1}), [0, 1], local,
                                             compiled=False)
    assert "backward" in eager_refusal(program, {"forward": graphs["forward"]}, none, [0, 1], local, compiled=False)
    assert "DTensors" in eager_refusal(program, graphs, none, [0, 1, 2], local, compiled=False)
    layer = fx.symbolic_trace(nn.Linear(2, 2))
    checkpointed = nn.Sequential(CheckpointedLayer(layer, "layers.0", "full"))
    assert "recomputes" in eager_refusal(checkpointed, graphs, none, [0, 1], local, compiled=False)


def _waited(target, *args) -> fx.GraphModule:
    """A graph running the functional collective ``target`` on its input and waiting on it."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    started = graph.call_function(target, (x, *args))
    graph.output(graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (started,)))
    return fx.GraphModule(nn.Module(), graph)


def test_forward_gathers_and_sums_are_given_local_gradients_and_other_collectives_refused() -> None:
    """Collectives of values with gradients get the local gradient DTensor would give them; one of a value
    without a gradient (the loss's count of targets) stays a functional collective and its wait."""
    c10d = torch.ops._c10d_functional
    gathered, summed = _waited(c10d.all_gather_into_tensor.default, 2, "0"), _waited(c10d.all_reduce.default, "sum", "0")
    assert with_local_gradients(gathered, {"x"}) == 1 and with_local_gradients(summed, {"x"}) == 1
    for gm in (gathered, summed):
        assert not [n for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "_c10d_functional"]
    counted = _waited(c10d.all_reduce.default, "sum", "0")
    assert with_local_gradients(counted, set()) == 0
    assert {c10d.all_reduce.default, c10d.wait_tensor.default} <= set(_targets(counted))
    for refused in (_waited(c10d.all_reduce.default, "max", "0"), _waited(c10d.reduce_scatter_tensor.default, "sum", 2, "0")):
        with pytest.raises(EagerRefused):
            with_local_gradients(refused, {"x"})


def _global_mean(losses: torch.Tensor, counted: torch.Tensor, group: str, tail) -> torch.Tensor:
    """A data-parallel loss as DTensor's trace leaves it: the all_reduced sum of the per-token losses, over
    the all_reduced count of counted targets, then ``tail``."""
    c10d = torch.ops._c10d_functional
    count = c10d.wait_tensor(c10d.all_reduce(counted.sum(), "sum", group)).float()
    total = c10d.wait_tensor(c10d.all_reduce(losses.sum(), "sum", group))
    return tail(total / count)


def _deferred_loss_rank(rank: int, world: int) -> dict:
    """On each rank: the global mean of its losses traced, deferred, run under autograd for two microbatches
    (the second's losses doubled) and finished together; the collectives the graph and the finishing run."""
    import torch.distributed as dist

    from autopar.passes.lower import graph_collectives
    from autopar.testing.counters import CollectiveCounter

    group = dist.group.WORLD.group_name
    losses = torch.arange(1.0, 5.0) * (rank + 1)  # rank 0: 1..4, rank 1: 2..8
    counted = torch.tensor([True, True, rank == 0, False])  # 3 and 2 counted: 5 in all
    outcome = {}
    for name, tail in (("linear", lambda x: x * 2.0), ("log", torch.log)):
        with torch.no_grad():
            gm = make_fx(lambda l, c: [_global_mean(l, c, group, tail)], tracing_mode="fake")(losses, counted)
        deferred = defer_reduced_output(gm, {"l_1"})
        if deferred is not None:
            launch_from_inputs_first(gm, {"l_1"})
        with_local_gradients(gm, {"l_1"})
        leaves = [(losses * scale).requires_grad_() for scale in (1.0, 2.0)]
        runs = [gm(leaf, counted) for leaf in leaves]
        for loss, *_ in runs:
            loss.backward()
        with CollectiveCounter() as finishing, torch.no_grad():
            if deferred is not None:
                for (loss, *_), value in zip(runs, deferred.values([ending for _, *ending in runs])):
                    loss.copy_(value)
        outcome[name] = (deferred is not None, [float(loss) for loss, *_ in runs],
                         [leaf.grad.tolist() for leaf in leaves], graph_collectives(gm), finishing.counts)
    return outcome


@pytest.mark.dist
def test_the_loss_reduction_is_left_unwaited_in_forward_with_the_same_loss_and_gradients() -> None:
    """``defer_reduced_output`` on 2 gloo ranks: a global mean (linear in the summed losses) is computed for
    backward from the local sum, which the graph leaves unreduced (its one collective the count of
    targets); two microbatches' sums are reduced by one all_reduce after backward, with each one's global
    loss and each rank's gradient 2 / (5 counted targets); a loss not linear in the sum (its log) keeps
    its reduction and wait in the graph (nothing left to finish)."""
    total = (1 + 2 + 3 + 4) * 3  # both ranks' losses
    for rank, outcome in enumerate(run_on_ranks(_deferred_loss_rank, 2)):
        deferred, losses, grads, in_graph, finishing = outcome["linear"]
        assert deferred and losses == pytest.approx([2 * total / 5, 4 * total / 5])
        assert grads[0] == pytest.approx([2 / 5] * 4) and grads[1] == pytest.approx([2 / 5] * 4)
        assert in_graph == {"all_reduce": 1} and finishing == {"all_reduce": 1}
        deferred, losses, grads, in_graph, finishing = outcome["log"]
        assert not deferred and losses == pytest.approx([torch.log(torch.tensor(s * total / 5)).item() for s in (1, 2)])
        assert grads[0] == pytest.approx([1 / total] * 4) and grads[1] == pytest.approx([1 / (2 * total)] * 4)
        assert finishing == {}
