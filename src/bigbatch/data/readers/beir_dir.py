"""BEIR directories: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``.

Documents are "title text" (title and text joined by a space, as MTEB and BEIR encode
them). Problems raise :class:`bigbatch.errors.DataError` naming file, line and field (every
one, listed), or are collected for ``bigbatch validate``:

- every line of ``corpus.jsonl`` and ``queries.jsonl``: a JSON object with a unique ``_id``
  (a document listed twice is retrieved twice: recall and nDCG above 1) and a ``text``
  string (``title`` a string or null, ``image`` a path);
- the texts training and evaluation use, by the rule of the JSONL records
  (:func:`~bigbatch.data.readers.jsonl.text_field`): a query of the split's qrels must have
  non-empty text, and the document of a training pair must not be empty;
- qrels: integer grades; a training split must hold a relevant judgement (score > 0), and
  the ids it names must be in the corpus and the queries.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import DataError, shown
from ..records.image_checks import check_image
from ..records.types import Doc, ImageDoc, Problem, Record, TrainRecord, problem_lines
from .files import open_data_file, outside_root, text_too_long
from .jsonl import iter_jsonl, jsonl_rows, text_field

__all__ = ["iter_corpus", "count_records", "corpus_texts", "BeirData", "load_beir", "load_qrels",
           "load_queries", "read_beir",
           "beir_training_records", "doc_text", "corpus_doc", "check_corpus_ids",
           "require_split"]


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


def _splits(qrels_dir: Path) -> str:
    """The splits a qrels folder holds, for messages."""
    names = sorted(p.stem for p in qrels_dir.glob("*.tsv")) if qrels_dir.is_dir() else []
    return f"splits there: {', '.join(names)}" if names else f"no qrels in {qrels_dir}"


def require_split(root: str | Path, split: str, option: str) -> Path:
    """``root/qrels/<split>.tsv``, for a split an option (``option``, named in the message)
    asks for.

    Raises:
        DataError: the file is missing, naming the splits there are.
    """
    path = Path(root) / "qrels" / f"{split}.tsv"
    if not path.is_file():
        raise DataError(f"{option} {shown(split)}: there is no qrels/{split}.tsv "
                        f"({_splits(path.parent)}); name one of those", path=str(root))
    return path


# a qrels file's header names: the first column's, and the relevance column's
_QUERY_NAMES = {"query-id", "query_id", "queryid", "qid", "query", "topic"}
_SCORE_NAMES = {"score", "relevance", "rel", "label", "grade", "judgement", "judgment"}
# the layouts of a qrels file, by column count: (query, document, relevance) columns, name
QRELS_LAYOUTS = {
    3: (0, 1, 2, "BEIR's query-id<TAB>corpus-id<TAB>score"),
    4: (0, 2, 3, "TREC's query-id 0 doc-id relevance"),
}
_LAYOUT_HELP = ("qrels hold BEIR's query-id<TAB>corpus-id<TAB>score (3 columns, a "
                "header line first) or TREC's query-id 0 doc-id relevance (4 columns, tabs or "
                "spaces, no header)")


def _qrels_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(line, fields) of each non-empty line of a qrels file: split at tabs, or at runs of
    spaces in a line without a tab (trec_eval's whitespace-separated form)."""
    with open_data_file(path, encoding="utf-8-sig", errors="surrogateescape",
                        newline="") as f:
        for n, row in enumerate(csv.reader(f, delimiter="\t"), 1):
            if len(row) == 1:
                row = row[0].split()
            if row and any(v.strip() for v in row):
                yield n, [v.strip() for v in row]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_header(row: list[str]) -> bool:
    """Whether a first line names the columns (its relevance is no number, and it names the
    query or the relevance column as BEIR, TREC or a common spelling does)."""
    return not _is_number(row[-1]) and (row[0].lower() in _QUERY_NAMES
                                        or row[-1].lower() in _SCORE_NAMES)


