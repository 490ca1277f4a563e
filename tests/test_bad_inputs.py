"""Every bad input a user could type gets one clear line and exit 2 (3: no plan fits), never a traceback.

``CASES`` is the table of commands tried (in a folder holding a small plan, its problem, and broken files);
each runs through ``autopar.cli.main`` in process, and a few through a real ``python -m autopar``. The
table with the message each gets is docs/bad_inputs.md, which this test keeps up to date
(``AUTOPAR_REGEN_DOCS=1`` rewrites it). The API's bad inputs (a loss without targets, a model or loss
that cannot take the arguments, ``step`` given the wrong tensors) follow. About 15 s in all, one gloo spawn.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from cli_runner import run_cli
import autopar
import autopar.api
from autopar.core.errors import BadInputError, UnsupportedModelError
from autopar.core.files import write_atomically
from autopar.testing.launch import run_on_ranks

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad_inputs.md"
REGENERATE = "regenerate with AUTOPAR_REGEN_DOCS=1 python -m pytest tests/test_bad_inputs.py"


class Case(NamedTuple):
    command: str  # what follows `autopar`, run in the folder of ``workdir``
    exit_code: int
    fragment: str  # a part of the message it must get
    in_capture: bool = False  # refused while the model is captured (what it does there), not before


CASES = [
    # files to read
    Case("show adir", 2, "is a directory, not a plan file"),
    Case("show nosuch.json", 2, "no such plan file"),
    Case("show notjson.txt", 2, "not JSON"),
    Case("show binary.json", 2, "not UTF-8 text"),
    Case("show oldplan.json", 2, "expected 'autopar.plan/1'"),
    Case("compare plan.json", 2, "at least two plan files"),
    Case("explain plan.json nosuch_op", 2, "not an op or parameter"),
    Case("plan --problem plan.json --cluster 1x2xcpu", 2, "expected 'autopar.problem/1'"),
    Case("plan --problem nosuch.json --cluster 1x2xcpu", 2, "no such problem file"),
    Case("reprice plan.json --problem adir --cluster 1x2xcpu", 2, "is a directory, not a problem file"),
    Case("plan mlp --cluster badcluster.json", 2, "bad cluster file"),
    Case("plan mlp --cluster binary.json", 2, "bad cluster file 'binary.json'"),
    # fields of files, each once a fuzzing find (tests/test_fuzz_files.py)
    Case("show nulldim.json", 2, "mesh.dim_names must be distinct names"),
    Case("export nullinput.json -o apply.py", 2, "ops['addmm'].inputs[0]: expected an array, got None"),
    Case("compare zerostep.json plan.json", 2, "predicted.step_time_s: expected a finite positive number, got 0"),
    Case("show nospec.json", 2, "cluster: missing spec"),
    Case("show nullpp.json", 2, "degrees is missing pp"),
    Case("show nosync.json", 2, "ops['mean'].collectives[0]: missing grad_sync"),
    Case("reprice numschedule.json --problem problem.json --cluster 1x2xcpu -o out.json", 2,
         "pipeline.schedule must be a string, got -5"),
    Case("plan --problem noreturn.json --cluster 1x2xcpu", 2, "the output node takes one argument"),
    Case("plan --problem onetraced.json --cluster 1x2xcpu", 2, "'stack' traces 1 of 1000 layers"),
    Case("plan --problem problem.json --cluster infhbm.json", 2, "hbm_bytes must be a positive int"),
    # files to write: refused before any work
    Case("plan mlp --cluster 1x2xcpu -o missing/plan.json", 2, "does not exist"),
    Case("plan mlp --cluster 1x2xcpu --save-problem missing/problem.json", 2, "does not exist"),
    Case("plan mlp --cluster 1x2xcpu -o adir", 2, "is a directory"),
    Case("report plan.json -o missing/report.html", 2, "does not exist"),
    Case("report plan.json -o report.html --trace missing/trace.json", 2, "does not exist"),
    Case("export plan.json -o missing/apply.py", 2, "does not exist"),
    Case("reprice plan.json --problem problem.json --cluster 1x2xcpu -o missing/plan.json", 2, "does not exist"),
    Case("calibrate -o missing/cluster.json", 2, "does not exist"),
    # models, clusters, options
    Case("plan nosuchmodel --cluster 1x2xcpu", 2, "unknown model 'nosuchmodel'"),
    Case("plan edge_models:hooked_forward --cluster 1x2xcpu", 2, "registers a gradient hook on a tensor at edge_models",
         in_capture=True),
    Case("plan edge_models:random_function --cluster 1x2xcpu", 2, "edge_models.NoisyScale.forward draws random numbers "
         "(rand_like)", in_capture=True),
    Case("plan --cluster 1x2xcpu", 2, "give a MODEL"),
    Case("plan mlp --problem problem.json --cluster 1x2xcpu", 2, "not both"),
    Case("plan mlp --cluster 0x8xH100", 2, "N and G must be positive"),
    Case("plan mlp --cluster 2x8xFOO", 2, "unknown device type 'FOO'"),
    Case("plan mlp --cluster 1000000000x8xH100", 2, "autopar plans clusters of up to"),
    Case("plan tiny-gpt --cluster 1x2xcpu --seq -5", 2, "seq must be >= 1"),
    Case("plan mlp --cluster 1x2xcpu --global-batch 0", 2, "--global-batch must be positive"),
    Case("plan mlp --cluster 1x2xcpu --set layers=abc", 2, "override layers='abc': expected int"),
    Case("plan mlp --cluster 1x2xcpu --set layers=0", 2, "layers must be >= 1"),
    Case("plan mlp --cluster 1x2xcpu --set foo=3", 2, "unknown override(s) foo"),
    Case("plan autopar.models.hf:llama --cluster 1x2xcpu --set depth=3", 2,
         "unknown override(s) depth for model factory 'autopar.models.hf:llama': it takes global_batch, seq, layers"),
    Case("plan mlp --cluster 1x2xcpu --fix foo=3", 2, "unknown constraint(s) foo"),
    Case("plan mlp --cluster 1x2xcpu --fix cp=abc", 2, "cp must be a positive integer"),
    Case("plan tiny-llama --cluster 1x2xcpu --fix cp=2,cp_attention=tree", 2,
         "cp_attention must be one of allgather, ring"),
    Case("plan tiny-llama --cluster 1x2xcpu --fix cp=1,cp_attention=ring", 2, "it needs cp > 1, got cp=1"),
    Case("plan mlp --cluster 1x2xcpu --fix pp=1,schedule=1f1b", 2, "shapes a pipeline: it needs pp > 1 or pp free"),
    Case("plan tiny-gpt --cluster 8x8xcpu --global-batch 16 --fix dp=1", 2,
         "no mesh of the 64 devices of 8x8xcpu has dp=1: the other degrees (pp x tp) must make up the rest",
         in_capture=True),
    Case("plan mlp --cluster 1x2xcpu --fix fp8=delayed", 2, "constraint fp8 must be one of tensorwise"),
    Case("plan tiny-llama --cluster 1x8xA100-80GB --fix fp8=tensorwise", 2,
         "fp8=tensorwise: device A100-80GB has no FP8 tensor cores", in_capture=True),
    Case("plan tiny-gpt --cluster 1x2xcpu --set hidden=24,heads=2 --fix fp8=tensorwise", 2,
         "this model has no linear layer float8 can run",
         in_capture=True),
    Case("reprice plan.json --problem problem.json --cluster 1x4xcpu", 2, "the plan runs on 2 devices"),
    Case("demo --world 0", 2, "--world and --steps must be positive"),
    # no plan fits
    Case("plan mlp --cluster 1x2xcpu --fix memory_gb=0.000001", 3, "KiB more than the 1000 B there is"),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder with a plan and problem of a 2-layer MLP on 1x2xcpu, and broken files beside them."""
    root = tmp_path_factory.mktemp("bad_inputs")
    code, err = run_main(["plan", "mlp", "--set", "layers=2,hidden=32", "--cluster", "1x2xcpu",
                          "-o", str(root / "plan.json"), "--save-problem", str(root / "problem.json")])
    assert code == 0, err
    (root / "adir").mkdir()
    (root / "notjson.txt").write_text("hello\n")
    (root / "binary.json").write_bytes(b"\xff\xfe\x00")
    (root / "badcluster.json").write_text('{"nodes": 1,')
    old = json.loads((root / "plan.json").read_text())
    (root / "oldplan.json").write_text(json.dumps({**old, "schema": "autopar.plan/0"}))
    write_mutated(root / "nulldim.json", old, ["mesh", "dim_names", 0], None)
    write_mutated(root / "nullinput.json", old, ["ops", "addmm", "inputs", 0], None)
    write_mutated(root / "zerostep.json", old, ["predicted", "step_time_s"], 0)
    write_mutated(root / "nospec.json", old, ["cluster", "spec"], DELETE)
    write_mutated(root / "nullpp.json", old, ["degrees", "pp"], None)
    write_mutated(root / "nosync.json", old, ["ops", "mean", "collectives", 0, "grad_sync"], DELETE)
    write_mutated(root / "numschedule.json", old, ["pipeline", "schedule"], -5)
    problem = json.loads((root / "problem.json").read_text())
    write_mutated(root / "noreturn.json", problem, ["nodes", -1, "args"], [])
    write_mutated(root / "onetraced.json", problem, ["stack"], {"path": "layers", "layers": 1000, "traced": 1})
    write_mutated(root / "infhbm.json", {"nodes": 1, "devices_per_node": 2, "device": {"base": "cpu"}},
                  ["device", "hbm_bytes"], float("inf"))
    return root


