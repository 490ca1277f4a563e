"""Unit tests for autopar.cost_models: hand-computed values, no processes, no GPU."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from autopar.cost_models import (
    COLLECTIVES,
    DEVICES,
    Cluster,
    ClusterSpecError,
    DeviceSpec,
    GroupTopology,
    adamw_state_bytes,
    collective_bytes_per_rank,
    collective_time,
    compute_time,
    get_device,
    matmul_kind,
    op_efficiency,
    parse_cluster,
    reserve_fraction,
    usable_bytes,
)
from autopar.cost_models.compute import MATMUL_MAX_EFFICIENCY, MEMORY_EFFICIENCY, MISALIGNED_MATMUL_FACTOR

# A group with round numbers, so expected times can be written out by hand.
INTRA_BW, INTER_BW = 100e9, 10e9
INTRA_LAT, INTER_LAT, BASE = 1e-6, 5e-6, 10e-6


def topo(size: int, per_node: int) -> GroupTopology:
    return GroupTopology(size=size, per_node=per_node, nodes=math.ceil(size / per_node),
                         intra_bw=INTRA_BW, inter_bw=INTER_BW, intra_latency_s=INTRA_LAT,
                         inter_latency_s=INTER_LAT, base_latency_s=BASE)


# --------------------------------------------------------------------------------------------
# comm: volumes
# --------------------------------------------------------------------------------------------


def test_all_reduce_volume_is_2_p_minus_1_over_p() -> None:
    assert collective_bytes_per_rank("all_reduce", 1000.0, 4) == pytest.approx(1500.0)
    assert collective_bytes_per_rank("all_reduce", 800.0, 8) == pytest.approx(1400.0)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_gather_like_volume_is_p_minus_1_over_p(kind: str) -> None:
    assert collective_bytes_per_rank(kind, 1000.0, 4) == pytest.approx(750.0)


def test_volume_of_one_rank_is_zero() -> None:
    assert all(collective_bytes_per_rank(kind, 1e9, 1) == 0.0 for kind in COLLECTIVES)


# --------------------------------------------------------------------------------------------
# comm: times
# --------------------------------------------------------------------------------------------


def test_all_reduce_ring_inside_node_by_hand() -> None:
    # 4 ranks: 2*(4-1) = 6 steps; volume 2*3/4 * 1e9 = 1.5e9 bytes.
    expected = 6 * INTRA_LAT + 1.5e9 / INTRA_BW + BASE
    assert collective_time("all_reduce", 1e9, topo(4, 4)) == pytest.approx(expected)


def test_all_gather_ring_inside_node_by_hand() -> None:
    # 4 ranks: 3 steps; volume 3/4 * 1e9 (nbytes is the gathered output).
    expected = 3 * INTRA_LAT + 0.75e9 / INTRA_BW + BASE
    assert collective_time("all_gather", 1e9, topo(4, 4)) == pytest.approx(expected)
    assert collective_time("reduce_scatter", 1e9, topo(4, 4)) == pytest.approx(expected)


def test_hierarchical_all_reduce_by_hand() -> None:
    n = 8e9
    intra_rs = 7 * INTRA_LAT + 7 / 8 * n / INTRA_BW          # reduce_scatter of n over 8 local ranks
    inter_ar = 2 * INTER_LAT + 2 * (1 / 2) * (n / 8) / INTER_BW  # ring all_reduce of n/8 over 2 nodes
    intra_ag = 7 * INTRA_LAT + 7 / 8 * n / INTRA_BW          # all_gather of n over 8 local ranks
    expected = intra_rs + inter_ar + intra_ag + BASE
    assert collective_time("all_reduce", n, topo(16, 8)) == pytest.approx(expected)


def test_hierarchical_all_gather_by_hand() -> None:
    n = 8e9
    inter = 1 * INTER_LAT + (1 / 2) * (n / 8) / INTER_BW   # all_gather of n/8 over 2 nodes
    intra = 7 * INTRA_LAT + 7 / 8 * n / INTRA_BW           # all_gather of n over 8 local ranks
    assert collective_time("all_gather", n, topo(16, 8)) == pytest.approx(inter + intra + BASE)


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("nbytes", [1e3, 1e6, 1e9])
def test_mesh_dim_over_two_nodes_is_slower_than_one_node(kind: str, nbytes: float) -> None:
    cluster = parse_cluster("2x8xH100")
    spanning = cluster.group((16,), 0)
    assert (spanning.per_node, spanning.nodes) == (8, 2)
    inside = parse_cluster("1x8xH100").group((8,), 0)
    assert collective_time(kind, nbytes, spanning) > collective_time(kind, nbytes, inside)


def test_cross_node_all_reduce_takes_tree_when_cheaper() -> None:
    # 64 nodes, one rank each, 1 KiB: the ring pays 126 network steps, the tree 2*6.
    n, group = 1024.0, topo(64, 1)
    ring = 126 * INTER_LAT + 2 * 63 / 64 * n / INTER_BW
    tree = 12 * INTER_LAT + 2 * n / INTER_BW
    assert tree < ring
    assert collective_time("all_reduce", n, group) == pytest.approx(tree + BASE)


def test_cross_node_all_reduce_takes_ring_for_large_buffers() -> None:
    n, group = 1e9, topo(4, 1)
    ring = 6 * INTER_LAT + 1.5 * n / INTER_BW
    assert collective_time("all_reduce", n, group) == pytest.approx(ring + BASE)


def test_all_to_all_across_nodes_is_bound_by_bytes_leaving_the_node() -> None:
    # 16 ranks, 8 per node: 8/16 of each rank's buffer leaves the node through its NIC.
    n = 1e9
    latency = 7 * INTRA_LAT + 8 * INTER_LAT
    expected = latency + max(7 / 16 * n / INTRA_BW, 8 / 16 * n / INTER_BW) + BASE
    assert collective_time("all_to_all", n, topo(16, 8)) == pytest.approx(expected)


def test_broadcast_and_send_recv_by_hand() -> None:
    n = 1e9
    assert collective_time("broadcast", n, topo(4, 4)) == pytest.approx(3 * INTRA_LAT + n / INTRA_BW + BASE)
    assert collective_time("send_recv", n, topo(2, 2)) == pytest.approx(INTRA_LAT + n / INTRA_BW + BASE)
    assert collective_time("send_recv", n, topo(2, 1)) == pytest.approx(INTER_LAT + n / INTER_BW + BASE)


@pytest.mark.parametrize("kind", COLLECTIVES)
def test_group_of_one_or_zero_bytes_costs_nothing(kind: str) -> None:
    assert collective_time(kind, 1e9, topo(1, 1)) == 0.0
    assert collective_time(kind, 0, topo(8, 8)) == 0.0


def test_unknown_collective_and_bad_bytes_raise() -> None:
    with pytest.raises(ValueError, match="all_reducee"):
        collective_time("all_reducee", 1.0, topo(2, 2))
    with pytest.raises(ValueError, match="-1"):
        collective_time("all_reduce", -1, topo(2, 2))


# --------------------------------------------------------------------------------------------
# cluster: group topology
# --------------------------------------------------------------------------------------------


def test_group_topology_of_4x8_mesh_on_4x8_cluster() -> None:
    cluster = parse_cluster("4x8xH100")
    inner, outer = cluster.group((4, 8), 1), cluster.group((4, 8), 0)
    assert (inner.size, inner.per_node, inner.nodes) == (8, 8, 1)
    assert (outer.size, outer.per_node, outer.nodes) == (4, 1, 4)
    assert inner.intra_bw == cluster.intra_bw and outer.inter_bw == cluster.inter_bw


def test_group_topology_of_2x16_mesh_spans_two_nodes() -> None:
    group = parse_cluster("4x8xH100").group((2, 16), 1)
    assert (group.size, group.per_node, group.nodes) == (16, 8, 2)
    assert group.is_hierarchical


def test_group_topology_of_strided_dim_inside_node() -> None:
    # mesh (2, 4, 4) on 2x16: dim 1 has stride 4, so 4 ranks in one node of 16.
    group = parse_cluster("2x16xH100").group((2, 4, 4), 1)
    assert (group.size, group.per_node, group.nodes) == (4, 4, 1)


def test_mesh_that_does_not_cover_the_world_raises() -> None:
    with pytest.raises(ValueError, match=r"\(4, 4\).*16.*32"):
        parse_cluster("4x8xH100").group((4, 4), 0)
    with pytest.raises(ValueError, match="out of range"):
        parse_cluster("4x8xH100").group((4, 8), 2)


# --------------------------------------------------------------------------------------------
# cluster: parsing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, nodes, per_node, device", [
    ("1x8xH100", 1, 8, "H100"),
    ("128x8xA100-80GB", 128, 8, "A100-80GB"),
    ("4x8xH200", 4, 8, "H200"),
    ("1x4xcpu", 1, 4, "cpu"),
    ("2x8xh100-sxm", 2, 8, "H100"),
    ("2X8Xa100", 2, 8, "A100-80GB"),
])
def test_parse_valid_specs(spec: str, nodes: int, per_node: int, device: str) -> None:
    cluster = parse_cluster(spec)
    assert (cluster.nodes, cluster.devices_per_node, cluster.device.name) == (nodes, per_node, device)
    assert cluster.world_size == nodes * per_node
    assert cluster.intra_bw == cluster.device.nvlink_bw and cluster.inter_bw == cluster.device.net_bw


@pytest.mark.parametrize("override, attr, value", [
    ("ib=200Gbps", "inter_bw", 25e9),
    ("ib=200Gb/s", "inter_bw", 25e9),
    ("ib=25GB/s", "inter_bw", 25e9),
    ("ib=25", "inter_bw", 25e9),
    ("nvlink=450GBps", "intra_bw", 450e9),
    ("nvlink=0.9TB/s", "intra_bw", 900e9),
])
def test_bandwidth_overrides(override: str, attr: str, value: float) -> None:
    assert getattr(parse_cluster(f"16x8xH100,{override}"), attr) == pytest.approx(value)


def test_memory_override_and_several_overrides() -> None:
    cluster = parse_cluster("16x8xH100, ib=200Gbps, nvlink=450GBps, mem=64GiB")
    assert (cluster.inter_bw, cluster.intra_bw) == (pytest.approx(25e9), pytest.approx(450e9))
    assert cluster.device.hbm_bytes == 64 * 2**30
    assert parse_cluster("1x8xH100,mem=80GB").device.hbm_bytes == 80 * 10**9
    assert get_device("H100").hbm_bytes == 81559 * 2**20  # the preset is untouched: what nvidia-smi reports


@pytest.mark.parametrize("spec", [
    "4x8", "x8xH100", "0x8xH100", "4x0xH100", "-1x8xH100", "4.5x8xH100", "4x8xNOPE",
    "4x8xH100,ib", "4x8xH100,ib=fast", "4x8xH100,ib=0Gbps", "4x8xH100,color=red",
    "4x8xH100,ib=1,ib=2", "4x8xH100,mem=80 bananas", "",
])
def test_malformed_specs_raise_with_the_spec_quoted(spec: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        parse_cluster(spec)
    assert repr(spec) in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_rates_below_one_byte_per_second_are_refused(tmp_path: pathlib.Path) -> None:
    """A bandwidth of 3e-167 B/s (heavy fuzz) priced collectives at 1e160 s, which the ILP solver cannot hold."""
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"nodes": 1, "devices_per_node": 2, "device": "cpu", "nvlink": 3.3e-167}))
    with pytest.raises(ClusterSpecError, match="less than one byte"):
        parse_cluster(str(path))
    path.write_text(json.dumps({"nodes": 1, "devices_per_node": 2, "device": {"base": "cpu", "hbm_bw": 1e-9}}))
    with pytest.raises(ClusterSpecError, match="hbm_bw must be a finite number of at least 1"):
        parse_cluster(str(path))


def test_bad_head_shows_expected_form() -> None:
    with pytest.raises(ClusterSpecError, match=r"bad cluster spec '4x8': expected NxGxTYPE like 4x8xH100"):
        parse_cluster("4x8")


def test_cluster_from_json_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"nodes": 2, "devices_per_node": 4, "ib": "100Gbps",
                                "device": {"base": "H100", "name": "H100-PCIe", "nvlink_bw": 50e9}}))
    cluster = parse_cluster(str(path))
    assert (cluster.nodes, cluster.devices_per_node, cluster.device.name) == (2, 4, "H100-PCIe")
    assert (cluster.intra_bw, cluster.inter_bw) == (50e9, pytest.approx(12.5e9))
    json.dumps(cluster.to_dict())


def test_bad_json_file_raises(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"nodes": 2, "device": "H100"}))
    with pytest.raises(ClusterSpecError, match="devices_per_node"):
        parse_cluster(str(path))


def test_to_dict_is_json_and_names_the_device() -> None:
    data = parse_cluster("4x8xA100,ib=200Gbps").to_dict()
    assert json.loads(json.dumps(data))["device"] == "A100-80GB"
    assert (data["spec"], data["nodes"], data["devices_per_node"], data["inter_bw"]) == \
        ("4x8xA100,ib=200Gbps", 4, 8, pytest.approx(25e9))


def test_cluster_is_frozen_and_hashable() -> None:
    cluster = parse_cluster("4x8xH100")
    assert hash(cluster) == hash(parse_cluster("4x8xH100"))
    with pytest.raises(AttributeError):
        cluster.nodes = 2  # type: ignore[misc]
    assert isinstance(cluster, Cluster)


# --------------------------------------------------------------------------------------------
# hardware
# --------------------------------------------------------------------------------------------


def test_presets_and_aliases() -> None:
    assert {"A100-40GB", "A100-80GB", "H100", "H200", "B200", "cpu"} <= set(DEVICES)
    assert get_device("a100") is DEVICES["A100-80GB"]
    assert get_device("H100-SXM") is get_device("h100-80gb") is DEVICES["H100"]
    with pytest.raises(ValueError, match="H900.*H100"):
        get_device("H900")


def test_datasheet_peaks() -> None:
    a100, h100, h200 = get_device("A100"), get_device("H100"), get_device("H200")
    assert (a100.peak("bf16"), a100.peak("tf32"), a100.peak(torch.float32)) == (312e12, 156e12, 19.5e12)
    assert (a100.hbm_bw, get_device("A100-40GB").hbm_bw) == (2039e9, 1555e9)
    assert (h100.peak(torch.bfloat16), h100.peak("float32"), h100.hbm_bw) == (989e12, 67e12, 3350e9)
    assert (h200.hbm_bytes, h200.hbm_bw) == (143771 * 2**20, 4800e9)
    assert (get_device("B200").hbm_bytes, a100.hbm_bytes) == (183359 * 2**20, 80 * 2**30)


def test_peak_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="int64"):
        get_device("H100").peak(torch.int64)
    with pytest.raises(ValueError, match="fp8"):
        get_device("A100-80GB").peak("fp8")  # no FP8 tensor cores
    assert get_device("H100").peak("fp8") == 1979e12  # the datasheet: 3,958 TFLOP/s with sparsity


def test_device_spec_round_trips_and_validates() -> None:
    h100 = get_device("H100")
    assert DeviceSpec.from_dict(json.loads(json.dumps(h100.to_dict()))) == h100
    with pytest.raises(ValueError, match="hbm_bw"):
        DeviceSpec.from_dict({**h100.to_dict(), "hbm_bw": -1.0})


# --------------------------------------------------------------------------------------------
# compute
# --------------------------------------------------------------------------------------------


def test_matmul_efficiency_rises_with_size_towards_its_maximum() -> None:
    sizes = [1e6, 1e8, 1e10, 1e12, 1e14]
    effs = [op_efficiency("matmul", f) for f in sizes]
    assert effs == sorted(effs) and effs[-1] < MATMUL_MAX_EFFICIENCY
    assert effs[-1] == pytest.approx(MATMUL_MAX_EFFICIENCY, rel=1e-3)
    assert op_efficiency("elementwise", 1e9) == op_efficiency("other", 0) == MEMORY_EFFICIENCY


def test_compute_time_picks_compute_bound_for_a_large_gemm() -> None:
    h100 = get_device("H100")
    m = 8192
    flops, nbytes = 2.0 * m**3, 3.0 * m * m * 2
    eff = op_efficiency("matmul", flops, h100.peak("bf16"))
    expected = flops / (989e12 * eff) + h100.kernel_launch_s
    assert compute_time(flops, nbytes, h100, torch.bfloat16) == pytest.approx(expected)
    assert flops / (989e12 * eff) > nbytes / (h100.hbm_bw * MEMORY_EFFICIENCY)


@pytest.mark.parametrize("dims, dtype, device, kind", [
    ((16384, 4096, 50257), "bf16", "H100", "misaligned_matmul"),  # GPT-2's vocabulary
    ((16384, 4096, 50304), "bf16", "H100", "matmul"),             # ... padded to a multiple of 64
    ((16384, 4096, 50260), "bf16", "H200", "misaligned_matmul"),  # 8 bf16 elements = 16 bytes
    ((16384, 4096, 50260), "tf32", "A100", "matmul"),             # 4 tf32 elements = 16 bytes
    ((16384, 4096, 50257), "fp32", "H100", "matmul"),             # no tensor cores: no rule
    ((1000, 3, 7), "fp32", "cpu", "matmul"),                      # no rule on CPU
])
def test_matmul_kind_follows_the_tensor_core_alignment(dims, dtype, device, kind) -> None:
    assert matmul_kind(dims, get_device(device), dtype) == kind


def test_a_misaligned_gemm_runs_at_the_measured_fraction_of_the_aligned_rate() -> None:
    h200, flops = get_device("H200"), 2.0 * 16384 * 4096 * 50257
    aligned = compute_time(flops, 0, h200, "bf16", kind="matmul") - h200.kernel_launch_s
    misaligned = compute_time(flops, 0, h200, "bf16", kind="misaligned_matmul") - h200.kernel_launch_s
    assert misaligned == pytest.approx(aligned / MISALIGNED_MATMUL_FACTOR)
    assert flops / misaligned == pytest.approx(150e12, rel=0.15)  # measured: 137-146 TFLOP/s


def test_compute_time_picks_memory_bound_for_elementwise() -> None:
    a100 = get_device("A100")
    numel = 1 << 28
    expected = 3 * numel * 2 / (2039e9 * MEMORY_EFFICIENCY) + a100.kernel_launch_s
    assert compute_time(numel, 3 * numel * 2, a100, "bf16", kind="elementwise") == pytest.approx(expected)


def test_compute_time_of_nothing_is_zero_and_bad_input_raises() -> None:
    assert compute_time(0, 0, get_device("cpu"), torch.float32) == 0.0
    with pytest.raises(ValueError, match="conv"):
        compute_time(1e9, 0, get_device("H100"), "bf16", kind="conv")
    with pytest.raises(ValueError, match="flops"):
        compute_time(-1, 0, get_device("H100"), "bf16")


# --------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------


def test_adamw_state_bytes() -> None:
    assert adamw_state_bytes(1000, torch.bfloat16) == 12_000          # 2 fp32 moments + fp32 master
    assert adamw_state_bytes(1000, "bf16", master_dtype="bf16") == 4_000  # 2 bf16 moments, the masters are read
    assert adamw_state_bytes(1000, torch.float32) == 8_000            # no master copy for fp32
    with pytest.raises(ValueError, match="numel"):
        adamw_state_bytes(-1, torch.float32)


def test_usable_bytes_leaves_the_reserve() -> None:
    h100 = get_device("H100")
    assert 0 < reserve_fraction() < 0.2
    assert usable_bytes(h100) == pytest.approx(81559 * 2**20 * (1 - reserve_fraction()))


# --------------------------------------------------------------------------------------------
# package hygiene
# --------------------------------------------------------------------------------------------


def test_cost_models_never_imports_autopar() -> None:
    import autopar.cost_models as package

    for source in pathlib.Path(package.__file__).parent.glob("*.py"):
        text = source.read_text()
        assert "import autopar" not in text and "from autopar" not in text, source
