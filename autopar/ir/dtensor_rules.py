"""DTensor sharding rules for the derivatives of ops capture keeps, which torch does not register.

DTensor registers a rule for every aten op tagged ``pointwise``; the backward kernels of some activations it
has rules for (``hardtanh``, which ``nn.ReLU6`` and ``nn.Hardtanh`` capture as, ``leaky_relu``, ``elu``, which
``nn.ELU`` and ``nn.SELU`` capture as, ``rrelu_with_noise``) are elementwise too but carry no tag. So a plan that
splits one of those activations ran its forward and then failed in backward, on every runtime ("Operator
aten.hardtanh_backward.default does not have a sharding strategy registered": MobileNetV2's ReLU6 under dp).
``register_derivative_rules`` registers DTensor's own elementwise rule for them (a private helper of
``torch.distributed.tensor._ops._pointwise_ops``; where it is missing, nothing is registered and such plans
fail in backward as before).

So too for pooling: DTensor splits every pooling op's forward on its batch and channel dims (``pooling_strategy``)
but has rules for only two of their backward kernels (torch 2.13: adaptive average and max pooling in 2-D), so
PoolFormer's ``nn.AvgPool2d`` under dp failed in backward ("aten.avg_pool2d_backward.default does not have a
sharding strategy registered"). ``POOLING_DERIVATIVES`` get the rule torch gives the two it has: split as the
forward on the batch dim, and on the channel dim where there is one; the gradient partial as it arrives (each
is linear in it), the forward's input and indices whole.

Capture calls ``register_derivative_rules`` when it is imported, so planning and every runtime see them.
"""

from __future__ import annotations

from typing import Any

import torch

_aten = torch.ops.aten

ELEMENTWISE_DERIVATIVES = (
    _aten.hardtanh_backward.default,
    _aten.leaky_relu_backward.default,
    _aten.elu_backward.default,
    _aten.rrelu_with_noise_backward.default,
)
"""Elementwise in every tensor argument (the gradient, the input or result, a noise tensor), untagged."""

POOLING_DERIVATIVES: dict[Any, tuple[int, int]] = {
    _aten.avg_pool2d_backward.default: (2, 2),
    _aten.avg_pool3d_backward.default: (3, 2),
    _aten._adaptive_avg_pool2d_backward.default: (2, 2),
    _aten._adaptive_avg_pool3d_backward.default: (3, 2),
    _aten.max_pool2d_with_indices_backward.default: (2, 3),
    _aten.max_pool3d_with_indices_backward.default: (3, 3),
    _aten.adaptive_max_pool2d_backward.default: (2, 3),
    _aten.adaptive_max_pool3d_backward.default: (3, 3),
    _aten.fractional_max_pool2d_backward.default: (2, 3),
    _aten.fractional_max_pool3d_backward.default: (3, 3),
}
"""Pooling derivatives -> (spatial dims, tensor inputs: the gradient, the forward's input and, for max pooling, its
indices); each returns the gradient of the forward's input."""


def register_derivative_rules() -> None:
    """Register a rule for each of ``ELEMENTWISE_DERIVATIVES`` and ``POOLING_DERIVATIVES`` that has none (again:
    nothing)."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._ops._pointwise_ops import _register_single_dim_pointwise
        from torch.distributed.tensor._ops.single_dim_strategy import register_single_dim_strategy
    except ImportError:
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    known = {*propagator.op_single_dim_strategy_funcs, *propagator.op_strategy_funcs}
    for op in ELEMENTWISE_DERIVATIVES:
        if op not in known:
            _register_single_dim_pointwise(op)
    for op, (spatial, inputs) in POOLING_DERIVATIVES.items():
        if op not in known:
            register_single_dim_strategy(op)(_pooling_derivative_rule(spatial, inputs))


def _pooling_derivative_rule(spatial: int, inputs: int) -> Any:
    """The single-dim rule of a pooling derivative (placements: the result, then its ``inputs`` tensor inputs)."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

    def rule(op: Any, args_schema: tuple[Any, ...], kwargs_schema: dict[str, Any]) -> list[list[Any]]:
        batched = len(args_schema[0].shape) >= spatial + 2  # (N, C, *spatial), else (C, *spatial)
        split_dims = (0, 1) if batched else (0,)
        whole = [Replicate()] * (inputs - 1)
        return ([[_ShardingPlaceholder(d)] * (inputs + 1) for d in split_dims]
                + [[Partial(reduce), Partial(reduce), *whole] for reduce in ("sum", "avg")])

    return rule
