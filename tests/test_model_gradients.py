"""The gradients a model defines itself survive capture: its own ``torch.autograd.Function``s train with their own
backward (``ir/autograd_functions.py``), and what it cuts from the gradient (``detach``, ``torch.no_grad()``)
stays cut (``ir/capture.py``'s ``KEPT_GRADIENT_CUTS`` and ``_cut_gradients_out_of_no_grad_regions``).

torch.export traces through a Function's forward and keeps none of its backward: a straight-through estimator
captured so would get the derivative of ``round`` (zero) instead of its gradient passed through. Its core aten
decomposition makes ``detach`` a plain alias and inlines a ``no_grad`` region, so gradients would flow where the
model cut them. Parity on 2 gloo ranks against one process (where autograd reads all three as the model meant);
and the captured step holds a Function's call as one op.
"""

from __future__ import annotations

import pytest
import torch

from autopar.core.errors import UnsupportedModelError
from autopar.ir.capture import capture
from autopar.models import build_model
from autopar.testing.parity import train_parallel_many, train_single

pytestmark = [pytest.mark.slow, pytest.mark.dist]

RUNS = [("edge_models:straight_through", {"dp": 2}, None), ("edge_models:straight_through", {"tp": 2}, False),
        ("edge_models:straight_through", {"pp": 2}, None), ("edge_models:reversed_gradient", {"tp": 2}, None),
        ("edge_models:stop_gradient", {"dp": 2}, None), ("edge_models:stop_gradient", {"tp": 2}, False),
        ("edge_models:no_grad_teacher", {"tp": 2}, None), ("edge_models:no_grad_teacher", {"pp": 2}, None)]


def test_functions_own_backward_and_cut_gradients_train_as_one_process() -> None:
    runs = [dict(name=name, overrides=None, global_batch=8, seq=8, steps=3, plan=None, constraints=constraints,
                 lowered=lowered) for name, constraints, lowered in RUNS]
    for (name, constraints, _), result in zip(RUNS, train_parallel_many(2, runs)):
        result.assert_matches(train_single(name, None, 8, 8, 3))


@pytest.mark.extended
def test_a_weight_reading_a_value_and_its_detached_copy_runs_lowered_on_local_shards() -> None:
    """dp2 x tp2 with microbatches: the head's weight gets one gradient through ``h`` and one through
    ``h.detach()``, arriving replicated for the tp-sharded weight; the lowered program cuts it to the shard
    (``lower._HookedParameter``) instead of falling back to DTensor parameters, and trains as one process."""
    name, constraints = "edge_models:stop_gradient", {"dp": 2, "tp": 2, "microbatches": 2}
    (result,) = train_parallel_many(4, [dict(name=name, overrides=None, global_batch=8, seq=8, steps=3, plan=None,
                                             constraints=constraints, lowered=None)])
    result.assert_matches(train_single(name, None, 8, 8, 3))
    assert result.lowered["dtensor_parameters"] == [] and result.lowered["local_parameters"] > 0, result.lowered


def test_the_captured_step_calls_the_function_as_one_op() -> None:
    bundle = build_model("edge_models:straight_through", global_batch=8, seq=8, device="meta")
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    calls = [n for n in captured.graph.nodes if "function_forward" in str(n.target)]
    assert len(calls) == len(bundle.model.blocks)
    assert not any("round" in str(n.target) for n in captured.graph.nodes)  # its forward is not traced into


class _KeywordCall(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from edge_models import ReverseGradient

        return ReverseGradient.apply(x, scale=0.5).sum()


def test_a_function_called_with_keyword_arguments_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModelError, match=r"ReverseGradient.apply is called with keyword arguments"):
        capture(_KeywordCall(), (torch.randn(4, 3),))


class _HookedForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.register_hook(lambda grad: grad * 3)
        return h.sum()


def test_a_gradient_hook_registered_in_forward_is_refused_naming_where() -> None:
    with pytest.raises(UnsupportedModelError, match=r"registers a gradient hook on a tensor at .*test_model_gradients"
                                                    r"\.py:\d+ in forward"):
        capture(_HookedForward(), (torch.randn(4, 3),))
