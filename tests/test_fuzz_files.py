"""Fuzzing the files autopar reads: mutated plan, problem and cluster files, fed to the CLI in process.

Each input is a real file (a plan and a problem saved from a small MLP, a cluster profile in
``cost_models/cluster.py``'s format) mutated by hypothesis: keys deleted, values replaced by other
types, negative, huge or NaN numbers, strings or nested garbage, the text truncated or spliced with
random bytes. Every command that reads the file must either accept it (exit 0, and what it wrote is
valid: a plan it wrote loads back and round-trips) or refuse it with exit 2 and one
``autopar CMD: error:`` line. Any exception out of ``main`` fails the test, showing the input.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, strategies as st

from autopar.cli import main
from autopar.core.plan import Plan
from conftest import examples

CLUSTER = "1x2xcpu"
CLUSTER_PROFILE = {"nodes": 1, "devices_per_node": 2, "device": {"base": "cpu", "hbm_bytes": 8 * 2**30},
                   "ib": "10Gbps", "nvlink": "5GBps", "mem": "8GiB", "source": "hand-written for the fuzz test",
                   "measured": {"matmul_flops": [1e11]}}


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    """A plan and a problem of a 2-layer MLP on 1x2xcpu, and a cluster profile, saved once per module."""
    root = tmp_path_factory.mktemp("originals")
    files = {"plan": root / "plan.json", "problem": root / "problem.json", "cluster": root / "cluster.json"}
    code, _, err = run_cli(["plan", "mlp", "--set", "layers=2,hidden=32", "--cluster", CLUSTER,
                            "-o", str(files["plan"]), "--save-problem", str(files["problem"])])
    assert code == 0, err
    files["cluster"].write_text(json.dumps(CLUSTER_PROFILE))
    return files


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` in this process: (exit code, stdout, stderr). An exception propagates: a failure."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


# ---- mutations -------------------------------------------------------------------------------------

NASTY_NUMBERS = st.sampled_from([0, -1, -(2**31), 2**63, 10**400, 1e308, -1e-300, math.nan, math.inf, -math.inf,
                                 0.5, True, False])
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | NASTY_NUMBERS)
GARBAGE = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) to a value inside ``doc``, the root's ``()`` first."""
    found = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            found += paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found += paths(value, (*prefix, i))
    return found


def replaced(doc: Any, path: tuple, value: Any) -> Any:
    """``doc`` with the value at ``path`` replaced by ``value`` (deleted when ``value`` is ``DELETE``)."""
    if not path:
        return None if value is DELETE else value
    head, rest = path[0], path[1:]
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    if rest or value is not DELETE:
        copy[head] = replaced(doc[head], rest, value)
    else:
        del copy[head]
    return copy


DELETE = object()


@dataclass(frozen=True)
class Mutation:
    """A mutated file: what was done (what a failure shows) and the bytes."""

    how: str
    data: bytes = field(repr=False)


@st.composite
def mutated_doc(draw: st.DrawFn, doc: Any) -> Mutation:
    """``doc`` after one to three mutations, each at a drawn path: a deletion or a replacement."""
    done = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths(doc)))
        value = draw(st.just(DELETE) | SCALARS | GARBAGE | st.builds(lambda v: [v], SCALARS))
        doc = replaced(doc, path, value)
        done.append(f"{list(path)} " + ("deleted" if value is DELETE else f"= {value!r}"))
    return Mutation("; ".join(done), json.dumps(doc).encode())


@st.composite
def mutated_bytes(draw: st.DrawFn, original: bytes) -> Mutation:
    """The file's text as JSON after mutations of its values, or its bytes truncated or spliced."""
    kind = draw(st.sampled_from(["values", "truncated", "spliced", "random"]))
    if kind == "values":
        return draw(mutated_doc(json.loads(original)))
    if kind == "random":
        data = draw(st.binary(max_size=64))
        return Mutation(f"random bytes {data!r}", data)
    at = draw(st.integers(0, len(original)))
    if kind == "truncated":
        return Mutation(f"truncated to {at} bytes", original[:at])
    spliced, cut = draw(st.binary(min_size=1, max_size=8)), draw(st.integers(0, 8))
    return Mutation(f"{cut} bytes at {at} replaced by {spliced!r}", original[:at] + spliced + original[at + cut:])


# ---- the checks -----------------------------------------------------------------------------------

