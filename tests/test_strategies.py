"""Strategy enumeration: on a mesh of several dims, an op with a single-mesh-dim rule gets exactly the
strategies DTensor's own expansion gives, in DTensor's order (``strategies._expanded``), for every such op
of the built-in models, a Hugging Face-style pointwise min/max, and meshes of two and three dims."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.ir.capture import capture
from autopar.ir.layers import tensor_inputs
from autopar.models import build_model
from autopar.planning import strategies
from autopar.planning.strategies import StrategyFinder

PROP = DTensor._op_dispatcher.sharding_propagator


class _Clamped(nn.Module):
    """Pointwise ops with partials of several reduce ops (``minimum``: ``P(min)`` and ``P(max)``
    strategies on one dim, which a combination may not mix)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return torch.maximum(torch.minimum(h, h.flip(-1)), -h).sum(-1)


def _clamped_graph():
    return capture(_Clamped(), (torch.randn(4, 8, 16),), torch.randn(4, 8), nn.functional.mse_loss)


def _built_in(name: str):
    bundle = build_model(name, global_batch=4, device="meta")
    return capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)


def _expandable_nodes(captured) -> list[torch.fx.Node]:
    found, seen = [], set()
    for node in captured.graph.nodes:
        if node.op != "call_function" or not tensor_inputs(node) or not strategies._expandable(node, PROP):
            continue
        key = (node.target, strategies._arg_signature(node))
        if key not in seen:
            seen.add(key)
            found.append(node)
    return found


@pytest.mark.parametrize("graph, ndim", [("tiny-moe", 2), ("tiny-moe", 3), ("tiny-llama", 3), ("tiny-gpt", 2),
                                         ("clamped", 2), ("clamped", 3)])
def test_single_dim_rules_combined_per_mesh_dim_give_dtensors_strategies_in_its_order(graph: str, ndim: int) -> None:
    captured = _clamped_graph() if graph == "clamped" else _built_in(graph)
    nodes = _expandable_nodes(captured)
    assert len(nodes) >= (4 if graph == "clamped" else 15)
    finder = StrategyFinder((2,) * ndim)
    for node in nodes:
        ours, fallback = finder._enumerate(node, tensor_inputs(node))
        assert not fallback, node.target
        assert ours == strategies._first_of_each_family(finder._from_dtensor(node, PROP)), node.target


def test_a_combination_mixing_reduce_ops_is_refused_and_its_sibling_kept() -> None:
    captured = _clamped_graph()
    node = next(n for n in captured.graph.nodes if n.target is torch.ops.aten.minimum.default)
    ours, _ = StrategyFinder((2, 2))._enumerate(node, tensor_inputs(node))
    kinds = [{p.reduce_op for ps in (*s.inputs, *s.outputs) for p in ps if p.is_partial()} for s in ours]
    assert {"min"} in kinds and {"max"} in kinds and not any(len(k) > 1 for k in kinds)


def test_ops_that_differ_only_in_their_sizes_share_one_expansion() -> None:
    """``strategies._expanded_families`` remembers an expansion by the sizes capped at the most shards a dim
    can get: tiny Llama's expandable ops on a three-dim mesh share fewer lists than they have signatures,
    each still DTensor's own."""
    nodes = _expandable_nodes(_built_in("tiny-llama"))
    strategies._EXPANDED.clear()
    finder = StrategyFinder((2, 2, 2))
    for node in nodes:
        ours, _ = finder._enumerate(node, tensor_inputs(node))
        assert ours == strategies._first_of_each_family(finder._from_dtensor(node, PROP)), node.target
    assert 0 < len(strategies._EXPANDED) < len(nodes)


def _index_node(fn, *args: torch.Tensor):
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(fn)(*args).graph
    return next(n for n in graph.nodes if n.target is torch.ops.aten.index.Tensor)


def _described(node, ndim: int = 1) -> list[str]:
    return [s.describe() for s in strategies.index_strategies(node, ndim)]


