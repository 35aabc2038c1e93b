"""Writing a file so that a reader (or a crash) never sees part of it: the one write-temp-then-rename of the
project (results, reports, train.jsonl, logits dumps).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


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
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomically(path: Path, text: str) -> None:
    """`path.write_text(text)`, all or nothing."""
    with atomic_file(path) as handle:
        handle.write(text)
