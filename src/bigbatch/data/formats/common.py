"""What every file format module shares: the :class:`Format` entry each one registers, the
options writers take, and the pieces several readers and writers use (record ids, JSONL
writing; JSONL lines with their problems and text fields come from
:mod:`bigbatch.data.readers.jsonl`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...errors import shown
from ..readers.jsonl import jsonl_rows, text_field
from ..records.types import Doc, Problem, Record

# jsonl_rows and text_field are defined in bigbatch.data.readers.jsonl (the BEIR reader shares them)
# and stay importable from here
__all__ = ["Format", "WriteOptions", "RowParser", "Stream", "jsonl_stream", "read_all", "ID_KEY",
           "SCORE_KEYS", "with_scores", "add_scores",
           "jsonl_rows", "text_field", "with_ids",
           "add_ids", "write_jsonl", "text_only"]

# a column or key naming ids (query_id, negative_ids, id)
ID_KEY = re.compile(r"(^|_)ids?$", re.IGNORECASE)


@dataclass(frozen=True)
class WriteOptions:
    """What writers take beside the records: the instructions written as system messages
    where a record has none (swift), and the qrels split (beir)."""

    query_instruction: str
    doc_instruction: str
    split: str


def _holds_all(r: Record) -> str | None:
    return None


@dataclass(frozen=True)
class Format:
    """One file format: how it is recognised, read and written (an entry of the table in
    :mod:`bigbatch.data.formats`).

    ``detect_path`` recognises it from the path alone (a folder, a table file);
    ``detect_keys`` from the keys of a JSONL file's first record. ``read(path, problems,
    split)`` returns the records and adds what it finds wrong to ``problems``. ``write(records,
    out, options)`` writes records it can hold, reading the iterable ``records`` once and
    writing each record as it comes (a refusal is raised once every record was read); None
    for a format read only by conversion.
    ``cannot_hold(record)`` says why a record cannot be written without loss (None if it
    can). ``instructions``: the format holds each record's system prompts (swift).
    ``writes_folder``: the output is a folder, which relative paths are rebased against.
    ``suffixes``: the file suffixes the writer writes (the first is the usual one).
    ``stream(path, problems, split)`` yields the records one at a time; ``parse(row, path,
    line, problems)`` reads one row (formats whose training records are read lazily)."""

    name: str
    read: Callable[[Path, list[Problem], str], list[Record]]
    detect_path: Callable[[Path], bool] | None = None
    detect_keys: Callable[[set], bool] | None = None
    write: Callable[[Iterable[Record], Path, WriteOptions], None] | None = None
    cannot_hold: Callable[[Record], str | None] = _holds_all
    instructions: bool = False
    writes_folder: bool = False
    suffixes: tuple[str, ...] = (".jsonl",)
    # the records one at a time (bounded memory: what training indexes a file with), and
    # one row (a JSON object or a table row) to its record: formats with both are read
    # lazily for training (:mod:`bigbatch.data.records.store`)
    stream: Stream | None = None
    parse: RowParser | None = None


RowParser = Callable[[dict, Path, int, list[Problem]], Record | None]
Stream = Callable[[Path, list[Problem], str], Iterator[Record]]


def jsonl_stream(parse: RowParser) -> Stream:
    """A format's reader of a JSONL file, one record at a time: ``parse`` turns each good
    line's object into a record (or None, adding what is wrong to the problems); a bad line
    is a problem."""
    def stream(path: Path, problems: list[Problem], split: str = "train") -> Iterator[Record]:
        for n, rec in jsonl_rows(path, problems):
            r = parse(rec, path, n, problems)
            if r is not None:
                yield r
    return stream


def read_all(stream: Stream) -> Callable[[Path, list[Problem], str], list[Record]]:
    """A format's ``read`` (every record as a list) from its ``stream``."""
    def read(path: Path, problems: list[Problem], split: str = "train") -> list[Record]:
        return list(stream(path, problems, split))
    return read


def with_ids(rec: dict, pos: Doc, negs: list[Doc]) -> tuple[Doc, list[Doc]]:
    """The documents with the corpus ids a record gives (``positive_id``, ``negative_ids``)."""
    pid = rec.get("positive_id")
    nids = rec.get("negative_ids")
    if pid is not None:
        pos = replace(pos, id=str(pid))
    if isinstance(nids, list) and len(nids) == len(negs):
        negs = [replace(d, id=None if i is None else str(i)) for d, i in zip(negs, nids)]
    return pos, negs


