"""Planning time end to end: ``autopar plan`` from the command line, one fresh process per row.

Each row runs ``autopar plan MODEL --cluster ... --json`` as a user would (interpreter start, imports,
model build, capture, search, plan JSON on stdout) and measures the process's wall seconds and peak RSS
(``os.wait4``'s rusage of that child), then reads from the plan: the solver's status, gap, ILP variables,
meshes tried and pruned, ``solver.phases_s`` and ``solver.limit_hit`` where the planner reports them,
the degrees, microbatches, checkpointing and predicted step time. Rows are the targets of issue 15
("planner at scale"): each must finish within its time target and 2 GB of peak RSS. The targets are
checked here, in the table's ``meets`` column, not in the tests. A row that fails or runs past
``--timeout`` is recorded (``timeout``, or ``error:``/``no fit:`` and stderr's last line), never fatal.

Prints a Markdown table and writes the rows as JSON to ``results/plan_time.json`` (``--quick``,
``--grid``, ``--cp-ep``: ``plan_time_quick.json``, ``plan_time_grid.json``, ``plan_time_cp_ep.json``; or
``--out``) after every row, so an interrupted run keeps what it measured. Children run in a temporary directory, which holds the
re-solve row's saved problem and keeps a checkout in the current directory from shadowing the
``autopar`` being timed. ``--grid`` plans llama3-8b's dimensions at 8, 32, 80 and 126 layers
(``--set layers=N``) on 8, 64, 1,024 and 16,384 H100s (global batch 64, 64, 1,024, 16,384; sequence
4096). Usage::

    python benchmarks/plan_time.py                      # the issue's rows (up to an hour on 2 cores)
    python benchmarks/plan_time.py --quick              # tiny models, every kind of row (a minute)
    python benchmarks/plan_time.py --grid               # layers x GPUs sweep (llama3-8b dims, --set layers=N)
    python benchmarks/plan_time.py --cp-ep              # issue 16's MoE and 128k-token rows
    python benchmarks/plan_time.py --label before --python /tmp/basevenv/bin/python \\
        --out benchmarks/results/plan_time_before.json  # time another checkout, installed in that venv
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEMORY_TARGET_MB = 2048.0
PROBLEM = "problem.json"  # the re-solve rows' saved problem, in the children's working directory
SAVE = ("--save-problem", PROBLEM)
RESOLVE = ("--problem", PROBLEM)


@dataclass(frozen=True)
class Row:
    """One ``autopar plan`` command and its wall-time target (None: no target, e.g. a re-solve's setup)."""

    args: tuple[str, ...]  # after ``autopar plan``, without --json (always added)
    target_s: float | None = None


def _model(name: str, cluster: str, batch: int, seq: int | None, *extra: str) -> tuple[str, ...]:
    return (name, "--cluster", cluster, "--global-batch", str(batch), *(("--seq", str(seq)) if seq else ()), *extra)


LLAMA8 = _model("llama3-8b", "8x8xH100", 64, 4096)
MAIN = [
    Row(LLAMA8, 10),
    Row(_model("llama3-70b", "128x8xH100", 1024, 4096), 10),
    Row(_model("llama3-405b", "2048x8xH100", 2048, 8192), 30),
    Row((*LLAMA8, "--fix", "dp=8,tp=8"), 5),
    Row(_model("llama3-70b", "16x8xH100", 512, 4096, "--fix", "pp=4,dp=4,tp=8"), 5),
    Row(_model("llama3-405b", "2048x8xH100", 2048, 8192, "--fix", "pp=16,dp=128,tp=8"), 5),
    Row((*LLAMA8, *SAVE)),
    Row((*RESOLVE, "--cluster", "8x8xH100"), 5),
]
TINY = _model("tiny-llama", "1x8xH100", 64, None)
QUICK = [
    Row(TINY),
    Row((*TINY, "--fix", "dp=8")),
    Row(_model("tiny-gpt", "1x4xcpu", 8, None, *SAVE)),
    Row((*RESOLVE, "--cluster", "1x2xcpu")),
]
# Issue 16's searches with two more mesh dims, held to the targets of the rows of their size above: an
# 8-expert MoE on 64 GPUs (expert parallelism) and a 405B model at 128k tokens on 16,384 (context).
CP_EP = [
    Row(_model("mixtral-8x7b", "8x8xH100", 256, 4096), 10),
    Row(_model("mixtral-8x7b", "8x8xH100", 256, 4096, "--fix", "pp=4,dp=8,ep=4,tp=2"), 5),
    Row(_model("llama3-405b", "2048x8xH100", 128, None, "--set", "seq=131072"), 30),
]
GRID_LAYERS = (8, 32, 80, 126)
GRID_CLUSTERS = {"1x8xH100": 64, "8x8xH100": 64, "128x8xH100": 1024, "2048x8xH100": 16384}  # global batch
GRID = [Row(_model("llama3-8b", cluster, batch, 4096, "--set", f"layers={layers}"))
        for layers in GRID_LAYERS for cluster, batch in GRID_CLUSTERS.items()]


@dataclass(frozen=True)
class Run:
    """What one child process did."""

    wall_s: float
    peak_rss_mb: float
    returncode: int
    timed_out: bool
    stdout: str
    stderr: str


def run_timed(cmd: list[str], timeout_s: float, cwd: Path) -> Run:
    """Run ``cmd`` in its own process group, killed after ``timeout_s``; its own rusage from ``os.wait4``."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=cwd, start_new_session=True)
        expired = threading.Event()

        def kill() -> None:
            expired.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            kill()
            raise
        finally:
            timer.cancel()
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        out.seek(0)
        err.seek(0)
        return Run(wall, usage.ru_maxrss / 1024, proc.returncode, expired.is_set() and os.WIFSIGNALED(status),
                   out.read().decode(errors="replace"), err.read().decode(errors="replace"))


def plan_fields(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan's facts the table reports (absent solver keys, e.g. of older planners, become None)."""
    solver, degrees = plan["solver"], plan["degrees"]
    return {
        "status": solver.get("status"), "gap": solver.get("gap"), "variables": solver.get("variables"),
        "meshes_tried": solver.get("meshes_tried"), "meshes_pruned": len(solver.get("pruned_meshes") or ()),
        "phases_s": solver.get("phases_s"), "limit_hit": solver.get("limit_hit"),
        "degrees": {key: degrees.get(key, 1) for key in ("pp", "dp", "tp", "fsdp")},
        "microbatches": plan["pipeline"]["microbatches"], "checkpointing": plan.get("checkpointing"),
        "step_time_s": plan["predicted"]["step_time_s"],
    }


def measure(row: Row, prefix: list[str], timeout_s: float, cwd: Path, label: str) -> dict[str, Any]:
    """Run one row and return its JSON record."""
    args = ["plan", *row.args, "--json"]
    record: dict[str, Any] = {
        "label": label, "command": "autopar " + shlex.join(args), "autopar_cmd": shlex.join(prefix),
        "target_s": row.target_s, "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_avg_1m": os.getloadavg()[0],
    }
    run = run_timed([*prefix, *args], timeout_s, cwd)
    record.update(wall_s=run.wall_s, peak_rss_mb=run.peak_rss_mb, returncode=run.returncode)
    last_err = next((line for line in reversed(run.stderr.splitlines()) if line.strip()), "(no stderr)")
    if run.timed_out:
        record.update(status="timeout", timeout_s=timeout_s)
    elif run.returncode != 0:
        record["status"] = f"{'no fit' if run.returncode == 3 else 'error'}: {last_err}"
    else:
        try:
            record.update(plan_fields(json.loads(run.stdout)))
        except (ValueError, KeyError, TypeError) as exc:
            record["status"] = f"error: stdout is not a plan ({type(exc).__name__}: {exc})"
    record["meets_target"] = None if row.target_s is None else (
        "degrees" in record and run.wall_s <= row.target_s and run.peak_rss_mb <= MEMORY_TARGET_MB)
    return record


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_line(r: dict[str, Any]) -> str:
    """One Markdown row: command, target, wall, RSS, phases, vars, gap, limit hit, status, plan, step, meets."""
    wall = f">{r['timeout_s']:.0f}" if r["status"] == "timeout" else f"{r['wall_s']:.1f}"
    phases = r.get("phases_s")
    phase_text = " ".join(f"{k} {v:.1f}" for k, v in phases.items()) if phases else "-"
    plan, step = "-", "-"
    if "degrees" in r:
        d = r["degrees"]
        fsdp = f" fsdp{d['fsdp']}" if d["fsdp"] > 1 else ""
        plan = f"{d['pp']}x{d['dp']}x{d['tp']}{fsdp}, {r['microbatches']} mb, {r['checkpointing']}"
        ms = r["step_time_s"] * 1e3
        step = f"{ms:,.0f}" if ms >= 10 else f"{ms:.3g}"
    limit = {None: "-", True: "yes", False: "no"}[r.get("limit_hit")]
    meets = {None: "-", True: "yes", False: "no"}[r["meets_target"]]
    cells = [f"`{r['command']}`", _num(r["target_s"], ".0f"), wall, f"{r['peak_rss_mb']:.0f}", phase_text,
             _num(r.get("variables"), ",d"), _num(r.get("gap"), ".2g"), limit, str(r["status"]), plan, step, meets]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| command | target s | wall s | peak RSS MB | phases s | ILP vars | gap | limit hit | status | "
          "plan (pp x dp x tp, microbatches, checkpointing) | step ms | meets |\n" + "|---" * 12 + "|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--quick", action="store_true", help="tiny models only (a minute)")
    rows.add_argument("--cp-ep", action="store_true", help="issue 16's rows: an MoE on 64 GPUs, 405B at 128k tokens")
    rows.add_argument("--grid", action="store_true", help=f"llama3-8b's dims at {GRID_LAYERS} layers on each of "
                      f"{GRID_CLUSTERS} (cluster: global batch), sequence 4096")
    cmd = parser.add_mutually_exclusive_group()
    cmd.add_argument("--python", help="run PYTHON -m autopar (e.g. a venv holding another checkout)")
    cmd.add_argument("--autopar-cmd", help="the command that stands for `autopar` (default: autopar on PATH)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per row before it is killed (600)")
    parser.add_argument("--label", default="", help="stored in every row, e.g. before or after")
    parser.add_argument("--out", help="the JSON rows (default results/plan_time.json, _quick, _grid or _cp_ep.json)")
    args = parser.parse_args()
    prefix = [args.python, "-m", "autopar"] if args.python else shlex.split(args.autopar_cmd or "autopar")
    suffix = "_quick" if args.quick else "_grid" if args.grid else "_cp_ep" if args.cp_ep else ""
    out = Path(args.out or Path(__file__).parent / "results" / f"plan_time{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    print(f"autopar = {shlex.join(prefix)}, {os.cpu_count()} CPUs, timeout {args.timeout:.0f} s, "
          f"memory target {MEMORY_TARGET_MB:.0f} MB\n\n{HEADER}", flush=True)
    with tempfile.TemporaryDirectory(prefix="plan_time_") as cwd:
        for row in QUICK if args.quick else GRID if args.grid else CP_EP if args.cp_ep else MAIN:
            records.append(measure(row, prefix, args.timeout, Path(cwd), args.label))
            print(table_line(records[-1]), flush=True)
            out.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