def load_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """``{query_id: {doc_id: relevance}}`` from a qrels file, its layout detected as
    :data:`QRELS_LAYOUTS` lists: BEIR's 3 columns (a header line first, skipped; a UTF-8
    byte-order mark too) or TREC's 4 (``qid 0 pid rel``, as MS MARCO and trec_eval write
    them, with or without a header), read as trec_eval reads them. Relevance is an integer
    grade, as trec_eval and BEIR read it: a fractional score is an error rather than
    silently truncated.

    Raises:
        DataError: a missing file; another column count (a TREC run file, say), or lines of
            different layouts, naming the line; a relevance that is no integer.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"qrels file not found ({_splits(path.parent)})", path=str(path))
    qrels: dict[str, dict[str, int]] = {}
    layout: tuple[int, int] | None = None  # (columns, the line that set them)
    for n, row in _qrels_rows(path):
        if layout is None:
            if len(row) not in QRELS_LAYOUTS:
                run = "; it looks like a TREC run file (qid Q0 doc rank score tag), not " \
                      "qrels" if len(row) == 6 else ""
                raise DataError(f"{len(row)} column(s){run}; {_LAYOUT_HELP}", path=str(path),
                                line=n)
            layout = (len(row), n)
            if _is_header(row):
                continue
        if len(row) != layout[0]:
            raise DataError(f"{len(row)} column(s), but line {layout[1]} has {layout[0]} "
                            f"({QRELS_LAYOUTS[layout[0]][3]}): one file holds one layout "
                            f"({_LAYOUT_HELP})", path=str(path), line=n)
        qcol, dcol, scol, _ = QRELS_LAYOUTS[layout[0]]
        text = row[scol]
        if not _is_number(text):
            raise DataError(f"score {shown(text)} is not a number ({_LAYOUT_HELP})",
                            path=str(path), line=n, field="score")
        value = float(text)
        if not math.isfinite(value) or not value.is_integer():
            raise DataError(f"score {shown(text)} is not an integer relevance grade "
                            f"(trec_eval and BEIR read grades as integers; round them "
                            f"first)", path=str(path), line=n, field="score")
        if not row[qcol] or not row[dcol]:
            raise DataError("an empty query or document id", path=str(path), line=n)
        qrels.setdefault(row[qcol], {})[row[dcol]] = int(value)
    return qrels


def _id_lines(path: Path, problems: list[Problem]) -> Iterator[tuple[int, str | None, dict]]:
    """(line, id, object) of each JSON line of a BEIR corpus or queries file. The id is None
    for a line whose ``_id`` is missing, not a string or integer, or a repeat of an earlier
    line's; each is a problem naming the line (and the first line, for a repeat)."""
    if not path.exists():
        problems.append(Problem(str(path), None, None, "file not found"))
        return
    first: dict[str, int] = {}
    for n, rec in jsonl_rows(path, problems):
        v = rec.get("_id")
        if v is None or isinstance(v, bool) or not isinstance(v, (str, int)) or not str(v):
            problems.append(Problem(str(path), n, "_id", "missing" if v is None else
                                    "must be a non-empty string (or integer) id"))
            yield n, None, rec
        elif str(v) in first:
            problems.append(Problem(str(path), n, "_id", f"duplicate id {shown(str(v))} (first on "
                                    f"line {first[str(v)]}): remove the repeated line or give "
                                    f"it its own id (a document listed twice is retrieved "
                                    f"twice, and recall and nDCG go above 1)"))
            yield n, None, rec
        else:
            first[str(v)] = n
            yield n, str(v), rec


def _string(rec: dict, key: str, where: tuple[str, int], problems: list[Problem],
            required: bool = False) -> bool:
    """Whether ``rec[key]`` is a string (absent or null allowed unless ``required``); a
    problem at ``where`` when not."""
    v = rec.get(key)
    if isinstance(v, str) and (why := text_too_long(v)) is not None:
        problems.append(Problem(where[0], where[1], key, f"the text {why}"))
        return False
    if isinstance(v, str) or (v is None and not required):
        return True
    problems.append(Problem(where[0], where[1], key, "missing" if key not in rec else
                            f"must be text, not {'null' if v is None else type(v).__name__}"))
    return False


