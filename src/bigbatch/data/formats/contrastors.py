"""The ``contrastors`` format: Qwen3-VL-Embedding's training pipeline's JSONL. Documents as files,
``{"query", "chunk_path", "neg_chunk_paths"}`` (page images or text files), or as text,
``{"query", "positive", "negatives"}``; ids as ``query_id`` / ``positive_id`` /
``negative_ids``; teacher scores (for distillation) as ``pos_score`` and ``neg_scores``.
Detected for JSONL that neither swift nor st claims."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..records.types import Doc, Problem, Record, is_image_path
from .common import (
    ID_KEY,
    SCORE_KEYS,
    Format,
    WriteOptions,
    add_ids,
    add_scores,
    jsonl_stream,
    read_all,
    text_field,
    with_ids,
    with_scores,
    write_jsonl,
)

__all__ = ["FORMAT", "CONTRASTORS_KEYS"]

# the keys the contrastors reader reads
CONTRASTORS_KEYS = {"query", "query_id", "positive", "positive_id", "chunk_path", "negatives",
                    "neg_chunk_paths", "negative_ids", *SCORE_KEYS}
# a key the contrastors reader does not read but that looks like data: a document, several
# positives, an instruction (sentence-transformers' negative_1, FlagEmbedding's pos / neg /
# prompt, nomic's document, ...); metadata keys (source, score, ...) are left alone
_DATA_LIKE = re.compile(r"neg|pos|doc|passage|answer|image|instruct|prompt|system|anchor",
                        re.IGNORECASE)


def _doc(v: Any, key: str, where: tuple[str, int], problems: list[Problem],
         as_path: bool) -> Doc | None:
    if not isinstance(v, str) or not v.strip():
        problems.append(Problem(where[0], where[1], key, "must be non-empty " +
                                ("path" if as_path else "text")))
        return None
    if not as_path:
        return Doc(text=v, key=key)
    return Doc(image=v, key=key) if is_image_path(v) else Doc(path=v, key=key)


def parse(rec: dict, path: Path, n: int, problems: list[Problem]) -> Record | None:
    """The record of one contrastors line (the object ``rec`` on line ``n`` of ``path``),
    or None, with what is wrong added to ``problems``."""
    w = (str(path), n)
    q = text_field(rec, "query", w, problems)
    if "chunk_path" in rec:
        pos = _doc(rec["chunk_path"], "chunk_path", w, problems, True)
    elif "positive" in rec:
        pos = _doc(rec["positive"], "positive", w, problems, False)
    else:
        problems.append(Problem(str(path), n, "positive", "missing positive: give "
                                "'positive' text or 'chunk_path'"))
        pos = None
    negs: list[Doc] = []
    unread = 0
    for key, as_path in (("neg_chunk_paths", True), ("negatives", False)):
        if key not in rec:
            continue
        if not isinstance(rec[key], list):
            problems.append(Problem(str(path), n, key, "must be a list"))
            continue
        for i, v in enumerate(rec[key]):
            d = _doc(v, f"{key}[{i}]", w, problems, as_path)
            if d is not None:
                negs.append(d)
            else:
                unread += 1
    for key in rec:
        if key not in CONTRASTORS_KEYS and _DATA_LIKE.search(key) \
                and not ID_KEY.search(key):
            problems.append(Problem(str(path), n, key, "not read: the contrastors format "
                                    "takes 'query', the positive as 'positive' or "
                                    "'chunk_path', negatives as 'negatives' or "
                                    "'neg_chunk_paths' (sentence-transformers columns: "
                                    "--format st)"))
    if q is None or pos is None:
        return None
    qid = rec.get("query_id")
    pos, negs = with_ids(rec, pos, negs)
    pos, negs = with_scores(rec.get("pos_score"), rec.get("neg_scores"), "neg_scores",
                            pos, negs, len(negs) + unread, w, problems)
    return Record(q, pos, negs, None if qid is None else str(qid), n, str(path),
                  unread_negatives=unread)


# the records of a contrastors JSONL file, one at a time or as a list (``split`` is not used)
stream = jsonl_stream(parse)
read = read_all(stream)


def cannot_hold(r: Record) -> str | None:
    """Why contrastors cannot hold ``r``: text beside an image, or files mixed with text."""
    docs = [r.positive, *r.negatives]
    if any(d.image and d.text for d in docs):
        return "contrastors holds no text beside an image"
    if len({d.kind == 'text' for d in docs}) > 1:
        return "contrastors keeps a record's documents all as files or all as text"
    return None


def _file(d: Doc) -> str:
    return d.image or d.path or d.text or ""


def to_json(r: Record) -> dict[str, Any]:
    """One contrastors line: documents as files (``chunk_path``) or as text (``positive``)."""
    rec: dict[str, Any] = {"query": r.query}
    if r.positive.kind != "text":
        rec["chunk_path"] = _file(r.positive)
        rec["neg_chunk_paths"] = [_file(d) for d in r.negatives]
    else:
        rec["positive"] = r.positive.text
        rec["negatives"] = [d.text for d in r.negatives]
    add_ids(rec, r)
    add_scores(rec, r)
    return rec


def write(records: Iterable[Record], out: Path, options: WriteOptions) -> None:
    """Write ``records`` as contrastors JSONL."""
    write_jsonl(out, (to_json(r) for r in records))


FORMAT = Format("contrastors", read, detect_keys=lambda keys: True, write=write,
                cannot_hold=cannot_hold, stream=stream, parse=parse)
