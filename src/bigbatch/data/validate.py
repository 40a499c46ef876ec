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
(:func:`~bigbatch.data.beir.read_beir`: ids, texts, qrels).
It never stops at the first finding, and a file that cannot be read at all (missing, not
a regular file) is a finding too, so every file given is checked.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..errors import DataError
from .formats import format_of, instruction_problems, read_records
from .records import resolve_record
from .types import Problem, Record, doc_key

__all__ = ["validate_file", "validate_records"]

_LINES_NAMED = 10  # lines named in a negative-count message


def _negative_count(r: Record) -> int:
    """A record's negatives as written (those that could not be read included)."""
    return len(r.negatives) + r.unread_negatives


def _count_problems(records: list[Record]) -> list[Problem]:
    """A problem for each record whose number of negatives (as written) differs from the
    file's usual number, naming the lines that have the usual number."""
    counts = Counter(_negative_count(r) for r in records)
    if len(counts) < 2:
        return []
    usual = counts.most_common(1)[0][0]
    lines = [r.line for r in records if _negative_count(r) == usual]
    named = ", ".join(map(str, lines[:_LINES_NAMED])) + (", ..." if len(lines) > _LINES_NAMED
                                                         else "")
    return [Problem(r.source, r.line, "negatives",
                    f"{_negative_count(r)} negatives where the file usually has {usual} "
                    f"({len(lines)} record(s): line{'s' if len(lines) > 1 else ''} {named}); "
                    f"give every record the same number")
            for r in records if _negative_count(r) != usual]


def validate_records(records: list[Record], problems: list[Problem],
                     data_root: str | Path | None = None) -> list[Problem]:
    """Add the document and cross-record checks to ``problems`` (from reading); returns all.
    Documents are resolved and checked exactly as the training loader does
    (:func:`bigbatch.data.records.resolve_record`, with ``data_root``), so a clean file
    loads for training."""
    keys: dict[int, tuple] = {}
    for r in records:
        positive, _ = resolve_record(r, problems, data_root)
        if positive is not None:  # the positive's content key: its resolved path or text
            keys[id(r)] = (r.query, doc_key(positive))
    seen: dict[tuple, int] = {}  # the same query with another positive is a legitimate record
    for r in records:
        key = keys.get(id(r), (r.query, r.positive.text, r.positive.image, r.positive.path))
        if key in seen and r.line:
            problems.append(Problem(r.source, r.line, r.query_key,
                                    f"duplicate query with the same positive (first on line "
                                    f"{seen[key]})"))
        seen.setdefault(key, r.line)
    problems.extend(instruction_problems(records))
    problems.extend(_count_problems(records))
    return sorted(problems, key=lambda p: (p.path, p.line or 0))


def validate_file(path: str | Path, fmt: str | None = None, split: str = "train",
                  data_root: str | Path | None = None) -> tuple[int, list[Problem]]:
    """(number of records read, every problem) for one file or BEIR directory. A file whose
    format cannot be detected is read as training reads it (contrastors, reporting its
    problems); one that cannot be read at all (missing, not a regular file, a bad BEIR
    directory) is one problem, never an exception, so a caller checking several files
    checks them all."""
    try:
        if fmt is None and Path(path).exists():
            fmt = format_of(path)
        records, problems = read_records(path, fmt, split)
    except DataError as e:
        return 0, [Problem(e.path or str(path), e.line, e.field, e.message)]
    return len(records), validate_records(records, problems, data_root)
