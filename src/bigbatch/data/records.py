"""Training records and their validation.

A record is one query, one positive document and zero or more negatives. JSONL files may
use the seed pipeline's keys (``query``; the positive as ``positive`` text or ``chunk_path``,
a path to a text file or a page image; negatives as ``negatives`` texts or
``neg_chunk_paths``). Relative paths resolve against the JSONL file's folder. Image paths
become :class:`~bigbatch.data.images.ImageDoc` documents, opened only when their chunk is
embedded; each one is checked to be a readable image here. Every problem in a file is
collected and reported with file, line and field before training starts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from .images import IMAGE_SUFFIXES, ImageDoc, check_image

__all__ = ["TrainRecord", "load_jsonl_records", "load_records"]

MAX_REPORTED = 20


@dataclass
class TrainRecord:
    """One training example. ``positive_id`` identifies the positive document (corpus id, file
    path or a text hash) so the same passage twice in a batch is not a negative."""

    query: str
    positive: str | ImageDoc
    negatives: list[str | ImageDoc] = field(default_factory=list)
    positive_id: str = ""
    source: str = ""
    line: int = 0
    query_id: str = ""

    def __post_init__(self) -> None:
        if not self.positive_id:
            from .images import doc_key
            self.positive_id = doc_key(self.positive)


def text_id(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _read_doc_file(value: object, base: Path, where: dict,
                   problems: list[str]) -> str | ImageDoc | None:
    """A text file's text, or an :class:`ImageDoc` for a readable image; None on a problem."""
    if not isinstance(value, str) or not value.strip():
        problems.append(_fmt(where, "must be a non-empty path string"))
        return None
    p = Path(value)
    p = p if p.is_absolute() else base / p
    if p.suffix.lower() in IMAGE_SUFFIXES:
        why = check_image(p)
        if why is not None:
            problems.append(_fmt(where, why))
            return None
        return ImageDoc(str(p.resolve()))
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        problems.append(_fmt(where, f"cannot read {str(p)!r}: {e.strerror or e}"))
        return None
    if not text.strip():
        problems.append(_fmt(where, f"{str(p)!r} is empty"))
        return None
    return text


def _fmt(where: dict, msg: str) -> str:
    return str(DataError(msg, path=where["path"], line=where["line"], field=where["field"]))


def load_jsonl_records(path: str | Path) -> list[TrainRecord]:
    """Load and validate a JSONL file of training records.

    Raises:
        DataError: listing every problem (up to 20 shown, with the total) by file, line, field.
    """
    path = Path(path)
    if not path.exists():
        raise DataError("training data file not found", path=str(path))
    base = path.parent
    records: list[TrainRecord] = []
    problems: list[str] = []
    from .jsonl import iter_jsonl

    for n, rec, problem in iter_jsonl(path):
        if problem is not None:
            problems.append(str(DataError(problem, path=str(path), line=n)))
            continue
        where = {"path": str(path), "line": n, "field": "query"}
        query = rec.get("query")
        if not isinstance(query, str) or not query.strip():
            problems.append(_fmt(where, "missing or empty query"))
            query = None
        positive, positive_id = None, ""
        if "positive" in rec:
            where["field"] = "positive"
            if isinstance(rec["positive"], str) and rec["positive"].strip():
                positive = rec["positive"]
            else:
                problems.append(_fmt(where, "must be non-empty text"))
        elif "chunk_path" in rec:
            where["field"] = "chunk_path"
            positive = _read_doc_file(rec["chunk_path"], base, where, problems)
            positive_id = positive.path if isinstance(positive, ImageDoc) else str(rec["chunk_path"])
        else:
            where["field"] = "positive"
            problems.append(_fmt(where, "missing positive: give 'positive' text or "
                                        "'chunk_path'"))
        negatives: list[str | ImageDoc] = []
        for key in ("negatives", "neg_chunk_paths"):
            if key not in rec:
                continue
            values = rec[key]
            if not isinstance(values, list):
                where["field"] = key
                problems.append(_fmt(where, "must be a list"))
                continue
            for i, v in enumerate(values):
                where["field"] = f"{key}[{i}]"
                if key == "negatives":
                    if isinstance(v, str) and v.strip():
                        negatives.append(v)
                    else:
                        problems.append(_fmt(where, "must be non-empty text"))
                else:
                    doc = _read_doc_file(v, base, where, problems)
                    if doc is not None:
                        negatives.append(doc)
        if query is not None and positive is not None:
            if positive in negatives:
                where["field"] = "negatives"
                problems.append(_fmt(where, "a negative equals the positive"))
            records.append(TrainRecord(query=query, positive=positive, negatives=negatives,
                                       positive_id=positive_id, source=str(path), line=n,
                                       query_id=str(rec.get("query_id", rec.get("id", "")))))
    if problems:
        shown = "\n  ".join(problems[:MAX_REPORTED])
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise DataError(f"{len(problems)} problem(s) in the training data:\n  {shown}{more}")
    if not records:
        raise DataError("no training records", path=str(path))
    return records


def load_records(source: str | Path, split: str = "train", num_hard_negatives: int = 0) -> list[TrainRecord]:
    """Training records from a JSONL file or a BEIR directory, checked for ``k`` negatives.

    Raises:
        DataError: bad records, or fewer than ``num_hard_negatives`` negatives on a record.
    """
    source = Path(source)
    if source.is_dir():
        from .beir import beir_training_records

        records = beir_training_records(source, split)
        if num_hard_negatives > 0:
            raise DataError(f"BEIR directory {source} has no hard negatives, but "
                            f"--num-hard-negatives is {num_hard_negatives}; mine negatives into "
                            f"a JSONL file first, or use 0")
        return records
    records = load_jsonl_records(source)
    if num_hard_negatives > 0:
        short = [r for r in records if len(r.negatives) < num_hard_negatives]
        if short:
            lines = ", ".join(str(r.line) for r in short[:10])
            raise DataError(f"{len(short)} record(s) have fewer than --num-hard-negatives="
                            f"{num_hard_negatives} negatives (lines {lines}"
                            f"{', ...' if len(short) > 10 else ''})", path=str(source),
                            field="negatives")
    return records
