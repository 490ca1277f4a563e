"""``autopar calibrate``: fits recover known links and rates, profiles load as clusters, the CLI writes one.

Timing accuracy (predicted vs measured step time) is measured by ``benchmarks/calibration.py``, not
asserted here: a test only checks that the benchmark runs and writes its fields.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.api import resolve_cluster
from autopar.cli import main
from autopar.core.plan import Plan
from autopar.cost_models import (ClusterSpecError, DeviceSpec, GroupTopology, adamw_step_time, collective_time,
                                 compute_time, dispatched_time, get_device, parse_cluster)
from autopar.cost_models.calibrate import (CollectiveSample, LinkFit, build_profile, fit_link, fit_rate,
                                           host_dispatch_s, nonnegative_least_squares, profile_summary,
                                           redistribute_overhead_s, profile_text)
from autopar.cost_models.compute import (ADAMW_KERNELS_PER_TENSOR, MATMUL_MAX_EFFICIENCY, MEMORY_EFFICIENCY,
                                         adamw_bytes_per_element)

REPO = Path(__file__).resolve().parents[1]
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 24)


def ring(p: int, bw: float = 3e9, step: float = 40e-6, base: float = 25e-6) -> GroupTopology:
    return GroupTopology(size=p, per_node=p, nodes=1, intra_bw=bw, inter_bw=bw, intra_latency_s=step,
                         inter_latency_s=step, base_latency_s=base)


def synthetic_samples(group: GroupTopology) -> list[CollectiveSample]:
    return [CollectiveSample(kind, n, group.size, collective_time(kind, n, group)) for kind in KINDS for n in SIZES]


# ---- fitting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 4, 8])
def test_fit_link_recovers_a_known_link(p):
    fit = fit_link(synthetic_samples(ring(p)))
    assert fit.bw == pytest.approx(3e9, rel=1e-6)
    assert fit.step_latency_s == pytest.approx(40e-6, rel=1e-6)
    assert fit.base_latency_s == pytest.approx(25e-6, rel=1e-6)


def test_fit_link_prices_the_samples_back():
    group = ring(4, bw=1.5e9, step=7e-6, base=90e-6)
    fit = fit_link(synthetic_samples(group))
    priced = ring(4, bw=fit.bw, step=fit.step_latency_s, base=fit.base_latency_s)
    for sample in synthetic_samples(group):
        assert collective_time(sample.kind, sample.nbytes, priced) == pytest.approx(sample.seconds, rel=1e-6)


def test_fit_link_keeps_latencies_non_negative():
    """Timings that a negative per-step latency would fit best (noise) get a zero one instead."""
    samples = [CollectiveSample("all_reduce", n, 2, 1e-4 + n / 2e9) for n in SIZES]
    samples += [CollectiveSample("all_gather", n, 2, 2e-4 + n / 4e9) for n in SIZES]
    fit = fit_link(samples)
    assert fit.step_latency_s >= 0 and fit.base_latency_s >= 0 and fit.bw > 0


def test_fit_link_bounds_bandwidth_when_every_size_is_latency_bound():
    """Flat timings (small, noisy messages): the bandwidth is the fastest rate observed, the rest latency."""
    samples = [CollectiveSample("all_reduce", n, 2, 1e-3) for n in SIZES]
    fit = fit_link(samples)
    largest = max(SIZES)
    assert fit.bw == pytest.approx(largest / 1e-3, rel=1e-9)  # ring bytes of a 2-rank all_reduce = n
    assert fit.base_latency_s + 2 * fit.step_latency_s <= 1e-3 + 1e-12


def test_fit_link_prices_small_messages_by_their_own_latency():
    """Small messages at 100 us, large ones with a slower fixed part (a protocol switch): the fit weighs
    every size alike, so the smallest stays priced near its 100 us (an absolute fit, ruled by the 16 MB
    samples, priced it at about 1 ms)."""
    small = [CollectiveSample("all_gather", n, 2, 100e-6 + n / 1e9) for n in (1 << 10, 1 << 12, 1 << 14)]
    large = [CollectiveSample("all_gather", n, 2, 1e-3 + n / 1e9) for n in (1 << 22, 1 << 24)]
    fit = fit_link(small + large)
    group = ring(2, bw=fit.bw, step=fit.step_latency_s, base=fit.base_latency_s)
    assert collective_time("all_gather", 1 << 10, group) == pytest.approx(small[0].seconds, rel=0.5)
    assert collective_time("all_gather", 1 << 24, group) == pytest.approx(large[-1].seconds, rel=0.2)


def test_fit_rate_recovers_rate_and_intercept():
    flops = [2 * n**3 for n in (64, 128, 256, 512)]
    fit = fit_rate(flops, [30e-6 + f / 40e9 for f in flops])
    assert fit.rate == pytest.approx(40e9, rel=1e-6)
    assert fit.intercept_s == pytest.approx(30e-6, rel=1e-6)


def test_fit_rate_of_one_size_is_the_rate_through_the_origin():
    """One size (what `calibrate --quick` measured of an H200's bandwidth) gave no fit at all before."""
    fit = fit_rate([1 << 27, 1 << 27], [40e-6, 60e-6])
    assert fit.intercept_s == 0.0 and fit.rate == pytest.approx((1 << 27) / 50e-6)


def test_timings_that_do_not_grow_with_work_give_the_largest_sizes_rate_with_a_warning():
    """The smaller size ran slower (its own kernel path, or a disturbed repeat): no rate fits the two, so the
    largest size's rate through the origin is used, and the user is told."""
    with pytest.warns(UserWarning, match="do not grow with work"):
        fit = fit_rate([1 << 22, 1 << 25], [62e-6, 37e-6])
    assert fit.intercept_s == 0.0 and fit.rate == pytest.approx((1 << 25) / 37e-6)


def test_nonnegative_least_squares_clamps_at_zero():
    # y = -1 + 2x fits best with a negative intercept; constrained, the intercept is 0
    x = nonnegative_least_squares([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], [1.0, 3.0, 5.0])
    assert x[0] == 0.0 and x[1] == pytest.approx(22 / 14)


# ---- profiles --------------------------------------------------------------------------------


def synthetic_measurement(world: int = 2) -> dict:
    """What ``measure_rank`` returns, for a machine with known rates and link."""
    matmul = [{"dtype": "fp32", "m": n, "n": n, "k": n, "flops": 2 * n**3, "seconds": 5e-6 + 2 * n**3 / 50e9}
              for n in (128, 256, 512)]
    memory = [{"elements": e, "bytes": 12 * e, "seconds": 2e-6 + 12 * e / 8e9} for e in (1 << 20, 1 << 22)]
    link = [{"kind": s.kind, "nbytes": s.nbytes, "ranks": s.ranks, "seconds": s.seconds}
            for s in synthetic_samples(ring(world))]
    return {"device_type": "cpu", "device_name": "x86_64", "world": world, "ranks_per_node": world,
            "threads_per_rank": 1, "hbm_bytes": 8 * 10**9, "matmul": matmul, "memory": memory,
            "links": {"intra": link},
            "op_floor": {"method": "synthetic", "forward_s": 1e-4, "forward_backward_s": 3e-4,
                         "kernel_launch_s": 1e-4, "host_op_s": 2e-4, "host_update_op_s": 5e-5,
                         "lowered_host_op_s": 3e-5}}


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(profile_text(build_profile(synthetic_measurement(), "autopar calibrate (test) on nowhere")))
    return path


def test_profile_is_a_cluster_file_with_the_measured_figures(profile_path):
    cluster = resolve_cluster(str(profile_path))
    device = cluster.device
    assert (cluster.nodes, cluster.devices_per_node, device.name) == (1, 2, "cpu")
    assert device.peak("fp32") == pytest.approx(50e9 / MATMUL_MAX_EFFICIENCY, rel=1e-6)
    assert device.hbm_bw == pytest.approx(8e9 / MEMORY_EFFICIENCY, rel=1e-6)
    assert cluster.intra_bw == pytest.approx(3e9, rel=1e-6)
    assert device.intra_latency_s == pytest.approx(40e-6, rel=1e-6)
    assert device.base_latency_s == pytest.approx(25e-6, rel=1e-6)
    assert device.kernel_launch_s == 1e-4
    assert (device.host_op_s, device.host_update_op_s, device.host_runs_kernels) == (2e-4, 5e-5, True)
    assert device.lowered_host_op_s == 3e-5
    data = json.loads(profile_path.read_text())
    assert data["source"].startswith("autopar calibrate")
    assert {"matmul", "memory", "links", "op_floor", "fits"} <= set(data["measured"])


def test_profile_prices_a_large_matmul_at_the_measured_rate(profile_path):
    device = parse_cluster(str(profile_path)).device
    flops = 2 * 4096**3
    seconds = compute_time(flops, 0, device, "fp32") - device.kernel_launch_s - device.host_op_s
    assert flops / seconds == pytest.approx(50e9, rel=0.01)


# ---- host dispatch and the optimizer update ----------------------------------------------------


def test_host_dispatch_is_the_block_time_less_floors_per_priced_dispatch():
    # 10 ops and 20 views forward, 5 leaves: 90 + 5 priced dispatches; 30 + 5 kernel floors of 10 us
    assert host_dispatch_s(9.85e-3, ops=10, views=20, leaves=5, kernel_launch_s=10e-6) == pytest.approx(100e-6)
    assert host_dispatch_s(1e-4, ops=10, views=0, leaves=5, kernel_launch_s=10e-6) == 0.0  # floors exceed the time


def test_redistribute_overhead_is_the_marginal_time_less_the_link_formula():
    link = LinkFit(base_latency_s=200e-6, step_latency_s=50e-6, bw=1e9)
    # a 2-rank all_gather of 1 MB: 200 + 1 x 50 us + 0.5 MB / 1 GB/s = 0.75 ms by the formula
    sample = {"kind": "all_gather", "nbytes": 1e6, "ranks": 2, "seconds": 2e-3}
    assert redistribute_overhead_s(sample, link) == pytest.approx(1.25e-3)
    assert redistribute_overhead_s({**sample, "seconds": 0.5e-3}, link) == 0.0  # faster than the formula


def test_marginal_time_is_the_median_of_paired_differences(monkeypatch):
    """A fake clock: the base call takes 1 s, the extended one 3 s, and one repeat of the base is
    disturbed (+10 s per call). The fastest base repeat is 1 s and the marginal time stays 2 s."""
    from autopar.cost_models import calibrate

    clock = {"now": 0.0, "base_calls": 0}

    def base() -> None:
        clock["base_calls"] += 1
        clock["now"] += 11.0 if clock["base_calls"] == 5 else 1.0  # calls 1-2 size the repeat; 5: repeat 3

    def extended() -> None:
        clock["now"] += 3.0

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock["now"])
    sizes = calibrate.Sizes((), (), (), min_repeat_s=0.5, repeats=5)
    fastest, marginal = calibrate._fastest_and_marginal(base, extended, sizes, agree=lambda calls: calls,
                                                        align=lambda: None)
    assert (fastest, marginal) == (1.0, 2.0)


