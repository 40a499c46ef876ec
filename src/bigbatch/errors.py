"""Exceptions a user can cause, each with a message that names the option, tower, file or field.

Every error bigbatch raises on purpose derives from :class:`BigBatchError`, so a caller
can catch them all at once; each also derives from the built-in exception a Python
user would expect (``ValueError`` for bad values, ``FloatingPointError`` for
non-finite numbers), so existing ``except ValueError`` blocks keep working.
"""

from __future__ import annotations

import reprlib
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "shown",
    "SHOWN_CHARS",
    "free_space",
    "BigBatchError",
    "ConfigError",
    "InputError",
    "ShapeError",
    "NonFiniteError",
    "DataError",
    "RankFailedError",
    "OutputError",
    "FetchError",
]


# the most characters of a user's value a message shows (:func:`shown`)
SHOWN_CHARS = 200

_REPR = reprlib.Repr()  # (keyword arguments only from Python 3.12)
for _name, _value in (("maxlevel", 3), ("maxtuple", 6), ("maxlist", 6), ("maxarray", 6),
                      ("maxdict", 6), ("maxset", 6), ("maxfrozenset", 6), ("maxdeque", 6),
                      ("maxstring", SHOWN_CHARS), ("maxlong", 60), ("maxother", SHOWN_CHARS)):
    setattr(_REPR, _name, _value)


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for a message, at most about ``limit`` characters whatever the value:
    a long string is cut in its middle (``'abc...xyz' (52,428,800 characters)``), a container
    shows its first items and levels only, so that a message never prints (or first builds)
    an unbounded text: a 50 MB field, a YAML "billion laughs" alias tree. Every message that
    shows a value from the user's files or options shows it through this."""
    if isinstance(value, str) and len(value) <= limit:
        return repr(value)
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails still gets a message
        text = f"<{type(value).__name__}>"
    if len(text) > limit + 20:
        text = text[: limit // 2] + "..." + text[-(limit // 2):]
    if isinstance(value, str):
        text += f" ({len(value):,} characters)"
    return text


class BigBatchError(Exception):
    """Base class of every error bigbatch raises on purpose."""


class ConfigError(BigBatchError, ValueError):
    """An option has an impossible value (for example ``chunk_size=0``)."""


class InputError(BigBatchError, ValueError):
    """The inputs given to a step do not match the towers or the loss (missing or extra)."""


class ShapeError(BigBatchError, ValueError):
    """A tensor has the wrong shape: a tower output that is not ``(rows, dim)``, or a
    document count that is not a multiple of the query count."""


class NonFiniteError(BigBatchError, FloatingPointError):
    """NaN or inf in an embedding or in the loss; raised before any gradient is written."""


class RankFailedError(BigBatchError, RuntimeError):
    """Another process of a ``torch.distributed`` step failed (its tower, its loss, an
    out-of-memory) with an exception that is not a bigbatch error: raised on the ranks that
    did not fail, naming the rank that did and its exception, so that no rank waits in the
    step's next collective until the timeout. The failing rank raises its own exception."""


class OutputError(BigBatchError, OSError):
    """A file or folder bigbatch writes could not be written (a full disk, no permission):
    the message names it, says how much space is free and what to do; what was there
    before is left as it was."""


class FetchError(BigBatchError, OSError):
    """A download did not give the file it should (``bigbatch data fetch``): no network, an
    address that answers with an error, a checksum that differs, an archive cut short or
    damaged. The message names the address or the file and what to do; nothing of the
    download is left behind."""


def free_space(path: str | Path) -> str:
    """The free space on the file system holding ``path`` (or its nearest existing folder),
    for messages: ``"1.2 GB free on /data"``; empty when it cannot be told."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return ""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if free >= size:
            return f"{free / size:.1f} {unit} free on {p}"
    return f"{free} bytes free on {p}"


class DataError(BigBatchError, ValueError):
    """A bad record in a data file. The message names the file, the line and the field."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        where = []
        if path is not None:
            where.append(str(path) if line is None else f"{path}:{line}")
        if field is not None:
            where.append(f"field {shown(field)}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.message = message  # without the file, line and field
        self.path = path
        self.line = line
        self.field = field
