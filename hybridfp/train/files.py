"""Atomic file writes for the run's outputs (metrics.jsonl, run.json, checkpoints, summaries).

A run killed at any moment leaves each file either as it was or as it was meant to be: the new
content goes to a temporary file in the same directory, is flushed to the disk, and then
replaces the old file in one ``os.replace`` (atomic on POSIX and Windows within one file
system, which the same directory guarantees).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Callable


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Replace ``path`` by what ``write(f)`` writes to a binary file, atomically.

    Parameters
    ----------
    path:
        The file to create or replace (its directory is created if needed).
    write:
        Writes the whole new content to the binary file object it is given.

    Raises
    ------
    OSError
        The directory or the temporary file cannot be written; ``path`` is left untouched and
        the temporary file removed. Whatever ``write`` raises propagates the same way.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # a hidden name in the same directory: os.replace stays on one file system, and a
    # leftover from a killed process is not mistaken for a checkpoint or a metrics file
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data is on the disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` (UTF-8), atomically; see :func:`atomic_write`."""
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (best effort: some systems cannot open directories)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


__all__ = ["atomic_write", "atomic_write_text"]
