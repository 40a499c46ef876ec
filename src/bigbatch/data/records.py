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
from .formats import Doc, Problem, _read_contrastors
from .images import ImageDoc, check_image

__all__ = ["TrainRecord", "load_jsonl_records", "load_records"]

MAX_REPORTED = 20


@dataclass
class TrainRecord:
    """One training example. ``positive_id`` names the positive document (its corpus id when
    the data gives one, else its content key). ``positive_key`` is its content key (a text
    hash, or an image's path), the identity negatives are compared by: the same passage
    twice in a batch is never a negative, however each record named it."""

    query: str
    positive: str | ImageDoc
    negatives: list[str | ImageDoc] = field(default_factory=list)
    positive_id: str = ""
    source: str = ""
    line: int = 0
    query_id: str = ""
    positive_key: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        from .images import doc_key

        self.positive_key = doc_key(self.positive)
        if not self.positive_id:
            self.positive_id = self.positive_key


def text_id(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _resolve(doc: Doc, base: Path, path: Path, line: int,
             problems: list[Problem]) -> str | ImageDoc | None:
    """A parsed document as training input: its text, the text of its file, or an
    :class:`ImageDoc` for a readable image; None (and a problem) otherwise."""
    if doc.text is not None:
        return doc.text
    ref = Path(doc.image or doc.path or "")
    full = ref if ref.is_absolute() else base / ref
    if doc.image is not None:
        why = check_image(full)
        if why is not None:
            problems.append(Problem(str(path), line, doc.key, why))
            return None
        return ImageDoc(str(full.resolve()))
    try:
        text = full.read_text(encoding="utf-8")
    except OSError as e:
        problems.append(Problem(str(path), line, doc.key,
                                f"cannot read {str(full)!r}: {e.strerror or e}"))
        return None
    if not text.strip():
        problems.append(Problem(str(path), line, doc.key, f"{str(full)!r} is empty"))
        return None
    return text


def load_jsonl_records(path: str | Path) -> list[TrainRecord]:
    """Load and validate a JSONL file of training records (parsed by the ``contrastors``
    reader of :mod:`bigbatch.data.formats`, then each document file read or checked).

    Raises:
        DataError: listing every problem (up to 20 shown, with the total) by file, line, field.
    """
    path = Path(path)
    if not path.exists():
        raise DataError("training data file not found", path=str(path))
    problems: list[Problem] = []
    parsed = _read_contrastors(path, problems)
    records: list[TrainRecord] = []
    for r in parsed:
        positive = _resolve(r.positive, path.parent, path, r.line, problems)
        negatives = [d for d in (_resolve(n, path.parent, path, r.line, problems)
                                 for n in r.negatives) if d is not None]
        if positive is None:
            continue
        if positive in negatives:
            problems.append(Problem(str(path), r.line, "negatives",
                                    "a negative equals the positive"))
            continue
        positive_id = r.positive.id or ""  # else its content key (TrainRecord decides)
        records.append(TrainRecord(query=r.query, positive=positive, negatives=negatives,
                                   positive_id=positive_id, source=str(path), line=r.line,
                                   query_id=r.query_id or ""))
    problems.sort(key=lambda p: p.line or 0)  # file order (stable within a line)
    if problems:
        shown = "\n  ".join(str(p) for p in problems[:MAX_REPORTED])
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
