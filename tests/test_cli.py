"""The ``autopar`` command line as a user runs it: stdout/stderr and exit codes (docs/architecture.md "Command
line"). Most commands run in this process (``cli_runner.run_cli``: ``autopar.cli.main``, what ``python -m
autopar`` runs); the free plan, the demo and the 70B plan run as real subprocesses, which also
checks the entry point and that nothing below Python's stdout reaches it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import run_cli
from contracts import COMM_KEYS, MEMORY_KEYS, PLAN_KEYS, SECTION_KEYS as SUBKEYS


def autopar_process(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m autopar ARGS`` as its own process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def check_plan_json(plan: dict) -> None:
    assert PLAN_KEYS <= set(plan), PLAN_KEYS - set(plan)
    assert plan["schema"] == "autopar.plan/1"
    for section, keys in SUBKEYS.items():
        assert keys <= set(plan[section]), (section, keys - set(plan[section]))
    assert COMM_KEYS <= set(plan["predicted"]["comm_s"])
    assert MEMORY_KEYS <= set(plan["predicted"]["memory_bytes"])
    assert len(plan["mesh"]["shape"]) == len(plan["mesh"]["dim_names"])
    devices = 1
    for s in plan["mesh"]["shape"]:
        devices *= s
    assert devices * plan["degrees"]["pp"] == plan["cluster"]["devices"]
    assert plan["predicted"]["step_time_s"] > 0


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Three tiny-gpt plans on 1x4xcpu (each run is a capture + solve, so they are shared)."""
    d = tmp_path_factory.mktemp("plans")
    free = autopar_process("plan", "tiny-gpt", "--cluster", "1x4xcpu", "--json", "-o", "free.json", cwd=d)
    dp4 = run_cli("plan", "tiny-gpt", "--cluster", "1x4xcpu", "--fix", "dp=4", "-o", "dp4.json", cwd=d)
    tp4 = run_cli("plan", "tiny-gpt", "--cluster", "1x4xcpu", "--fix", "tp=4", "-o", "tp4.json", cwd=d)
    for run in (free, dp4, tp4):
        assert run.returncode == 0, run.stderr
    return {"dir": d, "free": free, "dp4": dp4, "tp4": tp4}


def test_plan_prints_a_table(plans):
    out = plans["dp4"].stdout
    assert "mesh" in out and "predicted step" in out
    assert "dp=4" in out and "tiny-gpt" in out and "1x4xcpu" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


def test_plan_json_is_the_only_stdout(plans):
    plan = json.loads(plans["free"].stdout)  # raises if anything but the JSON is on stdout
    check_plan_json(plan)
    assert plan["model"]["name"] == "tiny-gpt"
    assert plan["cluster"]["spec"] == "1x4xcpu" and plan["cluster"]["devices"] == 4
    assert plan["predicted"]["peak_memory_bytes"] <= plan["predicted"]["memory_capacity_bytes"]
    # -o writes the same plan as --json prints
    assert json.loads((plans["dir"] / "free.json").read_text()) == plan


def test_fixed_degrees_are_honoured(plans):
    dp4 = json.loads((plans["dir"] / "dp4.json").read_text())
    tp4 = json.loads((plans["dir"] / "tp4.json").read_text())
    check_plan_json(dp4)
    check_plan_json(tp4)
    assert (dp4["degrees"]["dp"], dp4["degrees"]["tp"]) == (4, 1)
    assert (tp4["degrees"]["tp"], tp4["degrees"]["dp"]) == (4, 1)


def test_show_reads_a_saved_plan(plans):
    run = run_cli("show", "dp4.json", cwd=plans["dir"])
    assert run.returncode == 0, run.stderr
    assert "mesh" in run.stdout and "predicted step" in run.stdout and "dp=4" in run.stdout
    assert "tok_emb.weight" in run.stdout


def test_an_fsdp_plan_holds_and_shows_its_gathered_unit(plans):
    """An FSDP plan's memory has a ``gathered`` part (the largest unit of sharded parameters, held whole),
    counted in its peak and explained by ``show``; a DDP plan has none."""
    run = run_cli("plan", "tiny-gpt", "--cluster", "1x4xcpu", "--fix", "dp=4,fsdp=3", "-o", "fsdp.json",
                  cwd=plans["dir"])
    assert run.returncode == 0, run.stderr
    fsdp = json.loads((plans["dir"] / "fsdp.json").read_text())
    memory = fsdp["predicted"]["memory_bytes"]
    assert memory["gathered"] > 0 and fsdp["predicted"]["peak_memory_bytes"] == pytest.approx(sum(memory.values()), abs=8)
    assert "gathered" not in json.loads((plans["dir"] / "dp4.json").read_text())["predicted"]["memory_bytes"]
    shown = run_cli("show", "fsdp.json", cwd=plans["dir"]).stdout
    assert "gathered: the largest unit of the parameters sharded over data parallelism" in shown
    assert "gathered" not in run_cli("show", "dp4.json", cwd=plans["dir"]).stdout


