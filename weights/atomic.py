"""Writing files: output locations checked before any work (so that a run never ends by failing to save what it
computed), and the one write-temp-then-rename of the project (results, reports, train.jsonl, logits dumps), whose
files get the mode the user's umask gives (0644 under umask 022), not the 0600 of a temporary file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from weights.errors import BadInputError


def user_umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_mode(path: Path | str, *, directory: bool = False) -> None:
    """Gives a file (or directory) made by `tempfile` (0600, 0700) the mode an ordinary open (mkdir) would have."""
    os.chmod(path, (0o777 if directory else 0o666) & ~user_umask())


def _check_writable(directory: Path, path: Path, name: str) -> None:
    if not os.access(directory, os.W_OK | os.X_OK):
        where = "" if directory == path else f": {directory} is not writable"
        raise BadInputError(f"{name} {path}: cannot write there{where}")


def check_output_dir(path: Path, name: str, *, empty: bool) -> None:
    """Refuses (BadInputError naming `name`, the option, and `path`) an output directory the command could not
    create or write: an existing file, a path under a file, no write permission on it or on its nearest existing
    ancestor (missing parents are created, as `mkdir -p`), and, when `empty`, a directory that holds anything."""
    path = Path(path).absolute()
    try:
        if path.exists():
            if not path.is_dir():
                raise BadInputError(f"{name} {path} is a file, not a directory")
            if empty and any(path.iterdir()):
                raise BadInputError(f"{path} exists and is not empty; refusing to overwrite it")
            _check_writable(path, path, name)
            return
        ancestor = next(p for p in path.parents if os.path.lexists(p))  # `path` is absolute: "/" exists
        if not ancestor.is_dir():
            raise BadInputError(f"{name} {path}: cannot create it, {ancestor} is a file")
        _check_writable(ancestor, path, name)
    except OSError as error:  # a name too long, a directory that cannot be listed, ...
        raise BadInputError(f"{name} {path}: {error.strerror}") from None


def check_new_file(path: Path, name: str) -> None:
    """Refuses a file output that exists (of any kind: never overwritten) or whose directory does not exist (not
    created silently) or cannot be written."""
    path = Path(path).absolute()
    if os.path.lexists(path):
        raise BadInputError(f"{path} exists; refusing to overwrite it")
    parent = path.parent
    if not parent.is_dir():
        what = "is a file" if os.path.lexists(parent) else "does not exist (create it first)"
        raise BadInputError(f"{name} {path}: the directory {parent} {what}")
    _check_writable(parent, path, name)


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO]:
    """Yields a new file beside `path` (same directory, so the rename stays on one file system; text in UTF-8); on
    a clean exit it replaces `path` in one rename, on an exception it is removed and `path` is left as it was.
    Several of them in one `contextlib.ExitStack` publish a set of files only once all are written."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as handle:
            yield handle
        publish_mode(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomically(path: Path, text: str) -> None:
    """`path.write_text(text)`, all or nothing."""
    with atomic_file(path) as handle:
        handle.write(text)
