"""Errors a user can hit, each with a message that says what went wrong and where.

The CLI maps ``AutoparError`` subclasses to exit codes (docs/architecture.md "Command line"): bad input is 2, a model that fits
no plan is 3, a spawned distributed run whose rank failed is 1 (with that rank's traceback tail in the message).
Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import traceback
from typing import Callable


class AutoparError(Exception):
    """Base class of the errors autopar raises on purpose."""

    exit_code = 2


class BadInputError(AutoparError, ValueError):
    """A model name, option, constraint or argument that autopar cannot use."""


class UnknownNameError(BadInputError, KeyError):
    """An op or parameter name a plan does not have (``explain``); a ``KeyError`` too, as a lookup."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else ""


class UnsupportedModelError(AutoparError):
    """The model could not be captured as a training-step graph."""


class PlanFormatError(AutoparError, ValueError):
    """A plan file that is not valid ``autopar.plan/1`` JSON."""


class NoFeasiblePlanError(AutoparError):
    """No parallelization of the model fits the devices' memory (or the constraints)."""

    exit_code = 3


class DistributedRunError(AutoparError):
    """A rank of a spawned gloo run raised, died or outlived the run's timeout; the others were stopped.

    Exit code 1: the run failed, not its input; the message carries the failed rank's own traceback tail.
    """

    exit_code = 1


def innermost_frame(exc: BaseException | None, counts: Callable[[traceback.FrameSummary], bool]
                    ) -> traceback.FrameSummary | None:
    """The innermost frame that ``counts`` (the caller's code, not a library's) in which ``exc`` was raised,
    looking first at the original error it wraps (``__cause__``/``__context__``); None where no frame counts.
    A message can then say which line of a model or factory failed, without its traceback."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for error in reversed(chain):  # the original error first
        for frame in reversed(traceback.extract_tb(error.__traceback__)):
            if counts(frame):
                return frame
    return None
