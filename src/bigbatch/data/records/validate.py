"""``bigbatch validate``: every problem in training files, with file, line and field.

Checks, in every format of :mod:`bigbatch.data.formats`: malformed JSON (with its column),
missing keys, empty text, text that is not valid Unicode, a file without records, image or
text files that are missing or unreadable (each checked as the training loader checks it:
images opened and verified by Pillow and within the aspect ratio the vision-language image
processors accept, text files read from regular files of bounded size and decoded as UTF-8;
with a data root, files outside it), a negative equal to the positive (as training compares
them: resolved paths, file contents, texts), duplicate queries (the same query with the same
positive; a query with several positives is legitimate), negative counts that differ from
the file's usual count (naming the lines that have the usual one), and system prompts
(swift) that differ between records or between a record's documents (bigbatch applies one
instruction per side). BEIR directories are checked as training reads them
(:func:`~bigbatch.data.readers.beir_dir.read_beir`: ids, texts, qrels).
It never stops at the first finding, and a file that cannot be read at all (missing, not
a regular file) is a finding too, so every file given is checked.

A file is streamed, one record at a time, and no record is kept: memory stays bounded
whatever the number of records (a few bytes per record for the duplicate check, plus the
problems found). The checks across records are counted as it goes
(:class:`~bigbatch.data.records.checks.RecordChecks`); only a file where one of them finds
something is read a second time, to name each record concerned.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import DataError
from ..formats import format_of, stream_records
from .checks import RecordChecks
from .types import Problem, Record

__all__ = ["validate_file", "validate_records"]


def validate_records(records: list[Record], problems: list[Problem],
                     data_root: str | Path | None = None) -> list[Problem]:
    """Add the document and cross-record checks to ``problems`` (from reading); returns all,
    sorted by file and line. Documents are resolved and checked exactly as the training
    loader does (:func:`bigbatch.data.records.loader.resolve_record`, with ``data_root``), so a
    clean file loads for training. (:func:`validate_file` checks a file without a list.)"""
    checks = RecordChecks(data_root)
    for r in records:
        checks.add(r)
    found = checks.problems(list(problems), lambda: records)
    problems[:] = found
    return list(found)


def validate_file(path: str | Path, fmt: str | None = None, split: str = "train",
                  data_root: str | Path | None = None) -> tuple[int, list[Problem]]:
    """(number of records read, every problem) for one file or BEIR directory, read one
    record at a time in bounded memory (see the module). A file whose format cannot be
    detected is read as training reads it (contrastors, reporting its problems); one that
    cannot be read at all (missing, not a regular file, a bad BEIR directory) is one
    problem, never an exception, so a caller checking several files checks them all."""
    try:
        if fmt is None and Path(path).exists():
            fmt = format_of(path)
        read: list[Problem] = []
        checks = RecordChecks(data_root)
        for r in stream_records(path, fmt, split, read):
            checks.add(r)
        return checks.count, checks.problems(read, lambda: stream_records(path, fmt, split, []))
    except DataError as e:
        return 0, [Problem(e.path or str(path), e.line, e.field, e.message)]
