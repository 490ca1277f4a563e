"""The caller's ``torch.autocast``, set aside while autopar's program runs.

A training loop often wraps its step in ``torch.autocast``. Around autopar's program that does not give
eager autocast's mixed precision: the program is a graph of aten ops captured in the plan's dtype, and
autocast's per-op policy is written for the ops eager code calls, not for these. Under CPU autocast in
bf16, eager ``F.cross_entropy`` calls ``log_softmax``, which autocast runs in fp32, while the captured
graph calls ``_log_softmax``, which it leaves in bf16: tiny-gpt's losses under dp=2 came out as bf16
numbers (5.59375, 5.5625, 5.5625 over three SGD steps, where one process under autocast gives 5.58952,
5.56738, 5.5456 and without it 5.58963, 5.56745, 5.54567), and the matmuls ran in a precision the plan did
not price. So the program runs in the plan's precision, autocast off, and the caller is told once how to
ask for mixed precision: ``dtype='bf16'`` in the constraints, which plans, prices and runs it
(``passes/mixed_precision.py``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

from autopar.core.plan import Precision


class CallerAutocast:
    """Sets the caller's autocast on the job's device aside around each call of one module's program,
    warning the first time it finds it on."""

    def __init__(self, device_type: str, precision: Precision, captured_under: str | None) -> None:
        """``captured_under``: the dtype of the autocast the step was captured under (``CapturedGraph.autocast``),
        whose casts the program already runs: the caller's autocast is then set aside without a word."""
        self.device_type = device_type
        self.precision = precision
        self.warned = captured_under is not None

    @contextlib.contextmanager
    def set_aside(self, call: str) -> Iterator[None]:
        """Run ``call`` (what the caller called, for the warning) with autocast off on the job's device."""
        if not torch.is_autocast_enabled(self.device_type):
            yield
            return
        if not self.warned:
            self.warned = True
            warnings.warn(self._message(call), stacklevel=4)
        with torch.autocast(self.device_type, enabled=False):
            yield

    def _message(self, call: str) -> str:
        compute = self.precision.compute
        how = (f"the plan already computes in {compute}" if compute != "fp32" else
               "for mixed precision plan with dtype='bf16' (constraints={'dtype': 'bf16'}, --fix dtype=bf16), "
               "which computes in bf16 and keeps fp32 master weights, or call autoparallelize under the same "
               "autocast: the capture then records its casts, as eager autocast runs them")
        return (f"autopar: torch.autocast('{self.device_type}') is on around {call}; the plan's program runs in "
                f"its own precision ({compute} compute) with autocast off: autocast would cast the "
                "captured aten ops unlike eager code (the loss's log-softmax in bf16) and in a precision the "
                f"plan did not price; {how}")
