"""``bigbatch validate``: every problem in training files, with file, line and field.

Checks, in every format of :mod:`bigbatch.data.formats`: malformed JSON, missing keys,
empty text, text that is not valid Unicode, image or text files that are missing or
unreadable (each checked as the training loader checks it: images opened and verified by
Pillow, text files decoded as UTF-8), a negative equal to the positive (as training compares
them: resolved paths, file contents, texts), duplicate queries (the same query with the same positive; a query with several
positives is legitimate), negative counts that differ from the file's usual count, and
system prompts (swift) that differ between records or between a record's documents (bigbatch
applies one instruction per side).
It never stops at the first finding.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .formats import instruction_problems, read_records
from .records import resolve_record
from .types import Problem, Record, doc_key

__all__ = ["validate_file", "validate_records"]


def validate_records(records: list[Record], problems: list[Problem]) -> list[Problem]:
    """Add the document and cross-record checks to ``problems`` (from reading); returns all.
    Documents are resolved and checked exactly as the training loader does
    (:func:`bigbatch.data.records.resolve_record`), so a clean file loads for training."""
    keys: dict[int, tuple] = {}
    for r in records:
        positive, _ = resolve_record(r, problems)
        if positive is not None:  # the positive's content key: its resolved path or text
            keys[id(r)] = (r.query, doc_key(positive))
    seen: dict[tuple, int] = {}  # the same query with another positive is a legitimate record
    for r in records:
        key = keys.get(id(r), (r.query, r.positive.text, r.positive.image, r.positive.path))
        if key in seen and r.line:
            problems.append(Problem(r.source, r.line, "query",
                                    f"duplicate query with the same positive (first on line "
                                    f"{seen[key]})"))
        seen.setdefault(key, r.line)
    problems.extend(instruction_problems(records))
    counts = Counter(len(r.negatives) for r in records)
    if len(counts) > 1:
        usual = counts.most_common(1)[0][0]
        for r in records:
            if len(r.negatives) != usual:
                problems.append(Problem(r.source, r.line, "negatives",
                                        f"{len(r.negatives)} negatives where the file usually "
                                        f"has {usual}"))
    return sorted(problems, key=lambda p: (p.path, p.line or 0))


def validate_file(path: str | Path, fmt: str | None = None,
                  split: str = "train") -> tuple[int, list[Problem]]:
    """(number of records read, every problem) for one file or BEIR directory."""
    records, problems = read_records(path, fmt, split)
    return len(records), validate_records(records, problems)
