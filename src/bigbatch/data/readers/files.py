"""Opening the files data names, safely: regular files only, text documents up to a size
limit, never blocking, and optionally only inside one folder.

A path in a data file (``chunk_path``, an image path, a BEIR corpus ``image``) may name
anything on the machine. Reading one must give an answer, never hang or exhaust memory:

- Only regular files are read (a symbolic link is followed to its target). A FIFO, a
  device (``/dev/zero``, ``/dev/stdin``), a socket or a folder is refused: the file is
  opened without blocking (``O_NONBLOCK``) and checked on the open descriptor, so a FIFO
  never waits for a writer.
- A text document file is read whole, so it may hold at most :data:`MAX_TEXT_FILE_BYTES`
  (8 MiB; texts are cut to the model's ``--max-length`` tokens anyway). A page image may
  hold at most :data:`MAX_IMAGE_BYTES` (256 MiB; Pillow's decompression-bomb limit bounds
  its pixels).
- Confinement (``--data-root DIR``, :class:`~bigbatch.train.TrainConfig` ``data_root``):
  by default data may name any file the user can read, as Qwen3-VL-Embedding's training pipeline
  allows; with a
  data root, a path that resolves (symbolic links and ``..`` followed) outside that folder
  is refused (:func:`outside_root`).

A refused file raises :class:`OSError` (:class:`NotRegularFileError`, :class:`FileTooLargeError`)
whose ``strerror`` says why, so every caller's ``except OSError`` reports it with the file,
line and field; a data file itself (:func:`open_data_file`) raises
:class:`~bigbatch.errors.DataError` naming it.

The files and folders commands write (``train``'s output folder, ``eval`` / ``mine`` /
``make-pairs`` outputs, ``render-pages``' folder) are write-tested before the work starts
(:func:`check_writable_file`, :func:`check_writable_folder`), so that an unwritable
destination fails before the work, not after.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Any

from ...errors import ConfigError, DataError

__all__ = ["default_cache_dir", "MAX_TEXT_FILE_BYTES", "MAX_IMAGE_BYTES", "NotRegularFileError",
           "FileTooLargeError", "open_regular", "open_data_file", "read_limited", "outside_root",
           "check_writable_folder", "check_writable_file"]

MAX_TEXT_FILE_BYTES = 8 * 2**20  # a text document file (chunk_path): read whole
MAX_IMAGE_BYTES = 256 * 2**20  # a page image file


class NotRegularFileError(OSError):
    """A path names a FIFO, a device, a socket or a folder rather than a regular file."""


class FileTooLargeError(OSError):
    """A file is larger than what bigbatch reads of that kind."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n % 2**20 else f"{n // 2**20} MiB"


def open_regular(path: str | Path, mode: str = "rb", limit: int | None = None,
                 what: str = "file", **kwargs: Any) -> IO:
    """``open(path, mode, **kwargs)`` for reading, when ``path`` is a regular file (of at most
    ``limit`` bytes when given; ``what`` names it in that message).

    Raises:
        NotRegularFileError: a FIFO, device, socket or folder (checked without blocking).
        FileTooLargeError: over ``limit``.
        OSError: as ``open`` (missing, no permission).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(
                0, f"is {_kind(st.st_mode)}, not a regular file; bigbatch reads data from "
                   f"regular files only", str(path))
        if limit is not None and st.st_size > limit:
            raise FileTooLargeError(
                0, f"is {_mib(st.st_size)}, over the {_mib(limit)} bigbatch reads of a {what}; "
                   f"split or shorten it", str(path))
        return open(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def open_data_file(path: str | Path, **kwargs: Any) -> IO:
    """A data file (JSONL, TSV, CSV) opened as text for reading (``open`` keyword arguments:
    encoding, errors, newline), when it is a regular file (:func:`open_regular`).

    Raises:
        DataError: naming the file, and why it cannot be read.
    """
    try:
        return open_regular(path, "r", **kwargs)
    except OSError as e:
        raise DataError(f"cannot read: {e.strerror or e}", path=str(path)) from e


def read_limited(path: str | Path, limit: int = MAX_TEXT_FILE_BYTES,
                 what: str = "text document") -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (one that grows while it is
    read is cut at ``limit + 1`` bytes and refused).

    Raises:
        OSError: as :func:`open_regular`.
    """
    with open_regular(path, "rb", limit, what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileTooLargeError(0, f"is over the {_mib(limit)} bigbatch reads of a {what}; "
                                   f"split or shorten it", str(path))
    return data


def outside_root(path: str | Path, data_root: str | Path | None) -> str | None:
    """Why ``path`` may not be read under confinement to ``data_root`` (it resolves, with
    symbolic links and ``..`` followed, outside that folder), or None (inside it, or no
    confinement: ``data_root`` None or empty).

    Raises:
        ConfigError: ``data_root`` is not a folder.
    """
    if not data_root:
        return None
    root = Path(os.path.realpath(os.path.expanduser(str(data_root))))
    if not root.is_dir():
        raise ConfigError(f"--data-root: {str(data_root)!r} is not a folder")
    real = Path(os.path.realpath(path))
    if real == root or root in real.parents:
        return None
    return (f"{str(path)!r} resolves to {str(real)!r}, outside the data root {str(root)!r} "
            f"(--data-root); only files inside it may be read")


def default_cache_dir() -> Path:
    """Where bigbatch keeps what it can rebuild (corpus embeddings, record indexes):
    ``$BIGBATCH_CACHE``, else ``~/.cache/bigbatch``."""
    return Path(os.environ.get("BIGBATCH_CACHE", Path.home() / ".cache" / "bigbatch"))


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable_folder(path: str | Path, option: str) -> None:
    """Refuse a folder that cannot be created or written in (a file on its way, no
    permission, a read-only file system), by writing a probe file (removed at once) in it or
    in the nearest folder above it that exists.

    Raises:
        ConfigError: naming ``option``, the path and why.
    """
    p = Path(path)
    base = _nearest_existing(p)
    if not base.is_dir():
        raise ConfigError(f"{option}: {p} cannot be a folder: {base} is a file")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise ConfigError(f"{option}: cannot write in {base} ({e.strerror or e}); give a "
                          f"folder you can write to") from e


def check_writable_file(path: str | Path, option: str, create_folders: bool = True) -> None:
    """Refuse a file that could not be written: a folder of that name, a missing folder
    (unless ``create_folders``), no permission. Nothing is written: an existing file is
    opened for appending and closed, a new one is probed by a temporary file beside it.

    Raises:
        ConfigError: naming ``option``, the path and why (checked before the work, so that
            none is lost).
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option}: {p} is a folder; give a file name")
    if p.exists():
        try:
            with open(p, "a"):
                pass
        except OSError as e:
            raise ConfigError(f"{option}: cannot write {p} ({e.strerror or e}); checked "
                              f"before the work, so none is lost") from e
        return
    if not create_folders and not p.absolute().parent.is_dir():
        raise ConfigError(f"{option}: the folder {p.absolute().parent} does not exist "
                          f"(checked before the work, so none is lost)")
    check_writable_folder(p.absolute().parent, option)