DELETE = object()


def write_mutated(path: Path, doc: Any, where: list, value: Any) -> None:
    """``doc`` as JSON with the value at ``where`` (keys and indices) replaced by ``value`` (or deleted)."""
    doc = json.loads(json.dumps(doc))
    *parents, last = where
    holder = doc
    for key in parents:
        holder = holder[key]
    if value is DELETE:
        del holder[last]
    else:
        holder[last] = value
    path.write_text(json.dumps(doc))


@pytest.fixture
def in_workdir(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(workdir)
    return workdir


def run_main(argv: list[str]) -> tuple[int, str]:
    """``autopar ARGV`` in process: (exit code, stderr)."""
    run = run_cli(*argv)
    return run.returncode, run.stderr


def refuse_capture(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the model was captured before the bad input was refused")


@pytest.mark.parametrize("case", CASES, ids=[c.command for c in CASES])
def test_bad_input_gets_one_line_and_its_exit_code(case: Case, in_workdir: Path, monkeypatch: pytest.MonkeyPatch):
    if case.exit_code == 2 and not case.in_capture:  # bad input is refused before the (slow) capture
        monkeypatch.setattr(autopar.api, "_captured_step", refuse_capture)
    before = set(in_workdir.iterdir())
    code, err = run_main(shlex.split(case.command))
    command = case.command.split()[0]
    assert (code, err.count("\n")) == (case.exit_code, 1), err
    assert err.startswith(f"autopar {command}: error: ") and "Traceback" not in err, err
    assert case.fragment in err, err
    assert set(in_workdir.iterdir()) == before  # nothing written, not even a temporary file


@pytest.mark.parametrize("command", ["show adir", "plan mlp --cluster 1x2xcpu -o missing/plan.json"])
def test_no_traceback_reaches_the_terminal(command: str, workdir: Path):
    run = subprocess.run([sys.executable, "-m", "autopar", *shlex.split(command)], capture_output=True, text=True,
                         cwd=workdir, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith(f"autopar {command.split()[0]}: error: ") and run.stderr.count("\n") == 1


def test_docs_table_is_the_tested_one(in_workdir: Path):
    """docs/bad_inputs.md lists every case and the message it gets now."""
    rows = []
    for case in CASES:
        code, err = run_main(shlex.split(case.command))
        message = err.strip().replace("|", "\\|")
        rows.append(f"| `autopar {case.command}` | {code} | {message} |")
    text = DOC_HEADER + "\n".join(rows) + "\n"
    if os.environ.get("AUTOPAR_REGEN_DOCS") == "1":
        DOC.write_text(text)
    assert DOC.exists() and DOC.read_text() == text, f"docs/bad_inputs.md is out of date: {REGENERATE}"


DOC_HEADER = """# Bad inputs and the answers they get

Generated by `tests/test_bad_inputs.py` (which fails when this table is out of date; regenerate with
`AUTOPAR_REGEN_DOCS=1 python -m pytest tests/test_bad_inputs.py`). Each command ran in a folder holding
`plan.json` and `problem.json` (a 2-layer MLP planned for `1x2xcpu`), a folder `adir`, and broken files:
`notjson.txt`, `binary.json` (not UTF-8), `badcluster.json` (cut short), `oldplan.json` (another schema),
and files with one bad field, found by the file fuzzer (`tests/test_fuzz_files.py`) or while fixing its
finds: plans with a null mesh dim name (`nulldim.json`), a null op input placement (`nullinput.json`), a
zero step time (`zerostep.json`), no cluster spec (`nospec.json`), a null pipeline degree (`nullpp.json`),
a collective that does not say whether it syncs gradients (`nosync.json`), a number for a pipeline
schedule (`numschedule.json`: reprice wrote it into a plan it could not read back); a problem whose output node
returns nothing (`noreturn.json`), one whose stack of layers traced one of 1000 (`onetraced.json`: it
priced negative step times); a cluster file whose device has infinite memory (`infhbm.json`). `missing/`
does not exist.

Exit codes: 2 for bad input, 3 when no plan fits; a bug in autopar keeps its traceback (exit 1). Output
paths are checked before any work, and files are written whole or not at all (`autopar/core/files.py`).

| command | exit | message (stderr) |
|---|---|---|
"""


# ---- files --------------------------------------------------------------------------------------

def test_a_plan_without_model_dtype_reprices_in_fp32(workdir: Path, tmp_path: Path):
    """A plan may leave out ``model.dtype`` (fp32); reprice read it as required (a fuzzing find)."""
    write_mutated(tmp_path / "nodtype.json", json.loads((workdir / "plan.json").read_text()), ["model", "dtype"],
                  DELETE)
    code, err = run_main(["reprice", str(tmp_path / "nodtype.json"), "--problem", str(workdir / "problem.json"),
                          "--cluster", "1x2xcpu", "-o", str(tmp_path / "repriced.json")])
    assert code == 0, err
    assert autopar.Plan.load(tmp_path / "repriced.json").model["dtype"] == "fp32"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path):
    target = tmp_path / "plan.json"
    write_atomically(target, "old\n")
    with pytest.raises(UnicodeEncodeError):
        write_atomically(target, "new \ud800")  # a lone surrogate cannot be encoded: the write fails midway
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["plan.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # the usual mode, not mkstemp's 0600


# ---- the API ------------------------------------------------------------------------------------

class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_loss_without_targets_takes_the_output_alone():
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with_targets = autopar.plan(TwoLayers(), (x,), "1x2xcpu", nn.functional.mse_loss, example_targets=y)
    without = autopar.plan(TwoLayers(), (x,), "1x2xcpu", lambda out: out.pow(2).mean())
    assert list(with_targets.inputs) == ["args_0", "args_1"] and list(without.inputs) == ["args_0"]
    with pytest.raises(BadInputError, match=r"cannot be called as loss_fn\(output\), as no example_targets"):
        autopar.plan(TwoLayers(), (x,), "1x2xcpu", nn.functional.mse_loss)
    with pytest.raises(BadInputError, match="TwoLayers.forward cannot take 2 example input"):
        autopar.plan(TwoLayers(), (x, x), "1x2xcpu", nn.functional.mse_loss, example_targets=y)


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.layer(x["x"] if isinstance(x, dict) else x)
        return y, y.pow(2).mean()


def test_inputs_that_are_not_tensors_and_a_tuple_without_a_loss_first_are_named() -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with pytest.raises(BadInputError, match="example input 0 is a dict, not a tensor: autopar plans and runs models "
                                            "whose forward takes positional tensors"):
        autopar.plan(_Pair(), ({"x": x},), "1x2xcpu", lambda out, t: nn.functional.mse_loss(out[0], t),
                     example_targets=y)
    with pytest.raises(UnsupportedModelError, match=r"must return a scalar loss, got the first of the 2 values it "
                                                    r"returns, \(8, 16\): pass loss_fn"):
        autopar.plan(_Pair(), (x,), "1x2xcpu")
    first_is_the_loss = autopar.plan(_Pair(), (x,), "1x2xcpu", lambda out: out[::-1])  # (loss, output): trained
    assert first_is_the_loss.predicted["step_time_s"] > 0


def _step_refusals(rank: int, world: int) -> dict[str, str]:
    """What ``step`` says, on one of two dp ranks, to each wrong call; "ok" where it trains."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pm = autopar.autoparallelize(TwoLayers(), (x,), nn.functional.mse_loss, cluster="1x2xcpu",
                                 constraints={"dp": 2}, example_targets=y)
    calls = {"global": ((x, y), False), "local": ((x.chunk(2)[rank], y.chunk(2)[rank]), True),
             "rows": ((x[:6], y[:6]), False), "dtype": ((x.double(), y), False), "count": ((x,), False),
             "whole batch as local": ((x, y), True)}
    said = {}
    for name, (args, local) in calls.items():
        try:
            pm.step(*args, local=local)
            said[name] = "ok"
        except BadInputError as exc:
            said[name] = str(exc)
    return said


@pytest.mark.slow
@pytest.mark.dist
def test_step_refuses_tensors_the_plan_was_not_made_for():
    said = run_on_ranks(_step_refusals, 2)[1]
    assert said["global"] == said["local"] == "ok"
    assert "step() argument 1 (args_0) has shape [6, 16], expected [8, 16]: the global shape" in said["rows"]
    assert "has dtype float64, the plan was made for float32" in said["dtype"]
    assert "step() takes 2 tensors" in said["count"]
    assert ("has shape [8, 16], expected [4, 16]: this rank's slice with local=True (of the global shape "
            "[8, 16])") in said["whole batch as local"]


def test_an_error_in_autopars_own_code_while_tracing_keeps_its_traceback():
    """Only the model's (and loss's) own errors become UnsupportedModelError; one raised in autopar's code is a bug."""
    from autopar.core.units import fmt_bytes  # autopar code that cannot take a traced tensor (``if b >= scale``)

    with pytest.raises(Exception) as info:
        autopar.plan(TwoLayers(), (torch.randn(8, 16),), "1x2xcpu", fmt_bytes)
    assert not isinstance(info.value, autopar.AutoparError), info.value
    with pytest.raises(autopar.UnsupportedModelError, match=r"raised at .*test_bad_inputs.py:\d+ in <lambda>"):
        autopar.plan(TwoLayers(), (torch.randn(8, 16),), "1x2xcpu", lambda out: out.view(3, 7).sum())
