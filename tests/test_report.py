"""``autopar report``: the HTML page (``report_html``) and the simulated-step trace (``trace``).

Real tiny-gpt plans on H100 clusters: one node (1x4), two nodes with dp=4 x tp=4 (dp groups span the
nodes and the devices inside them) and dp=2 x tp=8 with two microbatches (dp groups only cross nodes).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cli_runner import run_cli
import autopar
from autopar.inspect import trace as trace_mod
from autopar.models import build_model
from autopar.inspect.show import collapsed_placements
from autopar.inspect.report_html import collapse_layers, mesh_links, render_report, top_modules
from autopar.inspect.trace import TRACKS, simulated_trace

SECTIONS = ("Mesh and hardware", "Per-layer placements", "Memory per device", "Step time breakdown",
            "Top 15 modules by predicted time", "Pipeline schedule", "Mesh candidates")
CHART_LABELS = ("parameter placements", "memory per device", "step time breakdown", "top modules by predicted time",
                "microbatch timeline")


@pytest.fixture(scope="module")
def plans() -> dict[str, autopar.Plan]:
    bundle = build_model("tiny-gpt", overrides={}, global_batch=8, seq=None, device="meta")

    def make(cluster, constraints=None):
        return autopar.plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn, constraints,
                            example_targets=bundle.example_targets, name=bundle.name)

    return {"one_node": make("1x4xH100"),
            "dp4_tp4": make("2x8xH100", {"dp": 4, "tp": 4}),
            "dp2_tp8_mb2": make("2x8xH100", {"dp": 2, "tp": 8, "microbatches": 2})}


# ---- mesh -> hardware ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape, per_node, links", [
    ([4], 4, ["NVLink"]),
    ([4, 4], 8, ["NVLink + network", "NVLink"]),
    ([2, 8], 8, ["network", "NVLink"]),
    ([16], 8, ["NVLink + network"]),
    ([8, 2, 4], 8, ["network", "NVLink", "NVLink"]),
    ([1, 8], 8, ["none (size 1)", "NVLink"]),
])
def test_mesh_links_follow_row_major_ranks(shape, per_node, links):
    assert [m["link"] for m in mesh_links(shape, per_node)] == links


def _mesh_table(page: str) -> dict[str, tuple[int, str]]:
    rows = re.findall(r'<tr><td>([^<]+)</td><td class="num">(\d+)</td><td class="num">\d+</td><td>([^<]+)</td>', page)
    return {name: (int(size), link) for name, size, link in rows}


@pytest.mark.parametrize("key, expected", [
    ("one_node", None),  # whatever the solver picks on one node rides on NVLink
    ("dp4_tp4", {"dp": (4, "NVLink + network"), "tp": (4, "NVLink")}),
    ("dp2_tp8_mb2", {"dp": (2, "network"), "tp": (8, "NVLink")}),
])
def test_page_maps_each_mesh_dim_to_its_links(plans, key, expected):
    plan = plans[key]
    table = _mesh_table(render_report(plan))
    if expected is None:
        expected = {n: (s, "NVLink") for n, s in zip(plan.mesh["dim_names"], plan.mesh["shape"]) if s > 1}
    assert table == expected


# ---- the page ------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["one_node", "dp4_tp4", "dp2_tp8_mb2"])
def test_page_has_every_section_chart_and_placement(plans, key):
    plan = plans[key]
    page = render_report(plan)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page, title
    for label in CHART_LABELS:
        assert '<svg width="' in page and f'aria-label="{label}"' in page, label
    assert page.count('aria-label="devices by node') == len(plan.mesh["shape"])
    for name, text, n in collapsed_placements(plan.placements):
        assert f">{name}" in page, name
    placements_seen = set(re.findall(r">(S\(\d\)|R)</text>", page))
    assert placements_seen == {p for pls in plan.placements.values() for p in pls}
    for v in (plan.model["name"], plan.cluster["spec"], f"{plan.predicted['mfu'] * 100:.1f}%", plan.solver["status"]):
        assert str(v) in page


def test_page_is_self_contained(plans):
    page = render_report(plans["dp4_tp4"])
    assert not re.search(r"<script|<link|<img|<iframe", page, re.I)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", page, re.I)
    assert "http" not in page


def test_page_escapes_text_from_the_plan(plans):
    data = plans["one_node"].to_dict()
    data["model"]["name"] = "<script>alert(1)</script>"
    page = render_report(autopar.Plan.from_dict(data))
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_page_shows_microbatch_timeline(plans):
    page = render_report(plans["dp2_tp8_mb2"])
    assert "2 microbatches" in page and "(gradient accumulation)" in page
    assert ">F2<" in page and ">B2<" in page


def test_top_modules_fold_layers_and_sum_to_the_plan(plans):
    plan = plans["dp4_tp4"]
    assert collapse_layers("blocks.11.mlp.fc_in") == "blocks.*.mlp.fc_in"
    assert collapse_layers("blocks.3") == "blocks.*" and collapse_layers("") == "(top level)"
    everything = top_modules(plan, n=10_000)
    assert len(top_modules(plan)) == min(15, len(everything))
    assert "blocks.*.mlp.fc_in" in {r["module"] for r in everything}
    assert not any(re.search(r"\.\d+(\.|$)", r["module"]) for r in everything)
    total = sum(r["compute_s"] for r in everything)
    assert total == pytest.approx(plan.predicted["compute_s"], rel=1e-9)
    times = [r["total_s"] for r in everything]
    assert times == sorted(times, reverse=True)


# ---- the trace -----------------------------------------------------------------------------------
def _x_events(tr: dict, track: str | None = None) -> list[dict]:
    return [e for e in tr["traceEvents"] if e["ph"] == "X" and (track is None or e["tid"] == TRACKS[track])]


@pytest.mark.parametrize("key", ["one_node", "dp4_tp4", "dp2_tp8_mb2"])
def test_trace_is_valid_and_adds_up(plans, key):
    plan = plans[key]
    tr = json.loads(json.dumps(simulated_trace(plan)))
    assert tr["displayTimeUnit"] == "ms" and _x_events(tr)
    for e in _x_events(tr):
        assert e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == 0 and "args" in e, e
    named = {e["tid"]: e["args"]["name"] for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert named == {tid: name for name, tid in TRACKS.items()}
    ops_compute_us = sum(op["cost"]["compute_s"] for op in plan.ops.values()) * 1e6
    compute_events = _x_events(tr, "compute")
    compute_us = sum(e["dur"] for e in compute_events)
    # each event's duration is rounded to 1e-4 us: the sum may drift by half of that per event
    assert compute_us == pytest.approx(ops_compute_us, rel=1e-6, abs=5e-5 * len(compute_events))
    assert compute_us == pytest.approx(plan.predicted["compute_s"] * 1e6, rel=0.01)
    comm_us = sum(e["dur"] for e in _x_events(tr, "communication"))
    ops_comm_us = sum(s for op in plan.ops.values() for s in op["cost"]["comm_s"].values()) * 1e6
    assert comm_us == pytest.approx(ops_comm_us, rel=1e-6, abs=1e-3)
    sync_us = sum(e["dur"] for e in _x_events(tr, "gradient sync"))
    assert sync_us == pytest.approx(plan.predicted.get("grad_sync_s", 0.0) * 1e6, rel=1e-6, abs=1e-3)


def test_trace_tracks_never_overlap_themselves(plans):
    tr = simulated_trace(plans["dp2_tp8_mb2"])
    for track in ("compute", "communication", "gradient sync"):
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in _x_events(tr, track))
        assert all(a_end <= b_start + 1e-3 for (_, a_end), (b_start, _) in zip(spans, spans[1:])), track


def test_trace_repeats_ops_per_microbatch_with_their_placements(plans):
    plan = plans["dp2_tp8_mb2"]
    assert plan.pipeline["microbatches"] == 2
    tr = simulated_trace(plan)
    forward = [e for e in _x_events(tr, "compute") if e["cat"] == "forward"]
    timed_ops = [n for n, op in plan.ops.items() if op["cost"]["compute_s"] > 0]
    assert len(forward) == 2 * len(timed_ops)
    assert {e["args"]["microbatch"] for e in forward} == {0, 1}
    first = forward[0]["args"]
    assert first["op"] == timed_ops[0] and first["inputs"] == plan.ops[timed_ops[0]]["inputs"]
    assert "module" in first and "outputs" in first
    mbs = [e for e in _x_events(tr, "microbatches")]
    assert [e["name"] for e in mbs] == ["microbatch 0 forward", "microbatch 0 backward",
                                        "microbatch 1 forward", "microbatch 1 backward"]


def test_trace_merges_ops_when_it_would_be_too_long(plans, monkeypatch):
    plan = plans["dp2_tp8_mb2"]
    full = len(_x_events(simulated_trace(plan)))
    monkeypatch.setattr(trace_mod, "MAX_EVENTS", full // 3)
    tr = simulated_trace(plan)
    assert len(_x_events(tr)) <= full // 3
    assert tr["otherData"]["events_per"] in ("module", "layer", "microbatch")
    compute_us = sum(e["dur"] for e in _x_events(tr, "compute"))
    assert compute_us == pytest.approx(plan.predicted["compute_s"] * 1e6, rel=1e-6)


# ---- command line and browser --------------------------------------------------------------------
@pytest.fixture(scope="module")
def written_report(plans, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("report")
    plans["dp4_tp4"].save(d / "plan.json")
    run = run_cli("report", "plan.json", "-o", "r.html", "--trace", "t.json", cwd=d)
    assert run.returncode == 0, run.stderr
    assert "r.html" in run.stdout
    return d


def test_cli_writes_report_and_trace(written_report):
    page = (written_report / "r.html").read_text()
    assert "<h2>Mesh and hardware</h2>" in page
    tr = json.loads((written_report / "t.json").read_text())
    assert _x_events(tr)


def test_cli_report_rejects_a_missing_plan(tmp_path):
    run = run_cli("report", "nope.json", "-o", "r.html", cwd=tmp_path)
    assert run.returncode == 2 and "nope.json" in run.stderr
    assert not (tmp_path / "r.html").exists()


@pytest.mark.slow
def test_page_renders_in_headless_chromium(written_report, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium) - cannot render the page headless")
    url = (written_report / "r.html").resolve().as_uri()
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "shot.png"
    run = subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1280,2400", url],
                         capture_output=True, text=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 20_000, run.stderr[-2000:]
    assert "Uncaught" not in run.stderr
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0 and "Uncaught" not in dom.stderr
    assert "<h2>Step time breakdown</h2>" in dom.stdout
    assert dom.stdout.count("<svg") >= len(CHART_LABELS) + 2