def test_compare_names_differences_and_the_faster_plan(plans):
    run = run_cli("compare", "dp4.json", "tp4.json", cwd=plans["dir"])
    assert run.returncode == 0, run.stderr
    out = run.stdout
    dp4 = json.loads((plans["dir"] / "dp4.json").read_text())
    tp4 = json.loads((plans["dir"] / "tp4.json").read_text())
    differing = [fqn for fqn in dp4["placements"] if dp4["placements"][fqn] != tp4["placements"][fqn]]
    assert differing, "a dp=4 and a tp=4 plan should place some parameter differently"
    for fqn in differing:  # repeated layers may be folded into blocks.*.
        parts = fqn.split(".")
        folded = ".".join("*" if p.isdigit() else p for p in parts)
        assert fqn in out or folded in out, fqn
    faster = "[1]" if tp4["predicted"]["step_time_s"] < dp4["predicted"]["step_time_s"] else "[0]"
    slower = "[0]" if faster == "[1]" else "[1]"
    assert f"{faster} is faster than {slower}" in out


def test_compare_needs_two_plans(plans):
    run = run_cli("compare", "dp4.json", cwd=plans["dir"])
    assert run.returncode == 2
    assert_one_line_error(run, "two")


# ---- bad input: exit 2, one line on stderr naming the problem ---------------------------------------


def assert_one_line_error(run: subprocess.CompletedProcess, *mentions: str) -> None:
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "error" in lines[0]
    for m in mentions:
        assert m in lines[0], (m, lines[0])
    assert run.stdout == ""


