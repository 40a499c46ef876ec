"""BEIR directories: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``.

Documents are "title text" (title and text joined by a space, as MTEB and BEIR encode
them). Malformed lines raise :class:`bigbatch.errors.DataError` naming file, line and field.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError
from .images import check_image
from .jsonl import iter_jsonl
from .types import Doc, ImageDoc, Record, TrainRecord, problem_lines

__all__ = ["BeirData", "load_beir", "load_qrels", "load_queries", "read_beir",
           "beir_training_records", "doc_text", "corpus_doc"]


def doc_text(rec: dict) -> str:
    """A BEIR corpus record as one string: "title text" (just the text without a title)."""
    title = (rec.get("title") or "").strip()
    text = rec.get("text") or ""
    return f"{title} {text}" if title else text


def corpus_doc(rec: dict, root: Path) -> str | ImageDoc:
    """The document a corpus record stands for: its page image when it has an ``image``
    field (a path relative to the corpus folder), else its text (:func:`doc_text`)."""
    image = rec.get("image")
    if isinstance(image, str) and image:
        p = Path(image)
        return ImageDoc(str((p if p.is_absolute() else root / p).resolve()))
    return doc_text(rec)


def _read_jsonl(path: Path, required: tuple[str, ...]) -> list[tuple[int, dict]]:
    if not path.exists():
        raise DataError("file not found", path=str(path))
    out = []
    for n, rec, problem in iter_jsonl(path):
        if problem is not None:
            raise DataError(problem, path=str(path), line=n, field=problem.field)
        for key in required:
            if key not in rec:
                raise DataError("missing key", path=str(path), line=n, field=key)
        out.append((n, rec))
    return out


def load_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """``{query_id: {doc_id: relevance}}`` from a BEIR qrels TSV (header line skipped; a
    UTF-8 byte-order mark is skipped too). Relevance is an integer grade, as trec_eval and
    BEIR read it: a fractional score is an error rather than silently truncated."""
    path = Path(path)
    if not path.exists():
        raise DataError("qrels file not found", path=str(path))
    qrels: dict[str, dict[str, int]] = {}
    with open(path, encoding="utf-8-sig", newline="") as f:
        for n, row in enumerate(csv.reader(f, delimiter="\t"), 1):
            if n == 1 and row and row[0] in ("query-id", "query_id", "qid"):
                continue
            if not row:
                continue
            if len(row) < 3:
                raise DataError("expected query-id<TAB>corpus-id<TAB>score", path=str(path),
                                line=n)
            try:
                value = float(row[2])
            except ValueError as e:
                raise DataError(f"score {row[2]!r} is not a number", path=str(path), line=n,
                                field="score") from e
            if not value.is_integer():
                raise DataError(f"score {row[2]!r} is not an integer relevance grade "
                                f"(trec_eval and BEIR read grades as integers; round them "
                                f"first)", path=str(path), line=n, field="score")
            score = int(value)
            qrels.setdefault(row[0], {})[row[1]] = score
    return qrels


def load_queries(path: str | Path, wanted: set[str] | None = None) -> dict[str, str]:
    """``{query_id: text}`` from queries.jsonl, only ``wanted`` ids when given.

    Raises:
        DataError: a malformed line, or a wanted id that is missing.
    """
    path = Path(path)
    queries = {str(r["_id"]): r["text"] for _, r in _read_jsonl(path, ("_id", "text"))
               if wanted is None or str(r["_id"]) in wanted}
    if wanted is not None:
        missing = sorted(wanted - set(queries))
        if missing:
            raise DataError(f"{len(missing)} query ids of the qrels are not in queries.jsonl "
                            f"(first: {missing[0]!r})", path=str(path))
    return queries


@dataclass
class BeirData:
    """A loaded BEIR split: ``corpus`` {doc_id: "title text"}, ``queries`` {query_id: text}
    (only those in the split's qrels), ``qrels`` {query_id: {doc_id: relevance}}."""

    root: Path
    split: str
    corpus: dict[str, str]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]


