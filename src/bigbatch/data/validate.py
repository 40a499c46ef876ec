"""``bigbatch validate``: every problem in training files, with file, line and field.

Checks, in every format of :mod:`bigbatch.data.formats`: malformed JSON, missing keys,
empty text, image or text files that are missing or unreadable, a negative equal to the
positive, duplicate queries (the same query with the same positive; a query with several
positives is legitimate), and negative counts that differ from the file's usual count.
It never stops at the first finding.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .formats import Doc, Problem, Record, read_records

__all__ = ["validate_file", "validate_records"]

_IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"MM\x00*")


def _check_file(doc: Doc, base: Path, where: tuple[str, int], field: str,
                problems: list[Problem]) -> None:
    ref = doc.image or doc.path
    if ref is None:
        return
    p = Path(ref)
    p = p if p.is_absolute() else base / p
    try:
        with open(p, "rb") as f:
            head = f.read(16)
    except OSError as e:
        problems.append(Problem(where[0], where[1], field, f"cannot read {ref!r}: "
                                f"{e.strerror or e}"))
        return
    if doc.image:
        if not head.startswith(_IMAGE_MAGIC):
            problems.append(Problem(where[0], where[1], field, f"{ref!r} is not a readable "
                                    f"image (unknown file signature)"))
    elif not head.strip():
        problems.append(Problem(where[0], where[1], field, f"{ref!r} is empty"))


def _same(a: Doc, b: Doc) -> bool:
    return (a.text, a.image, a.path) == (b.text, b.image, b.path)


def validate_records(records: list[Record], problems: list[Problem]) -> list[Problem]:
    """Add the cross-record and file checks to ``problems`` (from reading); returns all."""
    for r in records:
        base = Path(r.source).parent
        w = (r.source, r.line)
        _check_file(r.positive, base, w, "positive", problems)
        for i, d in enumerate(r.negatives):
            _check_file(d, base, w, f"negatives[{i}]", problems)
            if _same(d, r.positive):
                problems.append(Problem(r.source, r.line, f"negatives[{i}]",
                                        "a negative equals the positive"))
    seen: dict[tuple, int] = {}  # the same query with another positive is a legitimate record
    for r in records:
        key = (r.query, r.positive.text, r.positive.image, r.positive.path)
        if key in seen and r.line:
            problems.append(Problem(r.source, r.line, "query",
                                    f"duplicate query with the same positive (first on line "
                                    f"{seen[key]})"))
        seen.setdefault(key, r.line)
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