@pytest.mark.parametrize("args, mentions", [
    (["plan", "no-such-model", "--cluster", "1x4xcpu"], ["no-such-model"]),
    (["plan", "tiny-gpt", "--cluster", "4x8"], ["4x8"]),
    (["plan", "tiny-gpt", "--cluster", "0x8xH100"], ["0x8xH100"]),
    (["plan", "tiny-gpt", "--cluster", "2x8xNOPE"], ["NOPE"]),
    (["plan", "tiny-gpt", "--cluster", "1x4xcpu", "--set", "layers"], ["layers"]),
    (["plan", "tiny-gpt", "--cluster", "1x4xcpu", "--set", "nope=3"], ["nope"]),
    (["plan", "tiny-gpt", "--cluster", "1x4xcpu", "--set", "layers=two"], ["layers"]),
    (["plan", "tiny-gpt", "--cluster", "1x4xcpu", "--global-batch", "6", "--fix", "dp=4"], ["6", "dp"]),
    (["plan", "tiny-gpt", "--cluster", "1x4xcpu", "--fix", "bogus=3"], ["bogus"]),
    (["plan", "tiny-gpt", "--cluster", "1x4xcpu", "--fix", "tp"], ["tp"]),
    (["plan", "tiny-gpt", "--cluster", "1x4xcpu", "--fix", "dp=2,dp=4"], ["'dp' given twice"]),
    (["plan", "llama3-70b", "--cluster", "16x8xH100", "--fix", "cp=abc"], ["cp must be a positive integer, got 'abc'"]),
    (["plan", "tiny-gpt", "--cluster", "1x4xcpu", "--global-batch", "0"], ["global-batch"]),
    (["show", "no-such-plan.json"], ["no-such-plan.json"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0] in ("plan", "show") else None)
def test_bad_input_exits_2_with_one_line(args, mentions, tmp_path):
    run = run_cli(*args, cwd=tmp_path)
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert_one_line_error(run, *mentions)


@pytest.mark.parametrize("model_args", [["llama3-70b", "--set", "layers=two"], ["no-such-model"]])
def test_fix_is_checked_before_the_model_is_built(model_args, tmp_path):
    """A bad --fix is the error reported even where building the model would fail: it was checked first
    (so it answers before any capture, however slow)."""
    run = run_cli("plan", *model_args, "--cluster", "16x8xH100", "--fix", "fsdp=5", cwd=tmp_path)
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert_one_line_error(run, "constraint fsdp must be a ZeRO stage", "got '5'")
    assert "layers" not in run.stderr and "no-such-model" not in run.stderr


def _valid_plan(plans) -> dict:
    return json.loads((plans["dir"] / "dp4.json").read_text())


def _without(key):
    def edit(d):
        del d[key]
        return d
    return edit


def _setting(path, value):
    def edit(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return d
    return edit


BAD_PLANS = {
    "not-json": (lambda d: "this is { not json", "not JSON"),
    "a-list": (lambda d: [1, 2], "JSON object"),
    "wrong-schema": (_setting(["schema"], "autopar.plan/99"), "schema"),
    "missing-placements": (_without("placements"), "placements"),
    "mesh-not-covering-devices": (_setting(["mesh", "shape"], [3]), "mesh"),
    "placement-wrong-length": (_setting(["placements", "lm_head.weight"], ["R", "R"]), "lm_head.weight"),
}
WRONG_TYPED_PLANS = {  # sections of the wrong JSON type: a format error, not a traceback
    "mesh-is-a-list": (_setting(["mesh"], [4]), "mesh"),
    "placements-is-a-list": (_setting(["placements"], []), "placements"),
    "predicted-missing-step-time": (lambda d: (d["predicted"].pop("step_time_s"), d)[1], "step_time_s"),
    "memory-stage-unknown": (_setting(["predicted", "memory_stage"], "middle"), "memory_stage"),
}


def _write_bad_plan(plans, tmp_path, edit) -> Path:
    content = edit(_valid_plan(plans))
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize("case", [*BAD_PLANS, *WRONG_TYPED_PLANS])
def test_show_rejects_a_malformed_plan(case, plans, tmp_path):
    edit, mention = {**BAD_PLANS, **WRONG_TYPED_PLANS}[case]
    path = _write_bad_plan(plans, tmp_path, edit)
    run = run_cli("show", str(path))
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert_one_line_error(run, mention, "bad.json")


def test_compare_rejects_a_malformed_plan(plans, tmp_path):
    path = _write_bad_plan(plans, tmp_path, lambda d: "{")
    run = run_cli("compare", "dp4.json", str(path), cwd=plans["dir"])
    assert run.returncode == 2
    assert_one_line_error(run, "bad.json")


# ---- warnings: one line, as errors are --------------------------------------------------------------


def test_a_warning_is_one_line_on_stderr(plans, monkeypatch):
    """A command's warnings read as its errors do (``autopar show: warning: ...``), without Python's file,
    line and source line; a category other than ``UserWarning`` is named."""
    import warnings

    import autopar.cli as cli

    shown = cli._cmd_show

    def warning_then_show(args):
        warnings.warn("autopar: something worth knowing")
        warnings.warn("an old way", FutureWarning)
        return shown(args)

    monkeypatch.setattr(cli, "_cmd_show", warning_then_show)
    run = run_cli("show", "dp4.json", cwd=plans["dir"])
    assert run.returncode == 0
    assert run.stderr == ("autopar show: warning: something worth knowing\n"
                          "autopar show: warning: FutureWarning: an old way\n")


# ---- the process's end ----------------------------------------------------------------------------


@pytest.mark.parametrize("args, code", [(["show", "free.json"], 0), (["show", "missing.json"], 2)])
def test_the_command_runs_exit_handlers_and_keeps_its_exit_code(plans, args, code):
    """``autopar`` ends its process without Python's teardown (``cli.end_process``): exit handlers registered
    before it still run, after all of its output, and the process exits with the command's code. (Its
    stdout is buffered, as a user's is, whatever this environment says: ``os._exit`` drops a buffer.)"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    script = ("import atexit, sys\n"
              "atexit.register(print, 'exit handler ran')\n"
              "from autopar.cli import console\n"
              "console()\n")
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=plans["dir"],
                         env=env, timeout=120)
    assert run.returncode == code, run.stderr
    assert run.stdout.endswith("exit handler ran\n")
    if code == 0:
        assert run.stdout.startswith(run_cli(*args, cwd=plans["dir"]).stdout)
    else:
        assert run.stdout == "exit handler ran\n"
        assert_one_line_error(subprocess.CompletedProcess(run.args, code, "", run.stderr), "missing.json")


def test_the_command_runs_commands_that_read_plans_uncollected_and_the_others_collected(plans, monkeypatch):
    """In the process ``console`` ends, the commands of ``cli.UNCOLLECTED`` (plan, show, ...) run with
    Python's cyclic garbage collector off; ``demo`` and ``calibrate`` keep it, and so does ``main`` called
    from Python (tests, a user's script) for every command."""
    import gc

    from autopar import cli

    seen: dict[str, bool] = {}
    monkeypatch.setattr(cli, "_cmd_show", lambda args: seen.__setitem__("show", gc.isenabled()) or 0)
    monkeypatch.setattr(cli, "_cmd_demo", lambda args: seen.__setitem__("demo", gc.isenabled()) or 0)
    assert gc.isenabled()
    try:
        assert cli.main(["show", "x.json"]) == 0 and seen["show"]
        assert cli.main(["demo"], ends_process=True) == 0 and seen["demo"]
        assert cli.main(["show", "x.json"], ends_process=True) == 0 and not seen["show"]
    finally:
        gc.enable()
    assert "demo" not in cli.UNCOLLECTED and "calibrate" not in cli.UNCOLLECTED


def test_a_reader_that_goes_away_ends_the_command_quietly(plans):
    """``autopar show plan.json | head``: where stdout's reader has gone the command ends with the code a
    process SIGPIPE ended reports (141), without a ``BrokenPipeError`` traceback (``cli._reader_gone``); a
    pipe of its own breaking is still a bug's traceback."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen([sys.executable, "-m", "autopar", "show", "free.json"], cwd=plans["dir"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader goes before the command writes
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (141, b"")
    # another pipe breaking, stdout still read, is a bug: its traceback is kept (exit 1)
    script = ("import autopar.cli as cli\n"
              "def broken(args):\n"
              "    raise BrokenPipeError(32, 'a worker pipe')\n"
              "cli._cmd_show = broken\n"
              "cli.console()\n")
    run = subprocess.run([sys.executable, "-c", script, "show", "free.json"], cwd=plans["dir"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "BrokenPipeError: [Errno 32] a worker pipe" in run.stderr


# ---- no plan fits: exit 3 with the reason ----------------------------------------------------------


def test_no_plan_fits_exits_3(tmp_path):
    # two llama3-8b layers still carry the 128k-vocab embeddings (~1 B params): no way into 1 GB on one device
    run = run_cli("plan", "llama3-8b", "--cluster", "1x1xcpu", "--set", "layers=2", "--global-batch", "1",
                  "--seq", "128", "--fix", "memory_gb=1", "-o", "never.json", cwd=tmp_path)
    assert run.returncode == 3, (run.returncode, run.stderr[-2000:])
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "fits" in lines[0] and "GiB" in lines[0], run.stderr
    assert run.stdout == ""
    assert not (tmp_path / "never.json").exists()


# ---- scale: a 70B model on 128 H100s, planned offline without allocating it --------------------------


@pytest.mark.slow
@pytest.mark.heavy
def test_llama3_70b_on_128_h100s_plans_offline(tmp_path):
    # run the CLI as its own child and wait4() it: ru_maxrss is then that process's peak alone
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen([sys.executable, "-m", "autopar", "plan", "llama3-70b", "--cluster", "16x8xH100",
                                 "--global-batch", "512", "--seq", "4096", "--json"],
                                stdout=fo, stderr=fe, env=dict(os.environ, OMP_NUM_THREADS="1"))
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, err.read_text()[-3000:]
    plan = json.loads(out.read_text())
    check_plan_json(plan)
    assert plan["model"]["params"] == pytest.approx(70.6e9, rel=0.01)
    assert plan["cluster"]["devices"] == 128
    assert plan["predicted"]["peak_memory_bytes"] <= plan["predicted"]["memory_capacity_bytes"]
    assert plan["predicted"]["memory_capacity_bytes"] <= 80 * 10**9
    assert 0 < plan["predicted"]["mfu"] < 1
    # the model lives on the meta device: 70.6e9 fp32 parameters alone would be 282 GB
    assert usage.ru_maxrss < 8 * 2**20, f"plan process peaked at {usage.ru_maxrss / 2**20:.1f} GiB RSS (KiB units)"


# ---- demo --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.dist
def test_demo_trains_on_two_gloo_ranks():
    run = autopar_process("demo", "--world", "2", "--steps", "2", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "single process" in out and "autopar x2" in out
    assert "max loss difference" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 2
    for _, single, parallel, _ in rows:
        assert float(parallel) == pytest.approx(float(single), rel=1e-4)