def test_profile_carries_the_redistribute_overhead_measured_over_the_fitted_link():
    measured = synthetic_measurement()
    measured["op_floor"]["redistribute"] = {"kind": "all_gather", "nbytes": 1024, "ranks": 2, "seconds": 1e-3}
    device = build_profile(measured, "test")["device"]
    link = LinkFit(base_latency_s=25e-6, step_latency_s=40e-6, bw=3e9)  # synthetic_samples' ring(2)
    assert device["redistribute_s"] == pytest.approx(redistribute_overhead_s(measured["op_floor"]["redistribute"],
                                                                             link), rel=1e-6)
    assert device["redistribute_s"] == pytest.approx(1e-3 - 25e-6 - 40e-6 - 512 / 3e9, rel=1e-6)
    assert "redistribute_s" not in build_profile(synthetic_measurement(), "test")["device"]


def test_a_single_rank_profile_keeps_the_presets_links_and_charges_no_redistribute():
    """One rank measures no link: its profile keeps the base preset's link figures, and the
    redistribute it timed (a no-op on one rank) sets no ``redistribute_s``."""
    measured = synthetic_measurement(world=1)
    measured["links"] = {}
    measured["op_floor"]["redistribute"] = {"kind": "all_gather", "nbytes": 1024, "ranks": 1, "seconds": 1e-5}
    profile = build_profile(measured, "test")
    assert "redistribute_s" not in profile["device"] and "nvlink_bw" not in profile["device"]
    assert (profile["nodes"], profile["devices_per_node"]) == (1, 1)