def add_ids(rec: dict[str, Any], r: Record) -> None:
    """The record's ids as ``query_id``, ``positive_id``, ``negative_ids`` (when known)."""
    if r.query_id is not None:
        rec["query_id"] = r.query_id
    if r.positive.id is not None:
        rec["positive_id"] = r.positive.id
    if r.negatives and all(d.id is not None for d in r.negatives):
        rec["negative_ids"] = [d.id for d in r.negatives]


SCORE_KEYS = ("pos_score", "neg_scores")
"""The keys of a record's teacher scores in the JSONL formats (contrastors, swift): the
positive's score, then a list with one score per negative, in the negatives' order."""


def _score(v: Any, key: str, where: tuple[str, int], problems: list[Problem]) -> float | None:
    """``v`` as a finite float (a number, or a number's text, as CSV holds it); else None
    and a problem naming ``key``."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        problems.append(Problem(where[0], where[1], key, f"a teacher score must be a number, "
                                f"got {shown(v)}"))
        return None
    if not math.isfinite(v):
        problems.append(Problem(where[0], where[1], key, f"{v} is not a finite number; a "
                                f"teacher score must be one (fix or drop the record)"))
        return None
    return float(v)


def with_scores(pos_value: Any, neg_values: Any, neg_fields: str | list[str], pos: Doc,
                negs: list[Doc], written: int, where: tuple[str, int], problems: list[Problem],
                pos_field: str = "pos_score") -> tuple[Doc, list[Doc]]:
    """The documents with the teacher scores a record gives: ``pos_value`` (the positive's)
    and ``neg_values`` (a list, one per negative as written: ``written`` of them). Both
    absent (None): the documents as they are. ``neg_fields``: the key of the list (its
    items are named ``key[i]``), or one name per value (columns). Each problem (one without
    the other, a count that is not the negatives', a value that is not a finite number) is
    added with file, line and field, and no score is kept."""
    if pos_value is None and neg_values is None:
        return pos, negs
    list_key = neg_fields if isinstance(neg_fields, str) else "neg_scores"
    if pos_value is None or neg_values is None:
        missing, given = (pos_field, list_key) if pos_value is None else (list_key, pos_field)
        problems.append(Problem(where[0], where[1], missing, f"missing, but {given} is given: "
                                f"teacher scores need the positive's and one per negative"))
        return pos, negs
    if not isinstance(neg_values, list):
        problems.append(Problem(where[0], where[1], list_key, "must be a list of numbers, one "
                                "teacher score per negative"))
        return pos, negs
    if len(neg_values) != written:
        problems.append(Problem(where[0], where[1], list_key, f"{len(neg_values)} teacher "
                                f"score(s) for {written} negative(s); give one score per "
                                f"negative, in the negatives' order"))
        return pos, negs
    names = [f"{neg_fields}[{i}]" for i in range(written)] if isinstance(neg_fields, str) \
        else neg_fields
    pos_score = _score(pos_value, pos_field, where, problems)
    scores = [_score(v, k, where, problems) for v, k in zip(neg_values, names)]
    if pos_score is None or None in scores or len(negs) != written:
        return pos, negs
    return (replace(pos, score=pos_score),
            [replace(d, score=sc) for d, sc in zip(negs, scores)])


def add_scores(rec: dict[str, Any], r: Record) -> None:
    """The record's teacher scores as ``pos_score`` and ``neg_scores`` (when it has them)."""
    if r.positive.score is not None and all(d.score is not None for d in r.negatives):
        rec["pos_score"] = r.positive.score
        rec["neg_scores"] = [d.score for d in r.negatives]


def write_jsonl(out: Path, rows: Iterable[dict[str, Any]]) -> None:
    """One JSON object a line (UTF-8, not ASCII-escaped), creating the folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for rec in rows:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def text_only(fmt: str, r: Record) -> str | None:
    """Why a text-only format ``fmt`` cannot hold ``r`` (a document that is not text), or None."""
    kinds = sorted({d.kind for d in (r.positive, *r.negatives) if d.kind != "text"})
    if kinds:
        return f"{fmt} holds text documents only (this record has {', '.join(kinds)})"
    return None
