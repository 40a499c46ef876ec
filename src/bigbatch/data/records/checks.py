"""The checks of ``bigbatch validate``, one record at a time in bounded memory.

:class:`RecordChecks` takes the records of a source as they are read (:meth:`~RecordChecks.add`)
and keeps no record: each one's documents are resolved and checked as training checks
them, and what the checks across records need is kept as counts or hashes:

- duplicate queries (the same query with the same positive): an 8-byte hash of each
  record's (query, positive) key, compared by sorting once at the end (a false duplicate
  needs two of 2**64 hashes to collide);
- negative counts that differ from the file's usual count: a histogram of the counts and
  the first lines of each;
- system prompts (swift): their counts per side
  (:class:`~bigbatch.data.formats.instructions.SystemCounts`).

Only when one of these finds something are the records read a second time (``rescan``) to
name each record concerned with its file, line and field; a clean source is read once. The
problems are reported in the order a list of every record gave them: by file and line, and
in one line as reading, the documents, duplicates, system prompts, negative counts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from ...errors import DataError
from ..formats.instructions import SystemCounts
from .loader import resolve_record
from .types import Problem, Record, doc_key

__all__ = ["RecordChecks", "negative_count"]

LINES_NAMED = 10  # lines named in a negative-count message


def negative_count(r: Record) -> int:
    """A record's negatives as written (those that could not be read included)."""
    return len(r.negatives) + r.unread_negatives


def _hash(key: tuple) -> int:
    """An 8-byte hash of a duplicate key (a tuple of strings and Nones)."""
    data = repr(key).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class RecordChecks:
    """Every check of ``bigbatch validate`` over records given one at a time (see the
    module). ``data_root``: as :func:`~bigbatch.data.records.loader.resolve_record`."""

    def __init__(self, data_root: str | Path | None = None) -> None:
        self.data_root = data_root
        self.count = 0  # records added
        self._documents: list[Problem] = []  # documents, and what a record cannot hold
        self._hashes = array("Q")  # per record, its duplicate key's hash
        self._negatives: Counter = Counter()  # negatives as written -> records
        self._lines: dict[int, list[int]] = {}  # negatives as written -> first lines
        self._systems = SystemCounts()
        self._prompts: list[Problem] = []  # documents whose system prompt differs

    def add(self, r: Record) -> None:
        """Check one record; what only the whole source shows is counted for :meth:`problems`."""
        positive, _ = resolve_record(r, self._documents, self.data_root)
        # the positive's content key: its resolved path or text (else as written)
        key = (r.query, doc_key(positive)) if positive is not None else \
            (r.query, r.positive.text, r.positive.image, r.positive.path)
        self._hashes.append(_hash(key))
        n = negative_count(r)
        self._negatives[n] += 1
        lines = self._lines.setdefault(n, [])
        if len(lines) < LINES_NAMED:
            lines.append(r.line)
        self._systems.add(r)
        self._prompts.extend(self._systems.document_problems(r))
        self.count += 1

    def _duplicates(self) -> dict[int, int]:
        """{record: the first record with its key}, records numbered as added."""
        h = np.frombuffer(self._hashes, np.uint64) if self.count else np.zeros(0, np.uint64)
        order = np.argsort(h, kind="stable")  # equal keys stay in record order
        h = h[order]
        same = h[1:] == h[:-1]
        if not same.any():
            return {}
        starts = np.where(np.concatenate([[True], ~same]), np.arange(len(h)), 0)
        first = order[np.maximum.accumulate(starts)]
        return {int(i): int(f) for i, f in zip(order[1:][same], first[1:][same])}

    def problems(self, read: list[Problem], rescan: Callable[[], Iterable[Record]]
                 ) -> list[Problem]:
        """Every problem, sorted by file and line: ``read`` (the reader's), then the
        documents', then those across records, for which ``rescan`` gives the records again
        (in the order added) when one was found.

        Raises:
            DataError: ``rescan`` gives other records (the source changed meanwhile).
        """
        duplicates = self._duplicates()
        usual = self._negatives.most_common(1)[0][0] if len(self._negatives) > 1 else None
        differ = self._systems.differ()
        found: list[Problem] = []
        if duplicates or usual is not None or differ:
            found = self._rescan(rescan, duplicates, usual, differ)
        else:
            found = self._prompts
        return sorted(read + self._documents + found, key=lambda p: (p.path, p.line or 0))

    def _rescan(self, rescan: Callable[[], Iterable[Record]], duplicates: dict[int, int],
                usual: int | None, differ: bool) -> list[Problem]:
        """The problems across records, naming each record (a second reading)."""
        firsts = set(duplicates.values())
        first_line: dict[int, int] = {}
        dup: list[Problem] = []
        prompts: list[Problem] = [] if differ else self._prompts
        counts: list[Problem] = []
        if usual is not None:
            shown = self._lines[usual]
            named = ", ".join(map(str, shown)) + (", ..." if self._negatives[usual] >
                                                  LINES_NAMED else "")
            many = "s" if self._negatives[usual] > 1 else ""
            where = f"({self._negatives[usual]} record(s): line{many} {named})"
        i = -1
        for i, r in enumerate(rescan()):
            if i >= self.count:
                break
            if i in firsts:
                first_line[i] = r.line
            if i in duplicates and r.line:
                dup.append(Problem(r.source, r.line, r.query_key, f"duplicate query with the "
                                   f"same positive (first on line "
                                   f"{first_line[duplicates[i]]})"))
            if differ:
                prompts.extend(self._systems.problems(r))
            n = negative_count(r)
            if usual is not None and n != usual:
                counts.append(Problem(r.source, r.line, "negatives", f"{n} negatives where the "
                                      f"file usually has {usual} {where}; give every record "
                                      f"the same number"))
        if i + 1 != self.count:
            raise DataError(f"changed while it was read: {self.count} records, then {i + 1}; "
                            f"validate it again once it is written")
        return dup + prompts + counts