@dataclass
class _Corpus:
    """A corpus as read: each good document by id, and the line of every id."""

    docs: dict[str, str | ImageDoc]
    lines: dict[str, int]


# corpora read without a problem, by resolved path, size and modification time
_CORPUS_CACHE: dict[tuple, _Corpus] = {}


def _read_corpus(root: Path, problems: list[Problem]) -> _Corpus:
    """The documents of ``root/corpus.jsonl``; problems added to ``problems``."""
    path = root / "corpus.jsonl"
    key: tuple = ()
    if path.exists():
        st = os.stat(path)
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key in _CORPUS_CACHE:
            return _CORPUS_CACHE[key]
    corpus = _Corpus({}, {})
    before = len(problems)
    for n, did, rec in _id_lines(path, problems):
        w = (str(path), n)
        fine = [_string(rec, "text", w, problems, required=True),
                _string(rec, "title", w, problems)]
        image = rec.get("image")
        if image is not None and (not isinstance(image, str) or not image.strip()):
            problems.append(Problem(str(path), n, "image", "must be a non-empty path"))
            fine.append(False)
        if did is not None:
            corpus.lines[did] = n
            if all(fine):
                corpus.docs[did] = corpus_doc(rec, root)
    if key and len(problems) == before:
        _CORPUS_CACHE[key] = corpus
    return corpus


def _read_queries(path: Path, wanted: set[str] | None, problems: list[Problem]
                  ) -> tuple[dict[str, str], dict[str, int]]:
    """({query_id: text} of the ``wanted`` queries (all when None), {query_id: line} of every
    query). A wanted query's text must be non-empty text, every other line's a string."""
    queries: dict[str, str] = {}
    lines: dict[str, int] = {}
    for n, qid, rec in _id_lines(path, problems):
        if qid is not None:
            lines[qid] = n
        if qid is not None and (wanted is None or qid in wanted):
            text = text_field(rec, "text", (str(path), n), problems)
            if text is not None:
                queries[qid] = text
        else:
            _string(rec, "text", (str(path), n), problems, required=True)
    return queries, lines


def _missing(ids: set[str], known: dict[str, int], what: str, split: str,
             path: Path) -> list[Problem]:
    """The ids of the qrels absent from a corpus or queries file (one problem)."""
    missing = sorted(ids - set(known))
    if not missing or not path.exists():
        return []
    return [Problem(str(path), None, None, f"{len(missing)} {what} ids of qrels/{split}.tsv "
                    f"are not in {path.name} (first: {shown(missing[0])})")]


def _raise(problems: list[Problem], where: Path) -> None:
    """A DataError for ``problems``: the one problem as it is, or all of them listed."""
    if len(problems) == 1:
        p = problems[0]
        raise DataError(p.message, path=p.path, line=p.line, field=p.field)
    if problems:
        raise DataError(f"{len(problems)} problem(s) in the BEIR data:\n  "
                        + "\n  ".join(problem_lines(problems)), path=str(where))


def load_queries(path: str | Path, wanted: set[str] | None = None) -> dict[str, str]:
    """``{query_id: text}`` from queries.jsonl, only ``wanted`` ids when given.

    Raises:
        DataError: a malformed line, a missing or repeated id, a text that is not a string
            (or empty, for a wanted query), or a wanted id that is missing.
    """
    path = Path(path)
    if not path.exists():
        raise DataError("file not found", path=str(path))
    problems: list[Problem] = []
    queries, lines = _read_queries(path, wanted, problems)
    if wanted is not None and not problems:
        missing = sorted(wanted - set(lines))
        if missing:
            raise DataError(f"{len(missing)} query ids of the qrels are not in queries.jsonl "
                            f"(first: {shown(missing[0])})", path=str(path))
    _raise(problems, path)
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