def test_advanced_indexing_splits_a_dim_no_index_reads_or_the_indices_broadcast_dims() -> None:
    """``aten.index.Tensor``, which DTensor only propagates: the indexed tensor split on a dim no index reads
    (where the output has it: in place when the indexed dims are together, after the broadcast dims when not),
    or the indices split on a dim of their broadcast shape (those that have all of it), the output then split
    there; a boolean mask is read whole. Each is run on local shards (``runs_locally``)."""
    long = dict(dtype=torch.long)
    mask = _index_node(lambda x, b, q: x[b, q], torch.zeros(4, 16), torch.zeros(4, 1, 1, 1, **long),
                       torch.zeros(1, 1, 16, 1, **long))  # transformers' mask construction: [4, 1, 16, 1]
    assert _described(mask) == ["(R), (R), (R) -> (R)", "(R), (S(0)), (R) -> (S(0))", "(R), (R), (S(2)) -> (S(2))"]
    rows = _index_node(lambda t, ids: t[ids], torch.zeros(32, 64), torch.zeros(4, 16, **long))  # [4, 16, 64]
    assert _described(rows) == ["(R), (R) -> (R)", "(S(1)), (R) -> (S(2))", "(R), (S(0)) -> (S(0))",
                                "(R), (S(1)) -> (S(1))"]
    middle = _index_node(lambda t, i: t[:, i], torch.zeros(8, 32, 6), torch.zeros(5, **long))  # [8, 5, 6]
    assert _described(middle) == ["(R), (R) -> (R)", "(S(0)), (R) -> (S(0))", "(S(2)), (R) -> (S(2))",
                                  "(R), (S(0)) -> (S(1))"]
    apart = _index_node(lambda t, i, j: t[i, :, j], torch.zeros(8, 32, 6), torch.zeros(5, **long),
                        torch.zeros(5, **long))  # [5, 32]: the broadcast dim first
    assert _described(apart) == ["(R), (R), (R) -> (R)", "(S(1)), (R), (R) -> (S(1))", "(R), (S(0)), (S(0)) -> (S(0))"]
    boolean = _index_node(lambda x, m: x[m], torch.zeros(4, 3), torch.ones(4, dtype=torch.bool))
    assert _described(boolean) == ["(R), (R) -> (R)"]
    assert len(_described(rows, ndim=2)) == 16
    assert all(strategies.runs_locally(rows, s) for s in strategies.index_strategies(rows, 2))


def test_resampling_and_polar_run_on_local_shards_split_on_samples_or_channels() -> None:
    """``F.interpolate`` (``upsample_*.vec``, which DTensor has no strategy for) and ``torch.polar`` are split on
    local shards without a warning that they run replicated; a batch split carries through the upsampling."""
    import warnings

    import autopar
    from autopar.models import build_model as build

    bundle = build("edge_models:upsampled_convs", global_batch=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, {"dp": 2},
                            example_targets=bundle.example_targets)
    upsampled = [op for op in plan.ops.values() if "upsample" in op["op"]]
    assert len(upsampled) == 2 and all(op["local"] and op["outputs"] == [["S(0)"]] for op in upsampled)
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(torch.polar)(torch.ones(4, 6), torch.zeros(4, 6)).graph
    polar = next(n for n in graph.nodes if n.target is torch.ops.aten.polar.default)
    found = StrategyFinder((2,)).for_node(polar)
    assert [s.describe() for s in found] == ["(R), (R) -> (R)", "(S(0)), (S(0)) -> (S(0))", "(S(1)), (S(1)) -> (S(1))"]
    assert all(strategies.runs_locally(polar, s) for s in found)
    graph = make_fx(torch.polar)(torch.ones(4, 6), torch.zeros(6)).graph  # the angle broadcast over dim 0
    broadcast = next(n for n in graph.nodes if n.target is torch.ops.aten.polar.default)
    # not split on dim 0: the whole angle's gradient would be partial there, which nothing reduces
    assert [s.describe() for s in StrategyFinder((2,)).for_node(broadcast)] == ["(R), (R) -> (R)",
                                                                                 "(S(1)), (S(0)) -> (S(1))"]


def test_an_as_strided_of_size_one_dims_only_is_read_as_its_input() -> None:
    """Adaptive pooling's ``[b, c, 1, 1]`` mean, restrided by torch.export with an ``as_strided`` that changes
    only its size-1 dims' strides, is its input in the captured graph: nothing runs replicated, the batch stays
    split (DTensor has no strategy for ``as_strided``)."""
    import warnings

    import autopar
    from autopar.models import build_model as build

    bundle = build("edge_models:pooled_tokens", global_batch=8)
    graph = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn).graph
    assert not [n for n in graph.nodes if n.target is torch.ops.aten.as_strided.default]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn, {"dp": 2},
                            example_targets=bundle.example_targets)
    mean = [op for op in plan.ops.values() if op["op"].endswith("mean.dim")]
    assert mean and all(op["outputs"] == [["S(0)"]] for op in mean)
