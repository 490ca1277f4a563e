"""Run a function on W local ranks with the gloo backend (tests, ``autopar demo``, ``autopar calibrate``).

Each rank is a process of its own with a pipe back to the parent. Ranks are forked from multiprocessing's
fork server, which imports torch, its export and DTensor stacks and autopar once (``PRELOADED``), so a rank
starts in milliseconds instead of re-importing them (about 3 s of CPU a rank); where the platform has no
fork server, ranks are spawned. Either way a rank starts from a clean process (not a fork of the caller),
with the caller's environment variables as they are at the call. The parent waits on the pipes and on the
processes together, under one deadline: when a rank raises, dies without reporting (a signal, the
out-of-memory killer) or the run outlives ``timeout_s``, it gives the other ranks ``GRACE_S`` to report,
stops every process still alive and raises one ``DistributedRunError`` naming the rank that failed first and
how. A rank that a fatal signal ends (a crash in native code: SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) has its
Python stack at the signal written by ``faulthandler`` to a file of its own, which the message quotes. No
process outlives ``run_on_ranks``, whatever happens (docs/architecture.md "Failing ranks"). ``torchrun`` users
do not need this module.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.core.errors import DistributedRunError

GRACE_S = 5.0
"""How long, after the first failure, the other ranks get to report (or to exit after reporting) before being stopped."""
TRACEBACK_LINES = 6
"""How many last lines of the failed rank's traceback (frames of its stack at a fatal signal) the error message
quotes."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each of ``world_size`` gloo ranks; returns each rank's result.

    Raises ``DistributedRunError`` when a rank raises, dies or the run takes longer than ``timeout_s``
    (also the process group's collective timeout); every rank's process is stopped before returning.
    """
    port = free_port()
    ctx = _start_context()
    ranks = [_Rank.spawn(ctx, fn, r, world_size, port, timeout_s, args) for r in range(world_size)]
    try:
        timed_out = _wait_for_outcomes(ranks, time.monotonic() + timeout_s)
    finally:
        _stop(ranks)
    if timed_out or any(r.failed for r in ranks):
        raise DistributedRunError(_failure_message(ranks, timeout_s))
    return [_from_bytes(r.outcome[1]) for r in ranks]


PRELOADED = ("torch", "torch.distributed.tensor", "torch._dynamo", "torch.export", "autopar", "autopar.api",
             "autopar.testing.parity")
"""What the fork server imports before it forks ranks: what every rank's capture, planning and run import."""


def _start_context() -> Any:
    """The fork server's multiprocessing context, preloading ``PRELOADED``; spawn where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


class _Rank:
    """One rank: its process, the read end of its pipe, and what became of it."""

    def __init__(self, rank: int, process: Any, reader: Connection, crash_file: str):
        self.rank = rank
        self.process = process
        self.reader = reader
        self.crash_file = crash_file  # where the rank's ``faulthandler`` writes its stack at a fatal signal
        self.outcome: tuple[str, Any] | None = None  # ("result", bytes) | ("raised", text) | ("died", text)
        self.order = 0  # when the outcome arrived, counting from 1, among all ranks
        self.stopped = False

    @classmethod
    def spawn(cls, ctx: Any, fn: Callable[..., Any], rank: int, world_size: int, port: int, timeout_s: float,
              args: tuple) -> "_Rank":
        reader, writer = ctx.Pipe(duplex=False)
        fd, crash_file = tempfile.mkstemp(prefix=f"autopar-rank{rank}-", suffix=".crash")
        os.close(fd)
        process = ctx.Process(target=_worker, args=(fn, rank, world_size, port, writer, timeout_s,
                                                    dict(os.environ), crash_file, args))
        process.start()
        writer.close()  # the child holds the only write end: its death reads as EOF
        return cls(rank, process, reader, crash_file)

    @property
    def failed(self) -> bool:
        return self.outcome is not None and self.outcome[0] != "result"

    def update(self, ready: list[Any]) -> None:
        """Read this rank's report, or note its death."""
        if self.reader in ready:
            self.outcome = self._report()
        if self.outcome is None and not self.process.is_alive():
            self.outcome = self._report() or ("died", _describe_exit(self.process.exitcode) + self._stack_at_crash())

    def _stack_at_crash(self) -> str:
        """The Python stack ``faulthandler`` wrote as a fatal signal ended the rank, its last ``TRACEBACK_LINES``
        frames (most recent call first) as lines to quote after the exit's description; '' where none. The
        crashing thread's, or where the signal came on a thread running no Python (a gloo or OpenMP worker),
        the first Python thread's."""
        try:
            with open(self.crash_file) as f:
                dump = f.read()
        except OSError:
            return ""
        stacks = []  # (whether it is the crashing thread's, its frames), each thread with Python frames
        for block in dump.split("\n\n"):
            head, *lines = block.strip().splitlines() or [""]
            frames = [line.strip() for line in lines if line.strip().startswith("File ")]
            if "(most recent call first)" in head and frames:
                stacks.append((head.startswith("Current thread"), frames))
        if not stacks:
            return ""
        crashing, frames = max(stacks, key=lambda stack: stack[0])  # the crashing thread's, else the first
        whose = "its Python stack at the signal" if crashing else \
            "a Python thread's stack (the signal came on a thread running no Python)"
        return f"\n    {whose}, most recent call first:\n" + "\n".join("      " + f for f in frames[:TRACEBACK_LINES])

    def _report(self) -> tuple[str, Any] | None:
        """The report in the pipe, if any; None at end of file (the rank died first), once its exit code is in."""
        try:
            return self.reader.recv() if self.reader.poll() else None
        except EOFError:
            self.process.join(timeout=GRACE_S)
            return None


def _wait_for_outcomes(ranks: list[_Rank], deadline: float) -> bool:
    """Collect every rank's outcome, ending ``GRACE_S`` after the first failure; True if the deadline hit first."""
    order = 0
    grace_end = float("inf")
    while any(r.outcome is None for r in ranks):
        now = time.monotonic()
        if now >= min(deadline, grace_end):
            return now >= deadline and grace_end == float("inf")
        waiting = [r for r in ranks if r.outcome is None]
        ready = wait([r.reader for r in waiting] + [r.process.sentinel for r in waiting], min(deadline, grace_end) - now)
        for r in waiting:
            r.update(ready)
            if r.outcome is not None:
                order += 1
                r.order = order
        if grace_end == float("inf") and any(r.failed for r in ranks):
            grace_end = time.monotonic() + GRACE_S
    return False


def _stop(ranks: list[_Rank]) -> None:
    """Give ranks that reported ``GRACE_S`` to exit on their own, then terminate, then kill what is left."""
    end = time.monotonic() + GRACE_S
    for r in ranks:
        if r.outcome is not None and r.outcome[0] != "died":
            r.process.join(timeout=max(0.0, end - time.monotonic()))
    for r in ranks:
        if r.process.is_alive():
            r.stopped = True
            r.process.terminate()
    for r in ranks:
        r.process.join(timeout=1.0)
        if r.process.is_alive():
            r.process.kill()
            r.process.join()
        r.reader.close()
        with contextlib.suppress(OSError):
            os.unlink(r.crash_file)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        hint = ", as the out-of-memory killer does," if -exitcode == signal.SIGKILL else ""
        return f"was killed by signal {-exitcode} ({signal.strsignal(-exitcode)}){hint} before reporting a result"
    return f"exited with code {exitcode} without reporting a result"


def _failure_message(ranks: list[_Rank], timeout_s: float) -> str:
    """One message: the rank that failed first and how (or, on a timeout, the ranks still running), then the others."""
    first = _first_failure(ranks)
    if first is None:
        running = ", ".join(str(r.rank) for r in ranks if r.outcome is None)
        head = (f"distributed run on {len(ranks)} ranks timed out after {timeout_s:g} s with rank(s) {running} still "
                f"running: raise timeout_s if the run needs longer, or find what those ranks wait for")
        others = [r for r in ranks if r.outcome is not None]
    else:
        head = f"distributed run on {len(ranks)} ranks failed: rank {first.rank} {_how(first, TRACEBACK_LINES)}"
        others = [r for r in ranks if r is not first]
    return "\n".join([head] + [f"  rank {r.rank}: {_how(r, 1)}" for r in others])


def _first_failure(ranks: list[_Rank]) -> _Rank | None:
    """The rank to blame: one that died without reporting (its peers then fail on closed connections), else the first to raise."""
    failed = sorted((r for r in ranks if r.failed), key=lambda r: (r.outcome[0] != "died", r.order))
    return failed[0] if failed else None


def _how(r: _Rank, lines: int) -> str:
    if r.outcome is None:
        return "was still running; stopped"
    kind, value = r.outcome
    if kind == "result":
        return "finished" + ("" if not r.stopped else ", then was stopped while exiting")
    if kind == "died":
        return value if lines > 1 else value.splitlines()[0]
    tail = [line for line in value.strip().splitlines() if line.strip(" ^~")][-lines:]  # no caret markers
    return "raised:\n" + "\n".join("    " + line for line in tail) if lines > 1 else f"raised {tail[0].strip()[:300]}"


def _to_bytes(value: Any) -> bytes:
    """Results cross the process boundary as bytes: tensors in shared memory die with their rank."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(fn, rank, world_size, port, writer, timeout_s, environ, crash_file, args) -> None:
    crash = open(crash_file, "w")  # kept open for the process's life: faulthandler writes to its descriptor
    faulthandler.enable(file=crash, all_threads=True)
    os.environ.clear()  # a forked rank inherits the fork server's environment: take the caller's
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        writer.send(("result", _to_bytes(fn(rank, world_size, *args))))
    except BaseException as exc:  # report every failure to the parent instead of dying silently
        writer.send(("raised", "".join(traceback.format_exception(exc))[-4000:]))
    finally:
        writer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
