"""The ``beir`` format: a BEIR directory (``corpus.jsonl``, ``queries.jsonl``,
``qrels/<split>.tsv``), detected for any folder that is not a ``datasets`` folder. Text
documents and (query, positive) pairs only. A document's title is read joined to its text
("title text", what training and evaluation embed), since no other format has a title
field; a BEIR directory written here has empty titles and the joined text. Reading is
:func:`bigbatch.data.readers.beir_dir.read_beir`, the one path from a BEIR directory to records.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from pathlib import Path

from ..readers.beir_dir import read_beir
from ..readers.tables import is_hf_dataset
from ..records.types import Problem, Record, text_id
from .common import Format, WriteOptions, text_only

__all__ = ["FORMAT"]


def read(path: Path, problems: list[Problem], split: str = "train") -> list[Record]:
    """The (query, positive) pairs of ``split``
    (:func:`~bigbatch.data.readers.beir_dir.read_beir`), its
    problems added to ``problems``."""
    return read_beir(path, split, problems)


def cannot_hold(r: Record) -> str | None:
    """Why beir cannot hold ``r``: a document that is not text, or negatives."""
    why = text_only("beir", r)
    if why is None and r.negatives:
        why = f"beir holds no negatives ({len(r.negatives)} here)"
    if why is None and r.positive.score is not None:
        why = "beir holds no teacher scores (pos_score)"
    return why


def write(records: Iterable[Record], out: Path, options: WriteOptions) -> None:
    """Write ``records`` as a BEIR directory ``out`` with the qrels of ``options.split``;
    queries and documents without ids are named by a hash of their text."""
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    corpus: dict[str, str] = {}
    queries: dict[str, str] = {}
    qrels: list[tuple[str, str]] = []
    for r in records:
        qid = r.query_id or "q" + text_id(r.query)
        did = r.positive.id or "d" + text_id(r.positive.text or "")
        queries[qid] = r.query
        corpus[did] = r.positive.text or ""
        qrels.append((qid, did))
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        for did, text in corpus.items():
            f.write(json.dumps({"_id": did, "title": "", "text": text}, ensure_ascii=False) + "\n")
    with open(out / "queries.jsonl", "w", encoding="utf-8") as f:
        for qid, text in queries.items():
            f.write(json.dumps({"_id": qid, "text": text}, ensure_ascii=False) + "\n")
    with open(out / "qrels" / f"{options.split}.tsv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["query-id", "corpus-id", "score"])
        w.writerows((q, d, 1) for q, d in dict.fromkeys(qrels))


FORMAT = Format("beir", read, detect_path=lambda path: path.is_dir() and not is_hf_dataset(path),
                write=write, cannot_hold=cannot_hold, writes_folder=True)