_CORPUS_CACHE: dict[Path, dict[str, str]] = {}


def load_beir(root: str | Path, split: str = "test") -> BeirData:
    """Load a BEIR directory's corpus, the queries listed in ``qrels/<split>.tsv`` and the qrels.

    Raises:
        DataError: a missing file, malformed line, or a qrels id not in corpus/queries.
    """
    root = Path(root)
    qrels = load_qrels(root / "qrels" / f"{split}.tsv")
    key = (root / "corpus.jsonl").resolve()
    if key not in _CORPUS_CACHE:
        _CORPUS_CACHE[key] = {str(r["_id"]): corpus_doc(r, root)
                              for _, r in _read_jsonl(root / "corpus.jsonl", ("_id", "text"))}
    corpus = _CORPUS_CACHE[key]
    queries = load_queries(root / "queries.jsonl", set(qrels))
    missing_d = sorted({d for rel in qrels.values() for d in rel if d not in corpus})
    if missing_d:
        raise DataError(f"{len(missing_d)} corpus ids of qrels/{split}.tsv are not in "
                        f"corpus.jsonl (first: {missing_d[0]!r})", path=str(root / "corpus.jsonl"))
    return BeirData(root, split, corpus, queries, qrels)


def read_beir(root: str | Path, split: str = "train") -> list[Record]:
    """The (query, positive) pairs of a BEIR split as records, in the order of the qrels
    file: one per relevant qrel (score > 0), with the query and corpus ids, the document's
    text ("title text") or its page image, and ``root`` as the source. The one way a BEIR
    directory becomes records: conversion, validation and training read it here.

    Raises:
        DataError: as :func:`load_beir`.
    """
    data = load_beir(root, split)
    out = []
    for qid, rels in data.qrels.items():
        for did, score in rels.items():
            if score > 0:
                doc = data.corpus[did]
                doc = Doc(image=doc.path, id=did) if isinstance(doc, ImageDoc) else \
                    Doc(text=doc, id=did)
                out.append(Record(data.queries[qid], doc, [], qid, 0, str(Path(root))))
    return out


def beir_training_records(root: str | Path, split: str = "train") -> list[TrainRecord]:
    """Training records from a BEIR split (:func:`read_beir`), sorted by query id (shorter
    first) and document id, with ``qrels/<split>.tsv`` as their source.

    Raises:
        DataError: as :func:`load_beir`, or listing the page images that cannot be read.
    """
    source = str(Path(root) / "qrels" / f"{split}.tsv")
    records = [TrainRecord(query=r.query,
                           positive=ImageDoc(r.positive.image) if r.positive.image else
                           r.positive.text or "",
                           negatives=[], positive_id=r.positive.id or "", source=source,
                           line=0, query_id=r.query_id or "")
               for r in sorted(read_beir(root, split), key=_by_ids)]
    _check_images(records, Path(root) / "corpus.jsonl")
    return records


def _by_ids(r: Record) -> tuple[int, str, str]:
    """Training order: query ids by length, then as text (1, 2, 10), then document ids."""
    qid, did = r.query_id or "", r.positive.id or ""
    return len(qid), qid, did


def _check_images(records: list[TrainRecord], corpus_path: Path) -> None:
    """Every page image the records use must open, or the run stops before training."""
    seen: set[str] = set()
    problems = []
    for r in records:
        if isinstance(r.positive, ImageDoc) and r.positive.path not in seen:
            seen.add(r.positive.path)
            why = check_image(r.positive.path)
            if why is not None:
                problems.append(f"document {r.positive_id!r}: {why}")
    if problems:
        raise DataError(f"{len(problems)} unreadable page image(s):\n  "
                        + "\n  ".join(problem_lines(problems)), path=str(corpus_path),
                        field="image")
