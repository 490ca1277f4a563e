"""The ``autopar`` command run inside the test process: what ``python -m autopar ARGS`` does, without
starting an interpreter and importing torch again (about 3 s of CPU a run on the 2-core machine).

``run_cli`` calls ``autopar.cli.main`` (what ``autopar/__main__.py`` runs) in ``cwd``, with stdout and
stderr captured, and returns what a subprocess would: its exit code, stdout and stderr. Warnings are shown
on the captured stderr under a fresh interpreter's filters, as the command would print them, so a test
that wants one line on stderr still sees a warning the command would add. What only a real process
shows (output written below Python's ``sys.stdout``, the entry point itself) stays covered by the few
tests that run ``python -m autopar`` as a subprocess.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Iterator

FRESH_INTERPRETER_IGNORES = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
"""The warning categories a fresh interpreter ignores (outside ``__main__``), as ``python -m autopar`` runs."""


def run_cli(*args: str, cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """``autopar ARGS`` in this process: a ``CompletedProcess`` with its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with _in_directory(cwd), _as_a_fresh_interpreter_warns(), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _exit_code(list(args))
    return subprocess.CompletedProcess(["autopar", *args], code, out.getvalue(), err.getvalue())


def _exit_code(argv: list[str]) -> int:
    """``main``'s return value, or the code of the ``SystemExit`` argparse raises (usage errors, --help)."""
    from autopar.cli import main

    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


@contextlib.contextmanager
def _in_directory(cwd: Path | str | None) -> Iterator[None]:
    if cwd is None:
        yield
        return
    before = os.getcwd()
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def _as_a_fresh_interpreter_warns() -> Iterator[None]:
    """Warnings printed on ``sys.stderr`` (the captured one) under a fresh interpreter's filters."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for category in FRESH_INTERPRETER_IGNORES:
            warnings.simplefilter("ignore", category)
        warnings.showwarning = _show_on_current_stderr
        yield


def _show_on_current_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
