"""Writing a run's files so that a kill or a crash leaves either the old version or the new
one, never half of one: flushing a folder's entries, replacing a text file in one rename, and
moving paths aside into a new folder of their own (nothing is ever deleted)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["fsync_dir", "write_text_atomic", "move_into_new_folder"]


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (renames, new files) to disk; a no-op where directories
    cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename of a flushed temporary file beside it (of
    this process); the caller flushes the folder's entries (:func:`fsync_dir`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def move_into_new_folder(parent: str | Path, prefix: str, paths: Iterable[Path]) -> Path:
    """Move ``paths`` (those that exist) into a new folder ``parent/<prefix><timestamp>``
    (``-2``, ``-3``, ... when that name is taken) and return it; the caller flushes the
    folders' entries."""
    parent = Path(parent)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = parent / f"{prefix}{stamp}", 1
    while dest.exists():
        n += 1
        dest = parent / f"{prefix}{stamp}-{n}"
    dest.mkdir()
    for p in paths:
        if p.exists() or p.is_symlink():
            os.replace(p, dest / p.name)
    return dest