def _load(root: Path, split: str, problems: list[Problem]) -> tuple[BeirData, _Corpus]:
    """A split and its corpus (with lines); problems added to ``problems``."""
    qrels = load_qrels(root / "qrels" / f"{split}.tsv")
    corpus = _read_corpus(root, problems)
    queries, query_lines = _read_queries(root / "queries.jsonl", set(qrels), problems)
    problems.extend(_missing(set(qrels), query_lines, "query", split, root / "queries.jsonl"))
    problems.extend(_missing({d for rel in qrels.values() for d in rel}, corpus.lines,
                             "corpus", split, root / "corpus.jsonl"))
    return BeirData(root, split, corpus.docs, queries, qrels), corpus


def load_beir(root: str | Path, split: str = "test") -> BeirData:
    """Load a BEIR directory's corpus, the queries listed in ``qrels/<split>.tsv`` and the qrels.

    Raises:
        DataError: a missing file, a malformed line, a missing or repeated id, a text that is
            not a string (an empty one, for a query of the split), or a qrels id not in
            corpus/queries: every such problem, by file, line and field.
    """
    root = Path(root)
    problems: list[Problem] = []
    data, _ = _load(root, split, problems)
    _raise(problems, root)
    return data


def read_beir(root: str | Path, split: str = "train",
              problems: list[Problem] | None = None) -> list[Record]:
    """The (query, positive) pairs of a BEIR split as records, in the order of the qrels
    file: one per relevant qrel (score > 0), with the query and corpus ids, the document's
    text ("title text") or its page image, and ``root`` as the source. The one way a BEIR
    directory becomes records: conversion, validation and training read it here. A split
    without a relevant qrel (nothing to train on), or a pair whose document is empty, is a
    problem too. Problems are added to ``problems`` when it is given (``bigbatch
    validate``), else raised.

    Raises:
        DataError: as :func:`load_beir` (without ``problems``); a qrels file that cannot be
            read (always).
    """
    root = Path(root)
    found: list[Problem] = [] if problems is None else problems
    data, corpus = _load(root, split, found)
    out = []
    empty: set[str] = set()
    relevant = 0
    for qid, rels in data.qrels.items():
        for did, score in rels.items():
            relevant += score > 0
            if score <= 0 or qid not in data.queries or did not in data.corpus:
                continue  # a missing or bad query or document is a problem of _load
            doc = data.corpus[did]
            if isinstance(doc, str) and not doc.strip():
                if did not in empty:
                    empty.add(did)
                    found.append(Problem(str(root / "corpus.jsonl"), corpus.lines.get(did),
                                         "text", f"must be non-empty text: document {shown(did)} "
                                         f"of a training pair has no title and no text"))
                continue
            doc = Doc(image=doc.path, id=did) if isinstance(doc, ImageDoc) else \
                Doc(text=doc, id=did)
            out.append(Record(data.queries[qid], doc, [], qid, 0, str(root)))
    if not relevant:
        found.append(Problem(str(root / "qrels" / f"{split}.tsv"), None, "score",
                             f"no relevant judgement (score > 0) among {len(data.qrels)} "
                             f"quer{'y' if len(data.qrels) == 1 else 'ies'}: nothing to train "
                             f"on; training pairs are the qrels whose score is above 0"))
    if problems is None:
        _raise(found, root)
    return out


def check_corpus_ids(ids: Sequence[str], path: str | Path) -> None:
    """Check that the document ids read from a corpus file (``ids``, in file order) are
    unique: a document listed twice is retrieved twice, and recall and nDCG go above 1. The
    file is read again only when they are not, to name the line.

    Raises:
        DataError: naming the file, the line and the repeated id.
    """
    if len(set(ids)) == len(ids):
        return
    problems: list[Problem] = []
    for _ in _id_lines(Path(path), problems):
        pass
    repeats = [p for p in problems if p.field == "_id" and p.message.startswith("duplicate")]
    _raise(repeats[:1], Path(path))
    seen: set[str] = set()
    dup = next(d for d in ids if d in seen or seen.add(d))  # the file changed meanwhile
    raise DataError(f"document id {shown(dup)} appears more than once; every id must be unique",
                    path=str(path), field="_id")