def test_each_critical_path_collective_pays_the_redistribute_overhead_and_gradient_sync_does_not():
    from dataclasses import replace

    from torch.distributed.tensor import Replicate, Shard

    from autopar.planning.pricing import Collective, Pricer

    base = resolve_cluster("1x2xcpu")
    plain, slow = (Pricer(replace(base, device=cpu_device(redistribute_s=r)), (2,), "fp32") for r in (0.0, 1e-3))
    val = torch.empty(8, 16)
    sharded, whole = (Shard(0),), (Replicate(),)
    # S(0) -> R: an all_gather forward, nothing backward; with a partial gradient, a reduce_scatter too
    assert slow.edge(val, sharded, whole).exposed_s == pytest.approx(plain.edge(val, sharded, whole).exposed_s + 1e-3)
    gathered = (slow.edge(val, sharded, whole, grad_partial=(0,)).exposed_s
                - plain.edge(val, sharded, whole, grad_partial=(0,)).exposed_s)
    assert gathered == pytest.approx(2e-3)
    assert slow.edge(val, whole, whole).exposed_s == 0.0
    sync = Collective("all_reduce", "backward", 4096, 0, whole, grad_sync=True)
    assert slow.collective_seconds(sync) == plain.collective_seconds(sync)  # bucketed, raw c10d: no DTensor


