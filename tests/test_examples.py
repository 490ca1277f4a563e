"""examples/train.py under torchrun on 2 gloo ranks trains like one process (docs/architecture.md "Correctness")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.testing.launch import free_port
from autopar.testing.parity import LR, train_single

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
STEPS = 3
GLOBAL_BATCH = 8

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result


def torchrun_train(cwd: Path, *extra: str) -> tuple[dict, str]:
    out = cwd / "losses.json"
    result = run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                  str(TRAIN), "--model", "tiny-gpt", "--global-batch", str(GLOBAL_BATCH), "--steps", str(STEPS),
                  "--lr", repr(LR), "--seed", "0", "--losses-out", str(out), *extra], cwd)
    return json.loads(out.read_text()), result.stdout


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return train_single("tiny-gpt", None, GLOBAL_BATCH, None, STEPS, seed=0).losses


def test_train_example_matches_single_process(tmp_path, reference):
    result, stdout = torchrun_train(tmp_path)
    assert result["world"] == 2
    assert len(result["losses"]) == STEPS
    assert result["losses"] == pytest.approx(reference, rel=1e-4)
    # rank 0 (only) prints the plan and one line per step
    assert stdout.count("predicted step") == 1
    assert stdout.count(f"step {STEPS - 1}  loss") == 1


def test_train_example_applies_a_saved_plan(tmp_path, reference):
    # pin tp=2 (not necessarily what the free search picks): the degrees the run reports prove --plan ran
    plan = run(["-m", "autopar", "plan", "tiny-gpt", "--cluster", "1x2xcpu", "--global-batch", str(GLOBAL_BATCH),
                "--fix", "tp=2", "-o", "plan.json"], tmp_path)
    assert (tmp_path / "plan.json").exists(), plan.stdout
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["degrees"]["tp"] == 2
    result, _ = torchrun_train(tmp_path, "--plan", "plan.json")
    assert result["degrees"] == saved["degrees"]
    assert result["losses"] == pytest.approx(reference, rel=1e-4)
