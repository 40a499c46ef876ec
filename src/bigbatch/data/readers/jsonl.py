"""Reading JSONL files line by line with the line number, for every reader in bigbatch.data:
each line's object or what is wrong with it (:func:`iter_jsonl`), the good lines with the
bad ones as problems (:func:`jsonl_rows`; with where each line's bytes lie in the file,
:func:`jsonl_spans`, which the training-record index is made from in the same read), and
the one rule for a text field (:func:`text_field`)."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ...errors import shown
from ..records.types import Problem
from .files import open_data_file, text_too_long

__all__ = ["iter_jsonl", "open_jsonl", "LineProblem", "jsonl_rows", "jsonl_spans", "text_field",
           "parse_json"]

# a JSON escape of a UTF-16 surrogate (\ud800-\udfff): the only way one gets into a string,
# since the file itself is decoded as strict UTF-8
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class LineProblem(str):
    """What is wrong with a line (the string itself), and the ``field`` it is in when known."""

    field: str | None

    def __new__(cls, message: str, field: str | None = None) -> "LineProblem":
        self = super().__new__(cls, message)
        self.field = field
        return self


def _not_unicode(value: Any, name: str = "") -> tuple[str, str] | None:
    """(field, character) of the first string in ``value`` holding an unpaired surrogate
    (which no tokenizer, hash or UTF-8 writer accepts), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return name, value[e.start]
        return None
    items = (value.items() if isinstance(value, dict) else
             enumerate(value) if isinstance(value, list) else ())
    for k, v in items:
        sub = f"{name}[{k}]" if isinstance(k, int) else f"{name}.{k}" if name else str(k)
        found = _not_unicode(k, sub) if isinstance(k, str) else None
        found = found or _not_unicode(v, sub)
        if found:
            return found
    return None


def parse_json(text: str) -> tuple[Any, str | None]:
    """(the JSON value of ``text``, None), or (None, what is wrong with it): malformed (with
    its column), or nested deeper than Python's parser goes (a RecursionError otherwise)."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"malformed JSON at column {e.colno} ({e.msg})"
    except RecursionError:
        return None, "JSON nested too deep to read (thousands of levels); no record nests so"


def open_jsonl(path: str | Path) -> IO[str]:
    """A JSONL file opened for reading: a regular file (else a DataError naming it), decoded
    as UTF-8 with undecodable bytes kept as surrogate escapes (for the reader to report)."""
    # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first record
    return open_data_file(path, encoding="utf-8-sig", errors="surrogateescape")


def _parsed_lines(path: str | Path
                  ) -> Iterator[tuple[int, dict[str, Any] | None, LineProblem | None, int, int]]:
    """:func:`iter_jsonl`'s ``(line number, object, problem)`` with the byte offsets where the
    line starts and where the next one does, counted as the file is read: lines end as
    Python's text files end them (``\\n``, ``\\r\\n`` or a lone ``\\r``), kept as they
    are to count them and then read as text mode reads them."""
    with open_data_file(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        end, mark = 0, len(codecs.BOM_UTF8) if f.buffer.peek(3)[:3] == codecs.BOM_UTF8 else 0
        for n, line in enumerate(f, 1):
            # undecodable bytes come back from their escapes, so every byte is counted
            start, end = end, end + mark + (len(line) if line.isascii() else
                                            len(line.encode("utf-8", "surrogateescape")))
            mark = 0
            if line.endswith("\r"):
                line = line[:-1] + "\n"
            elif line.endswith("\r\n"):
                line = line[:-2] + "\n"
            if line.startswith("\ufeff"):  # files concatenated with their marks
                line = line[1:]
            if not line.strip():
                continue
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as e:  # an undecodable byte, kept as a surrogate escape
                yield n, None, LineProblem(
                    f"not UTF-8 text (byte 0x{ord(line[e.start]) - 0xDC00:02x} at column "
                    f"{e.start + 1}); re-encode the file as UTF-8"), start, end
                continue
            rec, why = parse_json(line)
            if why is not None:
                yield n, None, LineProblem(why), start, end
                continue
            if not isinstance(rec, dict):
                yield n, None, LineProblem("expected a JSON object"), start, end
                continue
            if _SURROGATE_ESCAPE.search(line):
                found = _not_unicode(rec)
                if found is not None:
                    yield (n, None, LineProblem(
                        f"holds an unpaired UTF-16 surrogate ({shown(found[1])}), which is not "
                        f"valid Unicode text; fix or remove it", field=found[0] or None),
                       start, end)
                    continue
            yield n, rec, None, start, end


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | None, LineProblem | None]]:
    """Yield ``(line number, object, None)`` for each non-empty line holding a JSON object, and
    ``(line number, None, problem)`` for one that does not (malformed JSON, not a JSON
    object, not UTF-8, or text that is not valid Unicode); the caller raises or collects.
    Malformed JSON is named with its column (the line is the line number).

    Raises:
        DataError: naming the file, when it cannot be opened or is not a regular file (a
            FIFO, a device: :func:`~bigbatch.data.readers.files.open_regular`).
    """
    for n, rec, problem, _, _ in _parsed_lines(path):
        yield n, rec, problem


def jsonl_spans(path: Path, problems: list[Problem]) -> Iterator[tuple[int, dict, int, int]]:
    """(line number, object, start, end) of each good line of a JSONL file, ``start`` and
    ``end`` the byte offsets of the line and of the next (the line's bytes are
    ``file[start:end]``); a bad line is a problem."""
    for n, rec, problem, start, end in _parsed_lines(path):
        if problem is not None:
            problems.append(Problem(str(path), n, problem.field, str(problem)))
        else:
            yield n, rec, start, end


def jsonl_rows(path: Path, problems: list[Problem]) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each good line of a JSONL file; a bad line is a problem."""
    for n, rec, _, _ in jsonl_spans(path, problems):
        yield n, rec


def text_field(rec: dict, key: str, where: tuple[str, int], problems: list[Problem],
               required: bool = True) -> str | None:
    """``rec[key]`` when it is non-empty text; else None, and a problem at ``where`` (file,
    line) unless the key is absent and not ``required``."""
    v = rec.get(key)
    if v is None:
        if required:
            problems.append(Problem(where[0], where[1], key, "missing"))
        return None
    if not isinstance(v, str) or not v.strip():
        problems.append(Problem(where[0], where[1], key, "must be non-empty text"))
        return None
    if (why := text_too_long(v)) is not None:
        problems.append(Problem(where[0], where[1], key, f"the text {why}"))
        return None
    return v
