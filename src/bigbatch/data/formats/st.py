"""The ``st`` format: sentence-transformers columns ``anchor``, ``positive``,
``negative_1..k``, as JSONL (``.jsonl``), Parquet (``.parquet``), CSV with a header
(``.csv``), or a folder written by ``datasets``' ``save_to_disk`` (a DatasetDict's
``--split``); Parquet and Arrow are streamed a record batch at a time. Text only. Teacher
scores (for distillation) are the columns ``pos_score`` and ``neg_score_1..k``, one per
negative in the negatives' order.

Without an ``anchor`` column the columns are read by position, as sentence-transformers'
losses take them (``query, positive, negative``, ``question, answer``); a ``label`` or
``score`` column cannot be held (reported). Detected for Parquet, CSV and ``datasets``
folders (unless they hold colpali data), and for JSONL whose first record has ``anchor``,
none of the contrastors keys, or ``negative`` / ``negative_N`` beside ``query`` and
``positive``.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from pathlib import Path

from ...errors import DataError
from ..files import open_data_file
from ..tables import is_hf_dataset, table_rows
from ..types import Doc, Problem, Record
from .colpali import is_colpali, not_converted_problem
from .common import (ID_KEY, Format, WriteOptions, jsonl_rows, read_all, text_field,
                     text_only, with_scores, write_jsonl)
from .contrastors import CONTRASTORS_KEYS

__all__ = ["FORMAT"]

_NEGATIVE = re.compile(r"negative(_\d+)?$")
_LABELS = ("label", "score")
_NEG_SCORE = re.compile(r"neg_score_(\d+)$")


def _score_columns(rec: dict) -> list[str]:
    """The teacher-score columns of a row: ``pos_score``, then ``neg_score_N`` by ``N``."""
    negs = sorted((k for k in rec if _NEG_SCORE.match(k)),
                  key=lambda k: int(_NEG_SCORE.match(k).group(1)))
    return (["pos_score"] if "pos_score" in rec else []) + negs


def detect_path(path: Path) -> bool:
    """A ``datasets`` folder, or a Parquet or CSV file."""
    if path.is_dir():
        return is_hf_dataset(path)
    return path.suffix.lower() in (".parquet", ".csv")


def detect_keys(keys: set) -> bool:
    """A first record with named or positional sentence-transformers columns."""
    return "anchor" in keys or not keys & CONTRASTORS_KEYS or (
        not keys & {"chunk_path", "neg_chunk_paths", "negatives"}
        and any(_NEGATIVE.match(k) for k in keys))


def _csv_rows(path: Path, problems: list[Problem]) -> Iterator[tuple[int, dict]]:
    """Rows of a CSV file with a header (the line number of the row's first line)."""
    with open_data_file(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        try:
            reader.fieldnames  # reads the header
            line = reader.line_num
            for row in reader:
                start, line = line + 1, reader.line_num
                if None in row or None in row.values():
                    problems.append(Problem(str(path), start, None,
                                            f"{len(reader.fieldnames or [])} columns in the "
                                            f"header, another number here"))
                    continue
                yield start, row
        except (csv.Error, UnicodeDecodeError) as e:
            problems.append(Problem(str(path), reader.line_num + 1, None, f"cannot read as CSV"
                                    f" ({e}); write it as UTF-8 CSV with a header"))


def _rows(path: Path, problems: list[Problem], split: str) -> Iterator[tuple[int, dict]]:
    if path.is_dir() or path.suffix.lower() == ".parquet":
        yield from table_rows(path, split)
    elif path.suffix.lower() == ".csv":
        yield from _csv_rows(path, problems)
    else:
        yield from jsonl_rows(path, problems)


def parse(rec: dict, path: Path, n: int, problems: list[Problem]) -> Record | None:
    """The record of one row of sentence-transformers columns (``rec``, row or line ``n`` of
    ``path``), or None, with what is wrong added to ``problems`` (see :func:`stream`)."""
    w = (str(path), n)
    lost = [(k, f"a {k!r} column (bigbatch trains on (anchor, positive, negatives); "
                f"labelled or scored pairs are not all positives)")
            for k in _LABELS if k in rec]
    score_cols = _score_columns(rec)
    cols = [k for k in rec if k not in _LABELS and k not in score_cols]
    if "anchor" in rec:
        q = text_field(rec, "anchor", w, problems)
        p = text_field(rec, "positive", w, problems)
        neg_keys = [k for k in cols if _NEGATIVE.match(k)]
        for k in cols:
            if k not in ("anchor", "positive") and k not in neg_keys:
                problems.append(Problem(str(path), n, k, "not read: sentence-transformers "
                                        "columns are anchor, positive, negative_1..k"))
    elif len(cols) < 2:
        problems.append(Problem(str(path), n, None, f"{_columns(cols)} read by position "
                                f"(no 'anchor' column): needs a first column (the anchor) "
                                f"and a second (the positive), or columns named anchor, "
                                f"positive, negative_1..k"))
        return None
    else:
        for k in [k for k in cols if ID_KEY.search(k)]:
            problems.append(Problem(str(path), n, k, "not read: an id column among "
                                    "columns read by position (the first is the anchor, "
                                    "the second the positive, the rest negatives); "
                                    "remove it"))
            cols.remove(k)
        if len(cols) < 2:
            return None
        q = text_field(rec, cols[0], w, problems)
        p = text_field(rec, cols[1], w, problems)
        neg_keys = cols[2:]
    negs = []
    for key in neg_keys:
        t = text_field(rec, key, w, problems)
        if t is not None:
            negs.append(Doc(text=t, key=key))
    if q is None or p is None:
        return None
    qkey, pkey = ("anchor", "positive") if "anchor" in rec else (cols[0], cols[1])
    pos = Doc(text=p, key=pkey)
    if score_cols:
        neg_cols = [k for k in score_cols if k != "pos_score"]
        pos, negs = with_scores(rec.get("pos_score"), [rec[k] for k in neg_cols],
                                neg_cols, pos, negs, len(neg_keys), w, problems)
    return Record(q, pos, negs, None, n, str(path), lost,
                  unread_negatives=len(neg_keys) - len(negs), query_key=qkey)


def stream(path: Path, problems: list[Problem], split: str = "train") -> Iterator[Record]:
    """sentence-transformers columns, one record at a time. As sentence-transformers' losses
    take them: named ``anchor``, ``positive``, ``negative`` / ``negative_1..k`` (any other
    column is reported, not read), or, without an ``anchor`` column, by position: the first
    column is the anchor, the second the positive, the rest negatives (``query, positive,
    negative``; ``question, answer``). A ``label`` or ``score`` column cannot be held: such
    pairs are not all positives (reported). colpali data (page images held in the rows) is
    a problem saying how to convert it."""
    if is_colpali(path, split):  # training reads image files, so convert first
        problems.append(not_converted_problem(path))
        return
    for n, rec in _rows(path, problems, split):
        r = parse(rec, path, n, problems)
        if r is not None:
            yield r


read = read_all(stream)


def _columns(cols: list[str]) -> str:
    """The columns of a row as a message names them."""
    if not cols:
        return "no column"
    return f"{'one column' if len(cols) == 1 else 'columns'} {', '.join(map(repr, cols))}"


def _write_parquet(records: list[Record], out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    k = max((len(r.negatives) for r in records), default=0)
    if any(len(r.negatives) != k for r in records):
        raise DataError("sentence-transformers columns need the same number of negatives "
                        "in every record", path=str(out))
    cols: dict[str, list] = {"anchor": [r.query for r in records],
                             "positive": [r.positive.text for r in records]}
    for i in range(k):
        cols[f"negative_{i + 1}"] = [r.negatives[i].text for r in records]
    if _all_scored(records, out):
        cols["pos_score"] = [r.positive.score for r in records]
        for i in range(k):
            cols[f"neg_score_{i + 1}"] = [r.negatives[i].score for r in records]
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), out)


def _write_csv(records: list[Record], out: Path) -> None:
    k = max((len(r.negatives) for r in records), default=0)
    scored = _all_scored(records, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["anchor", "positive", *(f"negative_{i + 1}" for i in range(k))]
                   + (["pos_score", *(f"neg_score_{i + 1}" for i in range(k))] if scored else []))
        for r in records:
            if len(r.negatives) != k:
                raise DataError("CSV columns need the same number of negatives in every "
                                f"record ({r.source}:{r.line} has {len(r.negatives)}, "
                                f"another {k})", path=str(out))
            w.writerow([r.query, r.positive.text, *(d.text for d in r.negatives)]
                       + ([r.positive.score, *(d.score for d in r.negatives)] if scored else []))


def write(records: list[Record], out: Path, options: WriteOptions) -> None:
    """Write ``records`` as Parquet (``.parquet``), CSV (``.csv``) or JSONL (else).

    Raises:
        DataError: Parquet or CSV, and records with different numbers of negatives.
    """
    if out.suffix.lower() == ".parquet":
        _write_parquet(records, out)
    elif out.suffix.lower() == ".csv":
        _write_csv(records, out)
    else:
        write_jsonl(out, ({"anchor": r.query, "positive": r.positive.text,
                           **{f"negative_{i + 1}": d.text for i, d in enumerate(r.negatives)},
                           **_score_fields(r)}
                          for r in records))


def _score_fields(r: Record) -> dict[str, float]:
    """A record's teacher scores as st columns (none when it has none)."""
    if r.positive.score is None or any(d.score is None for d in r.negatives):
        return {}
    return {"pos_score": r.positive.score,
            **{f"neg_score_{i + 1}": d.score for i, d in enumerate(r.negatives)}}


def _all_scored(records: list[Record], out: Path) -> bool:
    """Whether every record has teacher scores (a table's columns need all or none).

    Raises:
        DataError: some records have them and others not."""
    scored = [bool(_score_fields(r)) for r in records]
    if any(scored) and not all(scored):
        first = next(r for r, s in zip(records, scored) if not s)
        raise DataError(f"some records carry teacher scores and others not ({first.source}:"
                        f"{first.line} has none); table columns need them in every record or "
                        f"in none: write JSONL (.jsonl), or drop the scores", path=str(out))
    return any(scored)


FORMAT = Format("st", read, detect_path=detect_path, detect_keys=detect_keys, write=write,
                cannot_hold=lambda r: text_only("st", r),
                suffixes=(".jsonl", ".parquet", ".csv"), stream=stream, parse=parse)
