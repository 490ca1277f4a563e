"""Run a function on W local ranks with the gloo backend (tests, ``autopar demo``).

Each rank is a spawned process with its own free TCP port rendezvous and a timeout, so a hung
collective fails the run instead of hanging it. ``torchrun`` users do not need this module.
"""

from __future__ import annotations

import io
import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each of ``world_size`` gloo ranks; returns each rank's result."""
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, timeout_s, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    for _ in procs:
        rank, ok, value = queue.get()
        if ok:
            results[rank] = _from_bytes(value)
        else:
            errors.append(f"rank {rank}: {value}")
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def _to_bytes(value: Any) -> bytes:
    """Results cross the process boundary as bytes: tensors in shared memory die with their rank."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(fn, rank, world_size, port, queue, timeout_s, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        queue.put((rank, True, _to_bytes(fn(rank, world_size, *args))))
    except BaseException as exc:  # report every failure to the parent instead of dying silently
        import traceback

        queue.put((rank, False, "".join(traceback.format_exception(exc))[-4000:]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
