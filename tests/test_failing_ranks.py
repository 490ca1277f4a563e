"""No failure hangs a job: a rank that dies, raises or hangs ends the run in bounded time with an error naming it.

``run_on_ranks`` (what the tests, ``autopar demo`` and ``autopar calibrate`` spawn ranks with) is driven
with 4 gloo ranks training a small MLP under ``autoparallelize``; ``torchrun`` with the same kill shows
what users get. Each test bounds the time from the failure to the error (the spawning and planning
before it take what the machine's load makes them take) and checks that no rank process outlives it.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from autopar.core.errors import DistributedRunError
from autopar.testing.launch import GRACE_S, run_on_ranks

WORLD = 4
FAILING_RANK = 2
BOUND_S = 60.0

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def _train_then(rank: int, world: int, failure: str, stamp: str) -> float:
    """Two SGD steps of a small MLP under autoparallelize; ``FAILING_RANK`` fails after the first, as
    ``failure`` says, having written the time it fails at to the file ``stamp``."""
    import autopar
    from autopar.models import build_model

    bundle = build_model("mlp", global_batch=8, device="cpu")
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints={"dp": world})
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    batch = (*bundle.example_inputs, bundle.example_targets)
    for step in range(2):
        if step == 1 and rank == FAILING_RANK:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            _fail(failure)
        opt.zero_grad()
        loss = pm.step(*batch)
        opt.step()
    return loss.item()


def _fail(failure: str) -> None:
    if failure == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("rank 2 found a bad batch")


def _run_failing(fn: Callable[..., Any], *args: Any, world: int = WORLD, timeout_s: float = 300.0) -> str:
    with pytest.raises(DistributedRunError) as info:
        run_on_ranks(fn, world, *args, timeout_s=timeout_s)
    assert multiprocessing.active_children() == [], "a rank process outlived run_on_ranks"
    return str(info.value)


def _seconds_since_failure(stamp: Path) -> float:
    return time.time() - float(stamp.read_text())


def test_a_rank_killed_mid_step_fails_the_run_within_a_minute_naming_it(tmp_path):
    message = _run_failing(_train_then, "kill", str(tmp_path / "failed_at"))
    assert _seconds_since_failure(tmp_path / "failed_at") < BOUND_S
    assert message.startswith(f"distributed run on {WORLD} ranks failed: rank {FAILING_RANK} was killed by signal 9")
    assert all(f"rank {r}:" in message for r in range(WORLD) if r != FAILING_RANK), message


def test_a_rank_raising_mid_step_fails_the_run_naming_it_and_its_exception(tmp_path):
    message = _run_failing(_train_then, "raise", str(tmp_path / "failed_at"))
    assert _seconds_since_failure(tmp_path / "failed_at") < BOUND_S
    assert message.startswith(f"distributed run on {WORLD} ranks failed: rank {FAILING_RANK} raised"), message
    assert "ValueError: rank 2 found a bad batch" in message


def _hang_in_a_collective(rank: int, world: int) -> None:
    """``FAILING_RANK`` sleeps while the others wait for it in an all-reduce."""
    if rank == FAILING_RANK:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


@pytest.mark.extended
def test_a_hung_rank_fails_the_run_at_its_timeout_naming_the_ranks_still_running():
    timeout_s = 30.0
    start = time.monotonic()
    message = _run_failing(_hang_in_a_collective, timeout_s=timeout_s)
    assert time.monotonic() - start < timeout_s + GRACE_S + 5.0  # the deadline, then terminate and kill
    head = message.splitlines()[0]
    assert "timed out after 30 s" in head and f"{FAILING_RANK}" in head.split("still running")[0], message


def _exit_without_reporting(rank: int, world: int) -> int:
    dist.barrier()  # gloo's connections all made first: rank 1 gone during the handshake fails rank 0's too
    if rank == 1:
        os._exit(3)
    return rank


def test_a_rank_exiting_without_a_result_fails_the_run_with_its_exit_code():
    message = _run_failing(_exit_without_reporting, world=2)
    assert message.splitlines()[0] == ("distributed run on 2 ranks failed: rank 1 exited with code 3 without "
                                       "reporting a result"), message
    assert "rank 0: finished" in message


def _abort_in_native_code(rank: int, world: int) -> int:
    """Rank 1 ends as a crash in native code ends a process (glibc's ``abort`` on a corrupt heap: SIGABRT)."""
    if rank == 1:
        _deep_in_the_step()
    return rank


def _deep_in_the_step() -> None:
    os.abort()


def test_a_rank_a_fatal_signal_ends_fails_the_run_quoting_its_python_stack_at_the_signal():
    message = _run_failing(_abort_in_native_code, world=2)
    lines = message.splitlines()
    assert lines[0] == "distributed run on 2 ranks failed: rank 1 was killed by signal 6 (Aborted) before reporting " \
                       "a result", message
    assert lines[1].strip() == "its Python stack at the signal, most recent call first:", message
    assert "in _deep_in_the_step" in lines[2] and "in _abort_in_native_code" in lines[3], message
    assert lines[-1] == "  rank 0: finished", message


def _wait_on_a_hung_mesh_peer(rank: int, world: int) -> float | None:
    """With the job's collective timeout set to 3 s, rank 3 waits on rank 2 in their 2x2-mesh dim's group."""
    import autopar
    from autopar.models import build_model

    dist.group.WORLD.set_timeout(timedelta(seconds=3))
    bundle = build_model("mlp", global_batch=8, device="cpu")
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints={"dp": 2, "tp": 2})
    if rank == 2:
        time.sleep(10)
    if rank != 3:
        return None
    group = next(pm.mesh.get_group(d) for d in range(pm.mesh.ndim)
                 if 2 in dist.get_process_group_ranks(pm.mesh.get_group(d)))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out"):
        dist.all_reduce(torch.ones(1), group=group)
    return time.monotonic() - start


@pytest.mark.extended
def test_the_plan_mesh_groups_time_out_with_the_job_not_after_torchs_30_minutes():
    waited = run_on_ranks(_wait_on_a_hung_mesh_peer, WORLD)[3]
    assert waited < 8, f"rank 3 waited {waited:.1f} s on its hung mesh peer"


TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import autopar
    from autopar.models import build_model

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    bundle = build_model("mlp", global_batch=8, device="cpu")
    pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints={"dp": 4})
    batch = (*bundle.example_inputs, bundle.example_targets)
    pm.step(*batch)
    if rank == 2:
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    pm.step(*batch)
    dist.destroy_process_group()
""")


@pytest.mark.heavy
def test_torchrun_stops_every_worker_within_a_minute_when_one_is_killed(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                           "--standalone", str(script), str(tmp_path / "failed_at")],
                          capture_output=True, text=True, timeout=300)
    assert _seconds_since_failure(tmp_path / "failed_at") < BOUND_S
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert len(re.findall(r"exitcode\s+: -?[1-9]", output)) == WORLD, "torchrun reports every worker as failed"
    root_cause = output.split("Root Cause")[-1]
    assert re.search(rf"rank\s*:\s*{FAILING_RANK} \(local_rank", root_cause) and "SIGKILL" in root_cause, root_cause
