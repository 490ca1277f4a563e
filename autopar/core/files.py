"""Reading and writing the files a user names: one clear error for each way a path can be wrong.

Every command reads plan, problem and cluster files through ``read_text`` and writes every output
(plans, problems, reports, traces, exported code, calibrated profiles) through ``write_atomically``,
after ``check_writable`` refused an unusable output path before any work started. A write goes to a
temporary file in the target's directory, then replaces the target in one step (``os.replace``), so a
failure leaves either the old file or none, never half of a new one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from autopar.core.errors import AutoparError, BadInputError


def read_text(path: str | Path, what: str, error: type[AutoparError] = BadInputError) -> str:
    """The text of the ``what`` file (``"plan"``, ``"problem"``, ``"cluster"``) at ``path``; a missing,
    unreadable or non-text file raises ``error`` naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a {what} file") from None
    except PermissionError:
        raise error(f"{path}: cannot read the {what} file (permission denied)") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not a {what} file (not UTF-8 text)") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} file ({exc.strerror or exc})") from None


def check_writable(path: str | Path, option: str) -> None:
    """Refuse, before any work, an output path given with ``option`` that could not be written: its
    directory is missing or read-only, or the path is a directory."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise BadInputError(f"{option} {path}: is a directory; give a file name")
    if not folder.is_dir():
        raise BadInputError(f"{option} {path}: directory {str(folder)!r} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise BadInputError(f"{option} {path}: directory {str(folder)!r} is not writable")


def write_atomically(path: str | Path, text: str | bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``text`` (UTF-8, or ``bytes`` as they are, or what a writer given the open file writes into it:
    a large file, without its bytes in memory first) to ``path`` through a temporary file in the same
    directory and ``os.replace``: the file is either written whole or left as it was. The new file gets
    the usual permissions (0666 less the umask), not the temporary file's private ones."""
    target = Path(path)
    try:
        fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise BadInputError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o666 & ~_umask())
            if callable(text):
                text(handle)
            else:
                handle.write(text.encode("utf-8") if isinstance(text, str) else text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException as exc:
        os.unlink(temporary)
        if isinstance(exc, OSError):
            raise BadInputError(f"cannot write {path}: {exc.strerror or exc}") from None
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
