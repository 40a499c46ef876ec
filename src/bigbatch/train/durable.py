"""Writing a run's files so that a kill or a crash leaves either the old version or the new
one, never half of one: flushing a folder's entries, replacing a text file in one rename, and
moving paths aside into a new folder of their own (nothing is ever deleted). Also the one
error path of every file a run or a command writes (:func:`write_errors`): a full disk, no
permission or a read-only file system is an :class:`~bigbatch.errors.OutputError` naming the
file, the free space and what to do, and a file written with :func:`write_text_safely` is
either all there or as it was (its temporary file removed)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import OutputError, free_space

__all__ = ["fsync_dir", "write_text_atomic", "move_into_new_folder", "write_errors",
           "free_space", "write_text_safely"]


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
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # nothing half-written left beside it
        raise


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


# what torch's and safetensors' writers say when a write stops short (a full disk): the
# first failure names the write, a later one often only "unexpected pos N vs M"
_WRITE_FAILURES = ("unexpected pos", "writ", "no space left", "disk quota")


def failed_write(target: str | Path, e: BaseException, hint: str,
                 run: bool = True) -> OutputError:
    """The error for a write of ``target`` that failed with ``e``: the file, why, the free
    space, and ``hint`` (what to do next); ``run``: a training run's file (then fewer kept
    checkpoints free space too)."""
    text = str(e).strip().splitlines()[0].strip() if str(e).strip() else type(e).__name__
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror
    space = free_space(target)
    more = " (or lower --save-total-limit)" if run else ""
    return OutputError(f"could not write {target}: {text}" + (f" ({space})" if space else "")
                       + f"; is the disk full (or the folder not writable)? Free some space"
                         f"{more}, then {hint}")


@contextlib.contextmanager
def write_errors(target: str | Path, hint: str, run: bool = True) -> Iterator[None]:
    """Turn a failed write of ``target`` (an OSError, or torch's RuntimeError from a stream
    that stopped short) into an :class:`OutputError` naming ``target``, the free space and
    ``hint`` (what to do next); ``run`` as for :func:`failed_write`."""
    try:
        yield
    except OutputError:
        raise
    except (OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not any(w in str(e).lower() for w in _WRITE_FAILURES):
            raise
        raise failed_write(target, e, hint, run) from e


def write_text_safely(path: str | Path, text: str, hint: str, run: bool = True) -> None:
    """:func:`write_text_atomic` with the folder's entries flushed, and a failure as
    :func:`write_errors` names it (``hint``: what to do next; ``run``: a training run's
    file): the file is all there, or as it was before."""
    with write_errors(path, hint, run):
        write_text_atomic(path, text)
        fsync_dir(Path(path).absolute().parent)
