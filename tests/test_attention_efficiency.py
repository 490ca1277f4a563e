"""Fused attention's own efficiency (``DeviceSpec.attention_efficiency``, the ``attention`` kernel kind of
``cost_models/compute.py``; issue 20).

Flash-attention kernels reach less of a GPU's dense peak than its large GEMMs, and less backward than
forward: on an H100 FlashAttention-3 and cuDNN run 0.61 of peak forward and 0.53 backward at 4k-16k
tokens (head dim 128; Shah et al. 2024), where cuBLAS GEMMs run 0.8. Hopper's presets state these; a
device without the figures prices fused attention as a GEMM, as before. Checked by hand on one kernel,
on the device record (validation, JSON) and through ``autopar.plan``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.cost_models import DeviceSpec, backward_kind, compute_time, get_device
from autopar.cost_models.compute import MATMUL_RAMP_S, op_efficiency
from autopar.cost_models.hardware import HOPPER_ATTENTION_EFFICIENCY

H100_BF16_PEAK = 989e12


def test_a_long_attention_kernel_runs_at_hoppers_forward_plateau() -> None:
    """One causal kernel of 16 heads x 16k tokens x head dim 128: 2 x 2 x 16 x 16384^2 x 128 x 1/2 =
    1.1e12 FLOPs; a GEMM's ramp (5 us at peak, over its 0.8) then 0.61 of 989 TFLOP/s: about 600 TFLOP/s,
    FlashAttention-3's forward rate there (621 measured non-causal), where the GEMM plateau would price 783."""
    h100 = get_device("H100")
    flops = 2 * 2 * 16 * 16384**2 * 128 / 2
    seconds = compute_time(flops, 0.0, h100, "bf16", "attention") - h100.kernel_launch_s
    assert seconds == pytest.approx(flops / (0.61 * H100_BF16_PEAK) + MATMUL_RAMP_S / 0.8)
    assert flops / seconds == pytest.approx(600e12, rel=0.01)
    as_gemm = compute_time(flops, 0.0, h100, "bf16", "matmul") - h100.kernel_launch_s
    assert flops / as_gemm == pytest.approx(783e12, rel=0.01)


def test_its_backward_kernel_runs_to_its_own_plateau_only_where_the_device_says() -> None:
    """The backward of fused attention is priced as ``attention_backward`` (a GEMM's as a GEMM): on Hopper
    at 0.53 of peak, 0.61 / 0.53 slower per FLOP than its forward past the ramp, which is a GEMM's either
    way (a tiny kernel costs what a tiny GEMM does); on a device without figures (A100) both run as GEMMs."""
    assert HOPPER_ATTENTION_EFFICIENCY == (0.61, 0.53)
    h100 = get_device("H100")
    assert h100.attention_efficiency == get_device("H200").attention_efficiency == (0.61, 0.53)
    assert backward_kind("attention") == "attention_backward" and backward_kind("matmul") == "matmul"
    flops = 1e15
    ramp = H100_BF16_PEAK * MATMUL_RAMP_S / (0.8 * H100_BF16_PEAK)
    forward, backward = (compute_time(flops, 0.0, h100, "bf16", kind) - h100.kernel_launch_s - ramp
                         for kind in ("attention", "attention_backward"))
    assert backward / forward == pytest.approx(0.61 / 0.53)
    tiny = [compute_time(1.0, 0.0, h100, "bf16", kind) for kind in ("attention", "attention_backward", "matmul")]
    assert tiny[0] == pytest.approx(tiny[2]) and tiny[1] == pytest.approx(tiny[2])
    a100 = get_device("A100-80GB")  # no measured figure in the catalog: priced as a GEMM both ways
    assert a100.attention_efficiency is None
    assert compute_time(1e12, 0.0, a100, "bf16", "attention_backward") == compute_time(1e12, 0.0, a100, "bf16", "matmul")


def test_op_efficiency_of_fused_attention_is_the_rate_the_kernel_is_priced_at() -> None:
    """``op_efficiency`` answers for fused attention what ``compute_time`` charges (it once gave a GEMM's
    curve for it, which only ``compute_time`` bypassed): with the device's plateaus, FLOPs over seconds
    at peak, rising to 0.61 forward and 0.53 backward on Hopper; without them, a GEMM's."""
    h100 = get_device("H100")
    for kind, plateau in (("attention", 0.61), ("attention_backward", 0.53)):
        for flops in (1e6, 1e10, 1e15):
            seconds = compute_time(flops, 0.0, h100, "bf16", kind) - h100.kernel_launch_s
            efficiency = op_efficiency(kind, flops, H100_BF16_PEAK, 0.8, h100.attention_efficiency)
            assert efficiency == pytest.approx(flops / (seconds * H100_BF16_PEAK), rel=1e-9)
        assert op_efficiency(kind, 1e18, H100_BF16_PEAK, 0.8, (0.61, 0.53)) == pytest.approx(plateau, rel=1e-3)
        assert op_efficiency(kind, 1e10, H100_BF16_PEAK, 0.8) == op_efficiency("matmul", 1e10, H100_BF16_PEAK, 0.8)


def test_the_figures_travel_with_the_device_and_are_checked() -> None:
    h100 = get_device("H100")
    data = h100.to_dict()
    assert data["attention_efficiency"] == (0.61, 0.53)
    assert DeviceSpec.from_dict({**data, "attention_efficiency": [0.5, 0.4]}).attention_efficiency == (0.5, 0.4)
    assert DeviceSpec.from_dict({k: v for k, v in data.items() if k != "attention_efficiency"}).attention_efficiency is None
    for bad in ([0.5], [0.5, 0.0], [0.5, 1.2], "fast", [True, 0.5]):
        with pytest.raises(ValueError, match="attention_efficiency"):
            replace(h100, attention_efficiency=bad)