def test_a_plan_priced_with_a_profile_charges_its_redistributes(profile_path, tmp_path, capsys):
    """tiny-gpt on 2 ranks priced with a profile whose redistributes cost 2 ms: each critical-path
    collective of the plan is the link's formula plus 2 ms, and the step's communication is their sum."""
    from autopar.planning.pricing import Pricer

    data = json.loads(profile_path.read_text())
    data["device"]["redistribute_s"] = 2e-3
    slower = tmp_path / "slower.json"
    slower.write_text(json.dumps(data))
    assert main(["plan", "tiny-gpt", "--cluster", str(slower), "--fix", "dp=2,microbatches=1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    group = Pricer(resolve_cluster(str(slower)), (2,), "fp32").groups[0]
    critical = [c for op in plan["ops"].values() for c in op.get("collectives", []) if not c["grad_sync"]]
    assert critical  # the loss's gathers, at least
    for c in critical:
        assert c["seconds"] == pytest.approx(collective_time(c["kind"], c["nbytes"], group) + 2e-3)
    predicted = plan["predicted"]
    prefetched = sum(op["cost"].get("prefetched_s", 0.0) for op in plan["ops"].values())  # beside compute
    comm = sum(predicted["comm_s"].values()) - predicted["grad_sync_s"] - prefetched
    assert comm == pytest.approx(sum(c["seconds"] for c in critical if not c.get("prefetched")))
    op = next(name for name, op in plan["ops"].items() if any(not c["grad_sync"] for c in op.get("collectives", [])))
    assert "(the device's calibrated redistribute_s)" in Plan.from_dict(plan).explain(op)  # explain shows the term


def cpu_device(**fields) -> DeviceSpec:
    return DeviceSpec.from_dict({**get_device("cpu").to_dict(), **fields})


def test_dispatch_adds_to_the_kernel_on_cpu_and_hides_behind_it_on_cuda():
    cpu = cpu_device(host_op_s=50e-6)
    assert dispatched_time(30e-6, 50e-6, cpu) == pytest.approx(80e-6)
    gpu = DeviceSpec.from_dict({**get_device("H100").to_dict(), "host_op_s": 50e-6})
    assert dispatched_time(30e-6, 50e-6, gpu) == 50e-6  # host-bound: the device waits for the host
    assert dispatched_time(2e-3, 50e-6, gpu) == 2e-3  # device-bound: the host runs ahead


def test_a_view_costs_its_dispatch_and_an_op_its_kernel_plus_dispatch():
    cpu = cpu_device(host_op_s=50e-6, kernel_launch_s=5e-6, hbm_bw=10e9)
    assert compute_time(0, 0, cpu, "fp32", "elementwise") == pytest.approx(50e-6)
    # 7e6 bytes at 0.7 x 10 GB/s = 1 ms, plus the 5 us floor, plus 50 us of dispatch
    assert compute_time(0, 7e6, cpu, "fp32", "elementwise") == pytest.approx(1.055e-3)
    assert compute_time(0, 0, get_device("H100"), "bf16", "elementwise") == 0.0  # presets: no host term


def test_each_runtime_is_priced_with_its_own_host_dispatch(profile_path):
    """A calibrated profile states DTensor's dispatch per op (``host_op_s``, 200 us here) and the lowered
    runtime's (``lowered_host_op_s``, 30 us): a view, which launches no kernel, costs its dispatch forward
    and twice backward, 3 x 30 us in a plan priced for the lowered runtime and 3 x 200 us on DTensor; a
    device without the lowered figure (the presets, older profiles) charges ``host_op_s`` to both."""
    from dataclasses import replace

    import autopar
    from autopar.core.plan import DTENSOR, LOWERED
    from autopar.models import build_model
    from autopar.planning.pricing import dispatched_by

    bundle = build_model("mlp", global_batch=8)
    for runtime, host in ((LOWERED, 3e-5), (DTENSOR, 2e-4)):
        plan = autopar.plan(bundle.model, bundle.example_inputs, str(profile_path), bundle.loss_fn,
                            {"dp": 2, "runtime": runtime}, example_targets=bundle.example_targets)
        assert plan.predicted["runtime"] == runtime
        views = [op["cost"]["compute_s"] for op in plan.ops.values() if op["op"] == "aten.permute.default"]
        assert views and all(v == pytest.approx(3 * host) for v in views), (runtime, views)
    older = resolve_cluster(str(profile_path))
    older = replace(older, device=replace(older.device, lowered_host_op_s=None))
    assert dispatched_by(older, LOWERED) is older


def test_dispatch_is_charged_per_op_and_the_gradient_sync_adds_none():
    """Every op pays its dispatch forward and twice backward (3 x host_op_s), per microbatch, but the first
    linear layer's once backward (its input gets no gradient: only the weight's is computed); an op whose
    weight gradient the bucketed sync reduces pays nothing more: the sync makes no DTensor dispatch
    (``passes/gradient_sync.py`` reads local tensors and wraps the reduced slices directly)."""
    from dataclasses import replace

    from autopar.ir.capture import capture
    from autopar.models import build_model
    from autopar.core.constraints import Constraints
    from autopar.planning.search import make_plan

    b = build_model("mlp", global_batch=8)
    captured = capture(b.model, b.example_inputs, b.example_targets, b.loss_fn)
    base = resolve_cluster("1x2xcpu")
    host = 50e-6
    plans = [make_plan(captured, replace(base, device=cpu_device(host_op_s=h)), model_name="mlp",
                       constraints=Constraints(dp=2, microbatches=m, runtime="dtensor"))
             for h, m in ((0.0, 1), (host, 1), (0.0, 2), (host, 2))]
    synced = 0
    inputs = set(captured.user_inputs)
    first_linear = next(n.name for n in captured.graph.nodes if n.target is torch.ops.aten.addmm.default
                        and any(a.name in inputs for a in n.all_input_nodes))
    for name, op in plans[1].ops.items():
        if any(plan.ops[name]["outputs"] != op["outputs"] or plan.ops[name]["inputs"] != op["inputs"]
               for plan in (plans[0], plans[2], plans[3])):
            continue  # dispatch cost made the solver place this op otherwise: not comparable
        grads = sum(1 for t in op.get("collectives", []) if t["grad_sync"] and t["kind"] == "all_reduce")
        synced += grads
        dispatches = 2 if name == first_linear else 3
        extra = op["cost"]["compute_s"] - plans[0].ops[name]["cost"]["compute_s"]
        assert extra == pytest.approx(dispatches * host), name
        twice = plans[3].ops[name]["cost"]["compute_s"] - plans[2].ops[name]["cost"]["compute_s"]
        assert twice == pytest.approx(2 * dispatches * host), name
    assert synced >= 2  # the mlp's weights


def test_adamw_moves_28_bytes_per_element_in_fp32_and_in_mixed_precision():
    # fp32: read p, g, m, v (16) and write p, m, v (12); bf16: read master, m, v (12) and the bf16 grad (2),
    # write master, m, v (12) and the bf16 parameter (2)
    assert adamw_bytes_per_element("fp32") == 28 and adamw_bytes_per_element("bf16") == 28


def test_adamw_moves_14_bytes_per_element_with_bf16_masters():
    # the bf16 parameter is its own master: read p, g, m, v (8) and write p, m, v (6), all bf16
    assert adamw_bytes_per_element("bf16", "bf16") == 14


def test_adamw_step_time_is_per_tensor_floors_plus_bytes():
    cpu = cpu_device(kernel_launch_s=5e-6, host_update_op_s=40e-6, hbm_bw=10e9)
    assert ADAMW_KERNELS_PER_TENSOR == 8
    # 1e6 fp32 elements: 28 MB at 7 GB/s = 4 ms; 8 kernels x (5 + 40) us = 0.36 ms
    assert adamw_step_time([1e6], cpu, "fp32") == pytest.approx(4.36e-3)
    assert adamw_step_time([1e6, 1e6], cpu, "fp32") == pytest.approx(8.72e-3)
    gpu = get_device("H100")  # 28 MB at 0.7 x 3.35 TB/s, 8 launch floors of 4 us, no host term
    assert adamw_step_time([1e6], gpu, "bf16") == pytest.approx(28e6 / (0.7 * 3350e9) + 8 * 4e-6)


def test_device_files_written_before_the_dispatch_fields_still_load():
    old = {k: v for k, v in get_device("cpu").to_dict().items()
           if k not in ("host_op_s", "host_update_op_s", "host_runs_kernels")}
    device = DeviceSpec.from_dict(old)
    assert (device.host_op_s, device.host_update_op_s, device.host_runs_kernels) == (0.0, 0.0, False)


def test_cluster_file_rejects_malformed_metadata(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"nodes": 1, "devices_per_node": 2, "device": "cpu", "measured": [1]}))
    with pytest.raises(ClusterSpecError, match="measured"):
        parse_cluster(str(path))