def beir_training_records(root: str | Path, split: str = "train",
                          data_root: str | Path | None = None) -> list[TrainRecord]:
    """Training records from a BEIR split (:func:`read_beir`), sorted by query id (shorter
    first) and document id, with ``qrels/<split>.tsv`` as their source. With ``data_root``,
    every page image of the corpus must resolve inside that folder.

    Raises:
        DataError: as :func:`read_beir`, or listing the page images that cannot be read (or
            lie outside ``data_root``).
    """
    source = str(Path(root) / "qrels" / f"{split}.tsv")
    records = [TrainRecord(query=r.query,
                           positive=ImageDoc(r.positive.image) if r.positive.image else
                           r.positive.text or "",
                           negatives=[], positive_id=r.positive.id or "", source=source,
                           line=0, query_id=r.query_id or "")
               for r in sorted(read_beir(root, split), key=_by_ids)]
    _check_images(records, Path(root), data_root)
    return records


def _by_ids(r: Record) -> tuple[int, str, str]:
    """Training order: query ids by length, then as text (1, 2, 10), then document ids."""
    qid, did = r.query_id or "", r.positive.id or ""
    return len(qid), qid, did


def _check_images(records: list[TrainRecord], root: Path, data_root: str | Path | None) -> None:
    """Every page image the records use must open, and with ``data_root`` every page image
    of the corpus (training may take any as a negative) must lie inside that folder, or the
    run stops before training."""
    corpus_path = root / "corpus.jsonl"
    problems: list[object] = []
    if data_root:
        corpus = _read_corpus(root, [])
        for did, doc in corpus.docs.items():
            why = outside_root(doc.path, data_root) if isinstance(doc, ImageDoc) else None
            if why is not None:
                problems.append(Problem(str(corpus_path), corpus.lines[did], "image", why))
    seen: set[str] = set()
    for r in records:
        if isinstance(r.positive, ImageDoc) and r.positive.path not in seen:
            seen.add(r.positive.path)
            why = check_image(r.positive.path)
            if why is not None:
                problems.append(f"document {shown(r.positive_id)}: {why}")
    if problems:
        raise DataError(f"{len(problems)} page image(s) that cannot be used:\n  "
                        + "\n  ".join(problem_lines(problems)), path=str(corpus_path),
                        field="image")


def count_records(path: str | Path) -> int | None:
    """Lines of a JSONL file that hold something (the total of a progress bar: one pass over
    its bytes); None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return None


def iter_corpus(path: str | Path, block: int = 4096) -> Iterator[list[tuple[str, str]]]:
    """Yield blocks of (doc_id, document) from a corpus.jsonl, reading it lazily; a document
    is "title text", or an :class:`~bigbatch.data.records.types.ImageDoc` for a record with an
    ``image`` field."""
    path = Path(path)
    if not path.exists():
        raise DataError("corpus file not found", path=str(path))
    buf: list[tuple[str, str]] = []
    for n, rec, problem in iter_jsonl(path):
        if problem is not None:
            raise DataError(problem, path=str(path), line=n, field=problem.field)
        if "_id" not in rec or not isinstance(rec.get("text", ""), str):
            raise DataError("a corpus record needs '_id' and 'text'", path=str(path), line=n)
        for key in ("title", "text"):
            value = rec.get(key)
            if isinstance(value, str) and (why := text_too_long(value)) is not None:
                raise DataError(f"the text {why}", path=str(path), line=n, field=key)
        buf.append((str(rec["_id"]), corpus_doc(rec, path.parent)))
        if len(buf) == block:
            yield buf
            buf = []
    if buf:
        yield buf


def corpus_texts(path: str | Path, ids: set[str]) -> dict[str, str]:
    """Texts of just the documents ``ids`` (a second streaming pass)."""
    out = {}
    for block in iter_corpus(path):
        out.update((d, t) for d, t in block if d in ids)
    return out
