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

from autopar.api import resolve_cluster
from autopar.cli import main
from autopar.cost_models import ClusterSpecError, GroupTopology, collective_time, compute_time, parse_cluster
from autopar.cost_models.calibrate import (CollectiveSample, build_profile, fit_link, fit_rate,
                                           nonnegative_least_squares, profile_summary, write_profile)
from autopar.cost_models.compute import MATMUL_MAX_EFFICIENCY, MEMORY_EFFICIENCY

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


def test_fit_rate_recovers_rate_and_intercept():
    flops = [2 * n**3 for n in (64, 128, 256, 512)]
    fit = fit_rate(flops, [30e-6 + f / 40e9 for f in flops])
    assert fit.rate == pytest.approx(40e9, rel=1e-6)
    assert fit.intercept_s == pytest.approx(30e-6, rel=1e-6)


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
                         "kernel_launch_s": 1e-4}}


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    write_profile(build_profile(synthetic_measurement(), "autopar calibrate (test) on nowhere"), str(path))
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
    data = json.loads(profile_path.read_text())
    assert data["source"].startswith("autopar calibrate")
    assert {"matmul", "memory", "links", "op_floor", "fits"} <= set(data["measured"])


def test_profile_prices_a_large_matmul_at_the_measured_rate(profile_path):
    device = parse_cluster(str(profile_path)).device
    flops = 2 * 4096**3
    seconds = compute_time(flops, 0, device, "fp32") - device.kernel_launch_s
    assert flops / seconds == pytest.approx(50e9, rel=0.01)


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
@pytest.mark.dist
@pytest.mark.heavy
def test_calibration_benchmark_runs_and_writes_its_fields(tmp_path):
    out = tmp_path / "calibration.json"
    run = run_python(str(REPO / "benchmarks" / "calibration.py"), "--worlds", "2", "--quick", "--steps", "2",
                     "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(out.read_text())
    assert {"world", "predicted_step_s", "preset_predicted_step_s", "measured_step_s", "measured_update_s",
            "error", "profile"} <= set(row)
    assert row["world"] == 2 and row["measured_step_s"] > 0 and row["predicted_step_s"] > 0
