"""DTensor sharding rules for the derivatives of activations capture keeps, which torch does not register.

DTensor registers a rule for every aten op tagged ``pointwise``; the backward kernels of some activations it
has rules for (``hardtanh``, which ``nn.ReLU6`` and ``nn.Hardtanh`` capture as, ``leaky_relu``, ``elu``, which
``nn.ELU`` and ``nn.SELU`` capture as, ``rrelu_with_noise``) are elementwise too but carry no tag. So a plan that
splits one of those activations ran its forward and then failed in backward, on every runtime ("Operator
aten.hardtanh_backward.default does not have a sharding strategy registered": MobileNetV2's ReLU6 under dp).
``register_derivative_rules`` registers DTensor's own elementwise rule for them (a private helper of
``torch.distributed.tensor._ops._pointwise_ops``; where it is missing, nothing is registered and such plans
fail in backward as before). Capture calls it when it is imported, so planning and every runtime see them.
"""

from __future__ import annotations

import torch

ELEMENTWISE_DERIVATIVES = (
    torch.ops.aten.hardtanh_backward.default,
    torch.ops.aten.leaky_relu_backward.default,
    torch.ops.aten.elu_backward.default,
    torch.ops.aten.rrelu_with_noise_backward.default,
)
"""Elementwise in every tensor argument (the gradient, the input or result, a noise tensor), untagged."""


def register_derivative_rules() -> None:
    """Register DTensor's elementwise rule for each of ``ELEMENTWISE_DERIVATIVES`` that has none (again: nothing)."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._ops._pointwise_ops import _register_single_dim_pointwise
    except ImportError:
        return
    known = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs
    for op in ELEMENTWISE_DERIVATIVES:
        if op not in known:
            _register_single_dim_pointwise(op)
