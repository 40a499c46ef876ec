"""Exceptions a user can cause, each with a message that names the option, tower, file or field.

Every error bigbatch raises on purpose derives from :class:`BigBatchError`, so a caller
can catch them all at once; each also derives from the built-in exception a Python
user would expect (``ValueError`` for bad values, ``FloatingPointError`` for
non-finite numbers), so existing ``except ValueError`` blocks keep working.
"""

from __future__ import annotations

__all__ = [
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


class DataError(BigBatchError, ValueError):
    """A bad record in a data file. The message names the file, the line and the field."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        where = []
        if path is not None:
            where.append(str(path) if line is None else f"{path}:{line}")
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.message = message  # without the file, line and field
        self.path = path
        self.line = line
        self.field = field
