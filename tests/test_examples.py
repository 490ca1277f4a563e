"""examples/train.py under torchrun on 2 gloo ranks trains like one process (docs/architecture.md "Correctness").

The script is a user's training loop, with AdamW: the reference is single-process AdamW at the same
``--lr``, and only the losses it reports are compared (gradients are compared by the parity tests of
the same runtime, ``tests/test_parity.py``)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.testing.launch import free_port
from autopar.testing.parity import build, train_single

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
STEPS = 3
GLOBAL_BATCH = 8
LR = 1e-4
"""The script's AdamW learning rate (``--lr``): small, because Adam moves each element by about ``lr``
whatever its gradient's size, rounding differences in near-zero gradients included."""

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result


def torchrun_train(cwd: Path, *extra: str, ranks: int = 2, steps: int = STEPS) -> tuple[dict, str]:
    out = cwd / "losses.json"
    result = run(["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(free_port()),
                  str(TRAIN), "--model", "tiny-gpt", "--global-batch", str(GLOBAL_BATCH), "--steps", str(steps),
                  "--lr", repr(LR), "--seed", "0", "--losses-out", str(out), *extra], cwd)
    return json.loads(out.read_text()), result.stdout


@pytest.fixture(scope="module")
def reference() -> list[float]:
    adamw = functools.partial(torch.optim.AdamW, lr=LR)  # what examples/train.py trains with
    return train_single("tiny-gpt", None, GLOBAL_BATCH, None, STEPS, seed=0, optimizer=adamw).losses


def test_train_example_matches_single_process(tmp_path, reference):
    result, stdout = torchrun_train(tmp_path)
    assert result["world"] == 2
    assert len(result["losses"]) == STEPS
    assert result["losses"] == pytest.approx(reference, rel=1e-4)
    # rank 0 (only) prints the plan and one line per step
    assert stdout.count("predicted step") == 1
    assert stdout.count(f"step {STEPS - 1}  loss") == 1


@pytest.mark.extended
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


@pytest.mark.extended
def test_train_example_resumes_from_a_checkpoint_on_another_world_size(tmp_path, reference):
    # 4 ranks train 2 steps and checkpoint; a job of 2 ranks (a lost node, under torchrun elastic) re-plans
    # for its world, loads the checkpoint resharded and trains the last step: the losses go on unbroken
    saved, _ = torchrun_train(tmp_path, "--checkpoint-dir", "ckpt", "--save-every", "2", ranks=4, steps=2)
    assert (tmp_path / "ckpt" / "step-00000002" / ".metadata").is_file()
    resumed, stdout = torchrun_train(tmp_path, "--checkpoint-dir", "ckpt", "--resume", ranks=2)
    assert (saved["world"], resumed["world"]) == (4, 2)
    assert "resumed from" in stdout and resumed["first_step"] == 2
    assert saved["losses"] + resumed["losses"] == pytest.approx(reference, rel=1e-4)


@pytest.mark.extended
def test_train_example_fine_tunes_pretrained_weights_on_a_model_built_on_meta(tmp_path):
    """``--meta --pretrained DIR``: Hugging Face's Llama built on the meta device, its shards loaded from the
    safetensors that ``save_pretrained`` wrote of the seed-0 model, trains as one process from that model (built
    on meta, it has no seed-0 weights of its own: its shards are initialized apart, then overwritten)."""
    hf_llama = "autopar.models.hf:llama"
    build(hf_llama, None, GLOBAL_BATCH, None, seed=0).model.hf.save_pretrained(tmp_path / "pretrained")
    out = tmp_path / "losses.json"
    run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()), str(TRAIN),
         "--model", hf_llama, "--global-batch", str(GLOBAL_BATCH), "--steps", str(STEPS), "--lr", repr(LR),
         "--seed", "0", "--meta", "--pretrained", str(tmp_path / "pretrained"), "--losses-out", str(out)], tmp_path)
    adamw = functools.partial(torch.optim.AdamW, lr=LR)
    expected = train_single(hf_llama, None, GLOBAL_BATCH, None, STEPS, seed=0, optimizer=adamw).losses
    assert json.loads(out.read_text())["losses"] == pytest.approx(expected, rel=1e-4)