def check_answer(argv: list[str]) -> int:
    """Run the CLI: exit 0, or exit 2 with one error line naming the command, or exit 3 (a valid cluster
    whose devices are too small: no plan fits) with one such line; return the exit code."""
    code, _, err = run_cli(argv)
    assert code in (0, 2, 3), f"exit {code} for {argv}: {err}"
    if code == 3:
        assert "no plan fits" in err and "Traceback" not in err, err
    if code == 2:
        lines = [line for line in err.splitlines() if line.startswith("autopar ")]
        assert len(lines) == 1 and lines[0].startswith(f"autopar {argv[0]}: error: "), err
        assert "Traceback" not in err, err
    return code


def check_plan_file(path: Path) -> None:
    """A plan a command wrote loads back and round-trips through its JSON unchanged."""
    plan = Plan.load(path)
    assert Plan.from_dict(json.loads(plan.to_json())).to_dict() == plan.to_dict()


def plan_commands(plan: Path, originals: dict[str, Path], out: Path) -> list[list[str]]:
    """Every command that reads a plan file, each on ``plan``."""
    param = next(iter(json.loads(originals["plan"].read_text())["placements"]))
    return [["show", str(plan)], ["explain", str(plan), param], ["compare", str(plan), str(originals["plan"])],
            ["report", str(plan), "-o", str(out / "report.html"), "--trace", str(out / "trace.json")],
            ["export", str(plan), "-o", str(out / "export.py")],
            ["reprice", str(plan), "--problem", str(originals["problem"]), "--cluster", CLUSTER,
             "-o", str(out / "repriced.json")]]


def fuzz_plan(originals: dict[str, Path], tmp_path: Path, data: bytes) -> None:
    plan = tmp_path / "plan.json"
    plan.write_bytes(data)
    for argv in plan_commands(plan, originals, tmp_path):
        if check_answer(argv) == 0 and argv[0] == "reprice":
            check_plan_file(tmp_path / "repriced.json")


def fuzz_problem(originals: dict[str, Path], tmp_path: Path, data: bytes) -> None:
    problem, out = tmp_path / "problem.json", tmp_path / "out.json"
    problem.write_bytes(data)
    if check_answer(["plan", "--problem", str(problem), "--cluster", CLUSTER, "-o", str(out)]) == 0:
        check_plan_file(out)
    if check_answer(["reprice", str(originals["plan"]), "--problem", str(problem), "--cluster", CLUSTER,
                     "-o", str(out)]) == 0:
        check_plan_file(out)


def fuzz_cluster(originals: dict[str, Path], tmp_path: Path, data: bytes) -> None:
    cluster, out = tmp_path / "cluster.json", tmp_path / "out.json"
    cluster.write_bytes(data)
    if check_answer(["plan", "--problem", str(originals["problem"]), "--cluster", str(cluster),
                     "-o", str(out)]) == 0:
        check_plan_file(out)


FUZZERS = {"plan": fuzz_plan, "problem": fuzz_problem, "cluster": fuzz_cluster}


def fuzz(kind: str, originals: dict[str, Path], tmp_path_factory, data: st.DataObject) -> None:
    """One drawn mutation of the ``kind`` file, through every command that reads it."""
    mutation = data.draw(mutated_bytes(originals[kind].read_bytes()), label=f"mutated {kind} file")
    FUZZERS[kind](originals, tmp_path_factory.mktemp("fuzz"), mutation.data)


@pytest.mark.parametrize("kind", list(FUZZERS))
@examples(2.5)
@given(data=st.data())
def test_mutated_files_are_accepted_or_refused_in_one_line(kind, originals, tmp_path_factory, data):
    fuzz(kind, originals, tmp_path_factory, data)


@pytest.mark.heavy
@pytest.mark.parametrize("kind", list(FUZZERS))
@examples(2.5, "heavy")
@given(data=st.data())
def test_mutated_files_heavy(kind, originals, tmp_path_factory, data):
    fuzz(kind, originals, tmp_path_factory, data)


def test_the_unmutated_files_are_accepted(originals, tmp_path):
    """The fuzzing starts from files every command accepts, so a refusal is the mutation's doing."""
    for kind, fuzzer in FUZZERS.items():
        fuzzer(originals, tmp_path, originals[kind].read_bytes())
    for argv in plan_commands(originals["plan"], originals, tmp_path):
        assert run_cli(argv)[0] == 0, argv