def test_profile_summary_names_the_figures(profile_path):
    text = profile_summary(json.loads(profile_path.read_text()))
    assert "GFLOP/s" in text and "GB/s" in text and "intra-node" in text and "1x2xcpu" in text


def test_plan_accepts_the_profile(profile_path, capsys):
    assert main(["plan", "tiny-gpt", "--cluster", str(profile_path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["cluster"]["devices"] == 2 and plan["predicted"]["step_time_s"] > 0
    # without a pipeline every rank updates each of tiny-gpt's 37 parameter tensors (whole or a shard):
    # at least their kernels' floors and dispatches, 8 x (100 + 50) us per tensor
    assert plan["pipeline"]["stages"] == [[0, 2]]
    assert plan["predicted"]["optimizer_s"] >= 37 * 8 * 150e-6


# ---- command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("argv, mention", [
    (["--ranks", "0"], "--ranks"),
    (["-o", "/no/such/dir/profile.json"], "directory"),
])
def test_calibrate_rejects_bad_options(argv, mention, capsys):
    assert main(["calibrate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and mention in err


def run_python(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


@pytest.mark.slow
@pytest.mark.dist
def test_calibrate_on_two_gloo_ranks_writes_a_profile(tmp_path):
    run = run_python("-m", "autopar", "calibrate", "--ranks", "2", "--quick", "-o", "tmp.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "wrote tmp.json" in run.stdout
    cluster = resolve_cluster(str(tmp_path / "tmp.json"))
    assert cluster.world_size == 2
    measured = json.loads((tmp_path / "tmp.json").read_text())["measured"]
    assert {s["kind"] for s in measured["links"]["intra"]} == set(KINDS)
    assert measured["world"] == 2 and measured["fits"]["links"]["intra"]["bw"] > 0


@pytest.mark.slow
def test_calibrate_on_one_rank_writes_a_profile_a_plan_accepts(tmp_path):
    """``autopar calibrate`` with no job and no --ranks measures this process alone (one GPU, or a
    laptop): no collective, so the profile keeps the preset's links; it still plans, float8 linears too (it
    measured ``torch._scaled_mm``)."""
    run = run_python("-m", "autopar", "calibrate", "--quick", "-o", "one.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    profile = json.loads((tmp_path / "one.json").read_text())
    assert (profile["nodes"], profile["devices_per_node"]) == (1, 1) and profile["measured"]["links"] == {}
    assert resolve_cluster(str(tmp_path / "one.json")).world_size == 1
    assert profile["device"]["peak_flops"]["fp8"] > 0  # torch._scaled_mm, emulated on the CPU
    planned = run_python("-m", "autopar", "plan", "tiny-llama", "--cluster", "one.json", "--global-batch", "8",
                         "--fix", "fp8=tensorwise", "--json", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["precision"]["fp8"] == "tensorwise"


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.heavy
def test_calibration_benchmark_runs_and_writes_its_fields(tmp_path):
    out = tmp_path / "calibration.json"
    run = run_python(str(REPO / "benchmarks" / "calibration.py"), "--worlds", "2", "--rounds", "2", "--quick",
                     "--steps", "2", "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert [(r["round"], r["runtime"]) for r in data["rows"]] == [(0, "lowered"), (0, "dtensor"), (1, "lowered"),
                                                                   (1, "dtensor")]
    first, second = [r for r in data["rows"] if r["runtime"] == "dtensor"]
    assert {"world", "round", "predicted_step_s", "preset_predicted_step_s", "measured_step_s", "measured_update_s",
            "error", "profile"} <= set(first)
    assert (first["round"], second["round"]) == (0, 1)
    assert first["world"] == 2 and first["measured_step_s"] > 0 and first["predicted_step_s"] > 0
    pooled, lowered = data["pooled"]
    assert (pooled["runtime"], lowered["runtime"]) == ("dtensor", "lowered")
    predictions = sorted(r["predicted_step_s"] for r in data["rows"] if r["runtime"] == "dtensor")
    assert pooled["world"] == 2 and pooled["rounds"] == 2
    assert pooled["predicted_step_s"] == pytest.approx(sum(predictions) / 2)  # the median of two
    assert 0 <= pooled["rounds_within_30_percent"] <= 2


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.heavy
def test_device_step_benchmark_runs_on_cpu_and_reprices_its_rows(tmp_path):
    """The GPU benchmark's CPU stand-in: calibrates, plans and times the small models; --reprice reads
    the file back and re-plans each row."""
    out = tmp_path / "device_step.json"
    run = run_python(str(REPO / "benchmarks" / "device_step.py"), "--device", "cpu", "--quick", "--steps", "1",
                     "--runtimes", "default,dtensor", "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert [r["model"] for r in data["rows"]] == ["gpt h64 L2", "llama h64 L2"], data["rows"]
    for row in data["rows"]:
        assert row["eager"]["median_s"] > 0 and row["autopar"]["median_s"] > 0
        assert row["autopar_dtensor"]["median_s"] > 0, row["autopar_dtensor"]
        assert row["predicted"]["calibrated"]["step_time_s"] > 0
    again = run_python(str(REPO / "benchmarks" / "device_step.py"), "--reprice", str(out), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "gpt h64 L2" in again.stdout and "llama h64 L2" in again.stdout


@pytest.mark.slow
def test_kernel_probe_benchmark_prices_each_block_by_its_own_ops(tmp_path):
    """The kernel probe's CPU stand-in: each block is planned alone and timed forward + backward; its
    prediction is the sum of its own ops' prices (the loss feeding the gradient in left out): one ``mm``
    for the GEMM, the fused op for attention, the norm's elementwise ops, the loss's log-softmax.
    ``--reprice`` reads the file back and re-plans each probe."""
    out = tmp_path / "kernel_probe.json"
    run = run_python(str(REPO / "benchmarks" / "kernel_probe.py"), "--device", "cpu", "--steps", "2",
                     "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    rows = {r["family"]: r for r in data["rows"]}
    assert set(rows) == {"gemm", "attention", "bandwidth", "loss"}, data["rows"]
    for row in rows.values():
        assert row["measured_s"] > 0 and len(row["samples_s"]) == 2 and row["enqueued_s"] > 0
        assert row["predicted_s"] == pytest.approx(sum(row["ops"].values())) and row["predicted_s"] > 0
        assert row["error"] == pytest.approx((row["predicted_s"] - row["measured_s"]) / row["measured_s"])
    assert [name for name, s in rows["gemm"]["ops"].items() if s > 0] == ["mm"]  # the loss's mul and sum left out
    assert rows["gemm"]["flops"] == 6 * 256 * 128 * 128
    assert rows["gemm"]["enqueued_tflops"] == pytest.approx(rows["gemm"]["flops"] / rows["gemm"]["enqueued_s"] / 1e12)
    assert list(rows["attention"]["ops"]) == ["scaled_dot_product_attention"]
    assert {"pow_1", "mean", "rsqrt"} <= set(rows["bandwidth"]["ops"])
    assert "_log_softmax" in rows["loss"]["ops"]
    again = run_python(str(REPO / "benchmarks" / "kernel_probe.py"), "--reprice", str(out), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert all(row["name"] in again.stdout for row in data["rows"])  # each probe re-planned on meta tensors
